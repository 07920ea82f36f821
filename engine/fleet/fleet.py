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

from ..core.clock import VirtualClock
from ..config.engine import EngineConfig
from ..llm_engine import LLMEngine
from ..core.sampling_params import SamplingParams
from .fast_forward import decode_steps
from .replica_metrics import ReplicaMetrics, Sample
from .trace import TraceRequest
from ..config.validation import LengthError, positive_int

ROUTERS = ("round-robin", "least-loaded")


@dataclass
class SimRequest:
    """One trace request's life in the simulator (times on the virtual clock)."""

    index: int
    replica: int
    arrival: float
    prompt_len: int
    output_tokens: int = 0
    first_token: float | None = None
    finished: float | None = None
    queue_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None  # refused (e.g. longer than max_model_len)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finished is None or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)


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


class Replica:
    def __init__(self, index: int, config: EngineConfig, start: float) -> None:
        self.index = index
        self.clock = VirtualClock(start)
        self.engine = LLMEngine(config, self.clock)
        self.metrics = ReplicaMetrics(self.engine.config.model_name, self.engine.max_model_len)
        self.metrics.record_capacity(self.engine.kv_cache_bytes, self.engine.kv_bytes_per_token,
                                     self.engine.weight_bytes, self.engine.kv_cache_element_bytes)
        runner = self.engine.runner
        self.metrics.record_simulation(runner.accelerator.name, runner.model.name)
        self.metrics.record_stats(self.engine.stats())
        self.engine.latency_sink = self.metrics
        self.live: dict[str, SimRequest] = {}
        self.draining = False
        # The engine's gauges and counters as of its last step, read into self.metrics only
        # when something else is about to change the engine (or a scrape reads them): a
        # pod's /metrics shows the last step's, and most steps are never scraped.
        self._stats_stale = False

    def sync_stats(self) -> None:
        """self.metrics holds the engine's stats as of its last step (call before anything
        but a step changes the engine, and before reading the metrics)."""
        if self._stats_stale:
            self.metrics.record_stats(self.engine.stats())
            self._stats_stale = False

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    @property
    def load(self) -> int:
        return len(self.live)

    def add(self, rid: str, req: TraceRequest, sim: SimRequest, vocab: tuple[int, int], now: float) -> None:
        self.sync_stats()
        if not self.busy:
            self.clock.sleep_until(now)  # an idle replica starts the request on arrival
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=req.ignore_eos,
                                temperature=0.0, detokenize=False, output_kind="final_only")
        try:  # the engine's edge checks and resolves it once; a length refusal the autotuner reads
            self.engine.add_request(rid, req.token_ids(sim.index, vocab), params, arrival_time=now,
                                    service_tier=req.service_tier)
        except ValueError as exc:
            if isinstance(exc, LengthError):
                self.metrics.length_refusals += 1
            self._refuse(sim, str(exc), now)
            return
        self.live[rid] = sim

    def give_up(self, rid: str, now: float) -> bool:
        """The client of a request with no token yet leaves: aborted, counted as failed."""
        group = self.engine.outputs.group(rid)
        if group is None or any(c.output_token_ids for c in group.children):
            return False
        self.sync_stats()
        self.engine.abort_request(rid)
        sim = self.live.pop(rid)
        sim.error, sim.finished, sim.finish_reason = "client timeout: no token in time", now, "abort"
        return True

    @staticmethod
    def _refuse(sim: SimRequest, error: str, now: float) -> None:
        sim.error, sim.finished, sim.finish_reason = error, now, "error"

    def step(self, on_finished: Callable[[SimRequest], None], until: float | None = None) -> None:
        """One engine step, or (given `until`) the decode-only ones before it (fast_forward.py)."""
        # Only finished requests come back (output_kind final_only); the engine reports
        # TTFT, gaps and finishes to self.metrics as they happen.
        for out in self.engine.step() if until is None or not decode_steps(self.engine, until) else ():
            sim = self.live.pop(out.request_id)
            c, m = out.outputs[0], out.metrics
            sim.output_tokens, sim.finish_reason = len(c.token_ids), c.finish_reason
            sim.first_token, sim.finished, sim.queue_time = m.first_token_time, m.finished_time, m.queue_time
            sim.num_preemptions, sim.num_cached_tokens = m.num_preemptions, m.num_cached_tokens
            on_finished(sim)
        self._stats_stale = True


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
                        self._deadlines[0][0] if self._deadlines else math.inf)
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
