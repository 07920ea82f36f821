"""Judging a simulated run against a scenario: goodput per GPU-hour (requests that met
their phase's objective, per GPU-hour held), overall and per phase, with the latency
percentiles, preemptions and GPUs behind it. A request belongs to the phase it arrived in;
the last phase also owns the time the fleet takes to drain after the last arrival."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from .fleet import SimRequest, gpu_seconds
from .scenarios import Scenario


class Judged(Protocol):
    """What score() reads: a simulated Fleet, or a RecordedRun from a real-time cluster."""

    requests: list[SimRequest]

    def gpu_seconds(self, start: float, end: float) -> float: ...


@dataclass
class RecordedRun:
    """A run measured outside the simulator (the local cluster in real time): its requests
    on the trace's clock and the GPUs its pods held."""

    requests: list[SimRequest] = field(default_factory=list)
    gpu_timeline: list[tuple[float, int]] = field(default_factory=list)

    def gpu_seconds(self, start: float, end: float) -> float:
        return gpu_seconds(self.gpu_timeline, start, end)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation, numpy's default; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def met_slo(r: SimRequest, scen: Scenario) -> bool:
    """Whether the request finished within the objective of the phase it arrived in."""
    slo = scen.slos[scen.phase_index(r.arrival)]
    return slo.met(r.ttft, r.tpot, r.error is None and r.finished is not None)


def _stats(reqs: list[SimRequest], good: int, gpu_s: float, duration: float) -> dict:
    ok = [r for r in reqs if r.error is None and r.finished is not None]
    return {
        "requests": len(reqs), "completed": len(ok), "failed": len(reqs) - len(ok), "good": good,
        "goodput_per_s": good / duration if duration > 0 else 0.0,
        "gpu_hours": gpu_s / 3600.0,
        "goodput_per_gpu_hour": good / (gpu_s / 3600.0) if gpu_s > 0 else 0.0,
        "gpus_mean": gpu_s / duration if duration > 0 else 0.0,
        "ttft_p95_s": percentile([r.ttft for r in ok if r.ttft is not None], 95),
        "tpot_p95_s": percentile([r.tpot for r in ok if r.tpot is not None], 95),
        "preemptions": sum(r.num_preemptions for r in reqs),
        "output_tokens": sum(r.output_tokens for r in ok),
    }


def score(fleet: Judged, scen: Scenario) -> dict:
    """{"overall": {...}, "phases": [{"name", "start", "end", ...}, ...]} for a finished run."""
    # The day ends when its last request does: GPUs a controller still holds after that
    # are not the traffic's cost.
    end = max([0.0] + [r.finished for r in fleet.requests if r.finished is not None])
    by_phase: list[list[SimRequest]] = [[] for _ in scen.phases]
    for r in fleet.requests:
        by_phase[scen.phase_index(r.arrival)].append(r)
    phases, total_good = [], 0
    bounds = scen.boundaries()
    for k, ((name, start, stop), reqs) in enumerate(zip(bounds, by_phase)):
        slo = scen.slos[k]
        good = sum(1 for r in reqs if met_slo(r, scen))
        total_good += good
        stop = end if k == len(bounds) - 1 else stop
        phases.append({"name": name, "start": start, "end": stop, "slo": str(slo),
                       **_stats(reqs, good, fleet.gpu_seconds(start, stop), stop - start)})
    overall = _stats(fleet.requests, total_good, fleet.gpu_seconds(0.0, end), end)
    return {"overall": overall, "phases": phases, "end": end}


def window_stats(fleet: Judged, scen: Scenario, start: float, end: float) -> dict:
    """The run judged on the requests that arrived in [start, end) against the GPU-seconds
    held then (a split contest's first part, or the rest)."""
    reqs = [r for r in fleet.requests if start <= r.arrival < end]
    good = sum(1 for r in reqs if met_slo(r, scen))
    return _stats(reqs, good, fleet.gpu_seconds(start, end), end - start)
