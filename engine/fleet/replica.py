"""One simulated replica: the real engine with the simulated executor on its own virtual
clock, the requests it serves, and the metrics a scrape of its pod would read (the fleet,
fleet.py, routes to it and steps it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..core.clock import VirtualClock
from ..config.engine import EngineConfig
from ..llm_engine import LLMEngine
from ..core.sampling_params import SamplingParams
from .fast_forward import decode_steps
from .replica_metrics import ReplicaMetrics
from .trace import TraceRequest
from ..config.validation import LengthError


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

    def may_give_up(self, rid: str) -> bool:
        """Whether the client of request `rid` may still give up: the request is in the
        engine with no token yet (once one came, its client stays)."""
        group = self.engine.outputs.group(rid)
        return group is not None and not any(c.output_token_ids for c in group.children)

    def give_up(self, rid: str, now: float) -> bool:
        """The client of a request with no token yet leaves: aborted, counted as failed."""
        if not self.may_give_up(rid):
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
