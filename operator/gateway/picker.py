"""Which replica serves a request: a pure function of the replicas, their loads and the
request's prefix key. Returns the full preference order, so a retry goes to the next one,
and the reason, which the gateway counts."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

from .hashing import DEFAULT_LOAD_FACTOR, DEFAULT_VIRTUAL_NODES, HashRing, bounded_order
from .replicas import Replica

Policy = Literal["prefix", "least-loaded", "round-robin"]
POLICIES: tuple[str, ...] = ("prefix", "least-loaded", "round-robin")
DEFAULT_KV_SATURATION = 0.95

# Reasons (the `reason` label of kvpilot_gateway_routing_decisions_total).
PREFIX_HIT = "prefix"  # the key's own replica on the ring
PREFIX_SPILL = "prefix_spill"  # the key's replica was at its load bound or saturated: the next one
LEAST_LOADED = "least_loaded"  # no key (or the least-loaded policy)
ROUND_ROBIN = "round_robin"


@dataclass(frozen=True)
class Route:
    order: tuple[Replica, ...]  # first choice first; retries take the next
    reason: str


class Picker:
    """Per model: a ring rebuilt only when the replica set changes, and a round-robin
    counter. Not thread-safe; the gateway's event loop owns it."""

    def __init__(self, policy: Policy = "prefix", load_factor: float = DEFAULT_LOAD_FACTOR,
                 virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
                 kv_saturation: float = DEFAULT_KV_SATURATION) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if load_factor < 1:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.policy = policy
        self.load_factor = load_factor
        self.virtual_nodes = virtual_nodes
        self.kv_saturation = kv_saturation
        self._ring: HashRing | None = None
        self._turn = itertools.count()

    def _ring_for(self, names: tuple[str, ...]) -> HashRing:
        if self._ring is None or self._ring.replicas != names:
            self._ring = HashRing(names, self.virtual_nodes)
        return self._ring

    def pick(self, replicas: list[Replica], key: bytes | None) -> Route | None:
        """None when there is no replica to send to."""
        if not replicas:
            return None
        by_name = {r.name: r for r in replicas}
        if self.policy == "round-robin":
            ordered = sorted(replicas, key=lambda r: r.name)
            return Route(tuple(_rotated(ordered, next(self._turn))), ROUND_ROBIN)
        if self.policy == "least-loaded" or key is None:
            return Route(self._least_loaded(replicas), LEAST_LOADED)
        ring = self._ring_for(tuple(sorted(by_name)))
        loads = {r.name: r.queue_depth() for r in replicas}
        names, _ = bounded_order(ring, key, loads, self.load_factor)
        # A saturated pod (waiting with a full KV cache) goes behind the others, keeping order.
        names = ([n for n in names if not by_name[n].saturated(self.kv_saturation)]
                 + [n for n in names if by_name[n].saturated(self.kv_saturation)])
        own = ring.walk(key)[0]
        return Route(tuple(by_name[n] for n in names), PREFIX_HIT if names[0] == own else PREFIX_SPILL)

    def _least_loaded(self, replicas: list[Replica]) -> tuple[Replica, ...]:
        """Least loaded first. Equally loaded replicas take turns at the front of their
        group (by name, rotated once per pick), so idle replicas share the requests
        instead of the first by name taking every one that finds it idle."""
        turn = next(self._turn)
        ranked = sorted(replicas, key=lambda r: (self._load_rank(r), r.name))
        order: list[Replica] = []
        for _, tied in itertools.groupby(ranked, key=self._load_rank):
            order += _rotated(list(tied), turn)
        return tuple(order)

    def _load_rank(self, replica: Replica) -> tuple:
        return replica.saturated(self.kv_saturation), replica.queue_depth(), replica.load.kv_usage


def _rotated(items: list, turn: int) -> list:
    start = turn % len(items)
    return items[start:] + items[:start]
