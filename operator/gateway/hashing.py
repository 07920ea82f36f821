"""Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018).

A prefix hashes to a point on a ring of virtual nodes; it goes to the first replica
clockwise whose load is under ceil(load_factor * (total_load + 1) / replicas). Adding or
removing one of N replicas moves about 1/N of the prefixes; the bound keeps one hot prefix
from piling onto one replica (it spills to the next replica on the ring, which then warms
the same prefix)."""
from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping

DEFAULT_VIRTUAL_NODES = 100
DEFAULT_LOAD_FACTOR = 1.25  # KubeAI's default; 1 + epsilon in the paper


def hash64(data: bytes) -> int:
    """A stable 64-bit hash (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Replica ids placed on a ring, `virtual_nodes` points each."""

    def __init__(self, replicas: Iterable[str], virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self.replicas = tuple(sorted(set(replicas)))
        points = sorted((hash64(f"{r}#{i}".encode()), r) for r in self.replicas for i in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._owners = [r for _, r in points]

    def walk(self, key: bytes) -> list[str]:
        """Every replica once, in ring order from the key's point: the preference list."""
        if not self.replicas:
            return []
        start = bisect.bisect_left(self._hashes, hash64(key)) % len(self._hashes)
        order: list[str] = []
        seen: set[str] = set()
        for i in range(len(self._owners)):
            owner = self._owners[(start + i) % len(self._owners)]
            if owner not in seen:
                seen.add(owner)
                order.append(owner)
                if len(order) == len(self.replicas):
                    break
        return order


def load_bound(total_load: float, replicas: int, load_factor: float) -> int:
    """The most load one replica may hold once the next request is placed."""
    return max(1, math.ceil(load_factor * (total_load + 1) / replicas))


def bounded_order(ring: HashRing, key: bytes, loads: Mapping[str, float],
                  load_factor: float = DEFAULT_LOAD_FACTOR) -> tuple[list[str], bool]:
    """The ring's preference list with replicas at their bound moved behind the rest
    (still in ring order, so retries go on around the ring), and whether the key's own
    replica was passed over for load."""
    order = ring.walk(key)
    if not order:
        return [], False
    bound = load_bound(sum(loads.get(r, 0) for r in order), len(order), load_factor)
    under = [r for r in order if loads.get(r, 0) + 1 <= bound]
    over = [r for r in order if loads.get(r, 0) + 1 > bound]
    return under + over, bool(under) and under[0] != order[0]
