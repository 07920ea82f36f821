"""The virtual-clock simulator: replicas of the real engine with the simulated executor,
fed a request trace on a discrete-event clock. Nothing sleeps: each replica's clock
jumps by its modelled step times, and the fleet always advances whichever comes first,
the next arrival or the replica whose next step starts soonest.

A request that arrives while its replica is mid-step waits for the step to end, exactly
as in the real-time server. The router sees each replica as of its last step's end."""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable

from ..config.engine import EngineConfig
from .replica import Replica, SimRequest
from .replica_metrics import Sample
from .trace import TraceRequest
from ..config.validation import positive_int

ROUTERS = ("round-robin", "least-loaded")


def gpu_seconds(timeline: list[tuple[float, int]], start: float, end: float) -> float:
    """GPU-seconds between start and end of a timeline of (time, GPUs held from then on)."""
    total = 0.0
    for (t, n), nxt in zip(timeline, timeline[1:] + [(math.inf, 0)]):
        lo, hi = max(t, start), min(nxt[0], end)
        if hi > lo:
            total += n * (hi - lo)
    return total


@dataclass
class Scrape:
    time: float
    replica: int
    samples: list[Sample]


class Fleet:
    """Replicas of one engine configuration behind a router, on one virtual timeline."""

    def __init__(self, config: EngineConfig, replicas: int = 1, router: str = "round-robin",
                 scrape_interval: float | None = None, max_concurrency: int | None = None,
                 on_scrape: Callable[[Scrape], None] | None = None, keep_scrapes: bool = True,
                 client_timeout: float | None = None, fast_forward: bool = True) -> None:
        if config.simulate is None:
            raise ValueError("the fleet simulator needs a simulated accelerator (simulate=...)")
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
        positive_int("replicas", replicas)
        if scrape_interval is not None and not scrape_interval > 0:
            raise ValueError(f"scrape_interval must be positive, got {scrape_interval!r}")
        if max_concurrency is not None:
            positive_int("max_concurrency", max_concurrency)
        if client_timeout is not None and not client_timeout > 0:
            raise ValueError(f"client_timeout must be positive, got {client_timeout!r}")
        # A client that has had no token this long after sending gives up (the request is
        # aborted, as a closed connection aborts it in the server): (deadline, index, replica).
        self.client_timeout = client_timeout
        self._deadlines: list[tuple[float, int, Replica]] = []
        # Closed loop, as `bench serve --max-concurrency`: a request is sent once one of
        # the slots is free; the heap holds the times the free slots became free.
        self._slots: list[float] | None = [0.0] * max_concurrency if max_concurrency else None
        self.config, self.router = config, router
        self.fast_forward = fast_forward  # False: one step at a time, to the same result
        self.now = 0.0
        self.replicas: list[Replica] = []
        self.retired: list[Replica] = []
        self._ids = itertools.count()
        self._starting: list[float] = []  # when replicas being added become ready
        # (time, GPUs held from then on): serving, starting and draining replicas all hold
        # theirs, world_size each (tensor_parallel_size x pipeline_parallel_size).
        self.gpu_timeline: list[tuple[float, int]] = []
        self.num_speculative_tokens: int | None = None  # a live K set_limits applied, if any
        self.live_batched_tokens: int | None = None  # a live chunk budget set_limits applied, if any
        for _ in range(replicas):
            self.add_replica()
        self.vocab = self.replicas[0].engine.runner.tokens.low, self.replicas[0].engine.runner.vocab_size
        self.scrape_interval = scrape_interval
        self.scrapes: list[Scrape] = []
        self.on_scrape, self.keep_scrapes = on_scrape, keep_scrapes
        self._next_scrape = 0.0 if scrape_interval else None
        self.finished: list[SimRequest] = []
        self._rr = 0
        self._pending: list[TraceRequest] = []
        self._next = 0
        self._sims: list[SimRequest] = []

    # --- control (the autotuner's levers) -------------------------------------------------
    def add_replica(self, ready_in: float = 0.0) -> Replica | None:
        """A replica now, or (ready_in > 0) one that joins the router that much later, as
        a pod does once it has started and loaded its model."""
        if ready_in > 0:
            heapq.heappush(self._starting, self.now + ready_in)
            self._record_gpus()
            return None
        r = Replica(next(self._ids), self.config, self.now)
        if self.num_speculative_tokens is not None:  # a live K set earlier, as a pod's flags would carry
            r.engine.update_limits(num_speculative_tokens=self.num_speculative_tokens)
            r.metrics.record_stats(r.engine.stats())
        if self.live_batched_tokens is not None:  # as the tuning file reaches a new pod
            r.engine.update_limits(max_num_batched_tokens=self.live_batched_tokens)
        self.replicas.append(r)
        self._record_gpus()
        return r

    def remove_replica(self) -> None:
        """Cancel the replica started last, if one is still starting; else stop routing to
        the newest replica, which finishes what it holds and then retires."""
        if self._starting:
            self._starting.remove(max(self._starting))
            heapq.heapify(self._starting)
            self._record_gpus()
            return
        active = [r for r in self.replicas if not r.draining]
        if len(active) <= 1:
            raise ValueError("cannot remove the last replica")
        active[-1].draining = True
        self._retire()  # an idle one gives its GPU back at once

    def set_limits(self, **limits: int | None) -> None:
        """Live max_num_seqs / max_model_len / num_speculative_tokens on every replica
        (ValueError leaves them: the replicas share one model, so the first refuses before
        any changes)."""
        spec_k = limits.pop("num_speculative_tokens", None)
        # A live chunk budget stays in the engines (the config keeps the one they started with,
        # their ceiling); replicas added later get it applied below.
        self.live_batched_tokens = limits.get("max_num_batched_tokens") or self.live_batched_tokens
        config = replace(self.config, **{k: v for k, v in limits.items()
                                         if v is not None and k != "max_num_batched_tokens"})
        for r in self.replicas:
            r.sync_stats()
            r.engine.update_limits(**limits, num_speculative_tokens=spec_k)
        self.config = config  # replicas added later start with these
        if spec_k is not None:
            # Not an EngineConfig field (the configured K is the ceiling): kept to apply.
            self.num_speculative_tokens = spec_k

    def _record_gpus(self) -> None:
        n = (len(self.replicas) + len(self._starting)) * self.config.world_size
        if self.gpu_timeline and self.gpu_timeline[-1][0] == self.now:
            self.gpu_timeline[-1] = (self.now, n)
        elif not self.gpu_timeline or self.gpu_timeline[-1][1] != n:
            self.gpu_timeline.append((self.now, n))

    def gpu_seconds(self, start: float, end: float) -> float:
        """GPU-seconds held between start and end (a replica holds its GPUs from the moment it
        is asked for until it has drained, like a pod from scheduling to termination)."""
        return gpu_seconds(self.gpu_timeline, start, end)

    @property
    def num_replicas(self) -> int:
        """Replicas serving or starting (what a Deployment's spec.replicas would say)."""
        return sum(1 for r in self.replicas if not r.draining) + len(self._starting)

    # --- running ------------------------------------------------------------------------
    def submit(self, requests: Iterable[TraceRequest]) -> None:
        """Queue trace requests (sorted by arrival, all after the fleet's current time)."""
        new = sorted(requests, key=lambda r: r.arrival)
        if new and new[0].arrival < self.now:
            raise ValueError(f"request arrives at {new[0].arrival} before the simulator's time {self.now}")
        self._pending = self._pending[self._next:] + new
        self._pending.sort(key=lambda r: r.arrival)
        self._next = 0

    def run_until(self, t_end: float = math.inf) -> None:
        """Advance the timeline to t_end (a step that starts before it runs whole); with
        no t_end, until every submitted request has finished."""
        while True:
            arrival = self._next_arrival()
            # The busy replica whose next step starts first (the first such in list order).
            stepper, step_at = None, math.inf
            for r in self.replicas:
                if r.engine.scheduler.unfinished and r.clock.t < step_at:
                    stepper, step_at = r, r.clock.t
            if arrival is None and stepper is None and math.isinf(t_end):
                break
            event = min(math.inf if arrival is None else arrival,
                        math.inf if self._next_scrape is None else self._next_scrape,
                        self._starting[0] if self._starting else math.inf,
                        self._next_deadline())
            t = min(step_at, event)
            if math.isinf(t):
                t = t_end
            if t >= t_end:
                break
            self.now = max(self.now, t)
            if self._starting and t == self._starting[0]:
                heapq.heappop(self._starting)
                self.add_replica()
            elif self._next_scrape is not None and t == self._next_scrape:
                self._scrape(t)
            elif self._deadlines and t == self._deadlines[0][0]:
                _, index, replica = heapq.heappop(self._deadlines)
                sim = self._sims[index]
                if sim.finished is None and replica.give_up(str(index), t):
                    self._on_finished(sim)
                    if self.retired_pending():
                        self._retire()
            elif arrival is not None and t == arrival:
                if self._slots is not None:
                    heapq.heappop(self._slots)
                self._route(self._pending[self._next], t)
                self._next += 1
            else:
                stepper.step(self._on_finished, self._fast_forward_until(stepper, min(event, t_end)))
                # Only the replica that stepped can have become idle while draining.
                if stepper.draining and self.retired_pending():
                    self._retire()
        if not math.isinf(t_end):
            self.now = max(self.now, t_end)
        self._retire()
        for r in self.replicas + self.retired:  # whoever reads the metrics next sees the last step's
            r.sync_stats()

    def _next_deadline(self) -> float:
        """When the next client may give up. A deadline whose request has finished or had a
        token would do nothing, and as an event it would cut the fast-forward's runs: those
        at the front are dropped (most requests finish in time)."""
        while self._deadlines:
            _, index, replica = self._deadlines[0]
            if self._sims[index].finished is None and replica.may_give_up(str(index)):
                return self._deadlines[0][0]
            heapq.heappop(self._deadlines)
        return math.inf

    def _fast_forward_until(self, stepper: Replica, next_event: float) -> float | None:
        """How far `stepper` may fast-forward (None: one step): to the next event; in a closed
        loop, to another busy replica's clock too (a finish there frees a slot for an arrival)."""
        if not self.fast_forward or self._slots is None:
            return next_event if self.fast_forward else None
        return min([next_event] + [r.clock.t for r in self.replicas if r is not stepper and r.engine.scheduler.unfinished])

    def run(self, requests: Iterable[TraceRequest]) -> None:
        """Run a whole trace until every request has finished."""
        self.submit(requests)
        self.run_until()
        self.now = max([self.now] + [r.clock.t for r in self.replicas])
        if self._next_scrape is not None:
            self._scrape(self.now)

    def _next_arrival(self) -> float | None:
        if self._next >= len(self._pending):
            return None
        arrival = self._pending[self._next].arrival
        if self._slots is None:
            return arrival
        return max(arrival, self._slots[0]) if self._slots else None

    def _on_finished(self, sim: SimRequest) -> None:
        self.finished.append(sim)
        if self._slots is not None:
            heapq.heappush(self._slots, sim.finished)

    def retired_pending(self) -> bool:
        return any(r.draining and not r.busy for r in self.replicas)

    def _route(self, req: TraceRequest, now: float) -> None:
        active = [r for r in self.replicas if not r.draining]
        if self.router == "least-loaded":
            replica = min(active, key=lambda r: (r.load, r.index))
        else:
            replica = active[self._rr % len(active)]
            self._rr += 1
        index = len(self._sims)
        sim = SimRequest(index=index, replica=replica.index, arrival=now, prompt_len=req.prompt_len)
        self._sims.append(sim)
        replica.add(str(index), req, sim, self.vocab, now)
        if sim.error is not None:
            self._on_finished(sim)
        elif self.client_timeout is not None:
            heapq.heappush(self._deadlines, (now + self.client_timeout, index, replica))

    def _scrape(self, t: float) -> None:
        for r in self.replicas:
            r.sync_stats()
            sc = Scrape(t, r.index, r.metrics.samples())
            if self.keep_scrapes:
                self.scrapes.append(sc)
            if self.on_scrape is not None:
                self.on_scrape(sc)
        self._next_scrape = t + self.scrape_interval

    def _retire(self) -> None:
        for r in [r for r in self.replicas if r.draining and not r.busy and not r.live]:
            self.replicas.remove(r)
            self.retired.append(r)
            self._record_gpus()

    @property
    def requests(self) -> list[SimRequest]:
        return self._sims
