"""Calibration: fit the timing model's host overheads and effective rates to measured
step times (`kvpilot sim record`), and measure how well a description predicts steps
it was not fitted on. The fit minimises the mean absolute log error (relative error,
whatever the step's size; robust to a noisy step) with Nelder-Mead over log-parameters."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from ..sim.hardware import Accelerator
from ..sim.shapes import ModelShape
from ..sim.steps import StepRecord
from ..sim.timing import BatchShape, step_time

# Effective rates and overheads the fit moves. Rates stay between MIN_EFFICIENCY and 1 x
# the base's peaks (a datasheet, or this host's microbenchmarks), so a constant cost is
# read as host overhead rather than as implausibly slow memory, and no rate beats its peak.
_FREE = ("bandwidth", "gemm_flops", "attention_flops", "step_overhead_s", "per_seq_overhead_s",
         "per_token_overhead_s", "attention_score_bytes")
_RATES = {"bandwidth": "bandwidth", "gemm_flops": "flops", "attention_flops": "flops"}
MIN_EFFICIENCY = 0.05


def predict(model: ModelShape, acc: Accelerator, rec: StepRecord) -> float:
    return step_time(model, acc, BatchShape.of(rec.requests, rec.num_sampled))


@dataclass(frozen=True)
class ErrorReport:
    n: int  # distinct shapes (repeats of a grid shape count once, at their median)
    median_abs_rel: float  # |predicted / measured - 1|
    p90_abs_rel: float
    mean_signed_rel: float  # > 0: the model is slow (pessimistic)
    by_kind: dict[str, tuple[int, float]]  # kind -> (n, median |rel err|)

    def describe(self) -> str:
        kinds = ", ".join(f"{k} {m:.1%} (n={n})" for k, (n, m) in sorted(self.by_kind.items()))
        return (f"{self.n} steps: median |error| {self.median_abs_rel:.1%}, p90 {self.p90_abs_rel:.1%}, "
                f"mean signed {self.mean_signed_rel:+.1%}; by kind: {kinds}")


def _shape_class(r: StepRecord) -> str:
    """A coarse shape for records without a grid label (steps a server recorded): kind,
    sequences, and new tokens and the longest context in ~10 % bins."""
    def b(x: int) -> int:
        return round(math.log(max(x, 1)) / math.log(1.1))

    return f"{r.kind} {len(r.requests)} {b(sum(n for n, _ in r.requests))} {b(max(e for _, e in r.requests))}"


def measured_shapes(records: list[StepRecord]) -> list[tuple[StepRecord, float]]:
    """(a record, its measured time): repeats of one labelled grid shape, or steps of one
    coarse shape class, count once, at the median of their times (the shape's step time,
    without this host's jitter)."""
    groups: dict[str, list[StepRecord]] = {}
    out = []
    for r in records:
        groups.setdefault(r.label or _shape_class(r), []).append(r)
    for rs in groups.values():
        rs = sorted(rs, key=lambda r: r.seconds)
        out.append((rs[len(rs) // 2], statistics.median(r.seconds for r in rs)))
    return out


def errors(model: ModelShape, acc: Accelerator, records: list[StepRecord]) -> ErrorReport:
    if not records:
        raise ValueError("no step records to compare with")
    shapes = measured_shapes(records)
    rel = [predict(model, acc, r) / seconds - 1 for r, seconds in shapes]
    ab = sorted(abs(x) for x in rel)
    kinds: dict[str, list[float]] = {}
    for (r, _), x in zip(shapes, rel):
        kinds.setdefault(r.kind, []).append(abs(x))
    return ErrorReport(len(rel), statistics.median(ab), ab[min(len(ab) - 1, int(0.9 * len(ab)))],
                       statistics.fmean(rel), {k: (len(v), statistics.median(v)) for k, v in kinds.items()})


def _accelerator(base: Accelerator, x: dict[str, float]) -> Accelerator:
    """The base with these effective rates (as fractions of its peaks) and overheads."""
    def eff(rate: str) -> float:
        peak = getattr(base, _RATES[rate])
        return min(1.0, max(MIN_EFFICIENCY, x[rate] / peak))

    return replace(base, bandwidth_efficiency=eff("bandwidth"), gemm_efficiency=eff("gemm_flops"),
                   attention_efficiency=eff("attention_flops"), step_overhead_s=x["step_overhead_s"],
                   per_seq_overhead_s=x["per_seq_overhead_s"], per_token_overhead_s=x["per_token_overhead_s"],
                   attention_score_bytes=x["attention_score_bytes"])


def nelder_mead(f, x0: list[float], step: float = 1.0, iters: int = 3000, tol: float = 1e-10) -> list[float]:
    """Minimise f from x0 (a plain Nelder-Mead: reflection, expansion, contraction, shrink)."""
    n = len(x0)
    simplex = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)] for i in range(n)]
    values = [f(p) for p in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) < tol:
            break
        centroid = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]

        def toward(t: float) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centroid, simplex[-1])]

        reflected = toward(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(0.5 if fr >= values[-1] else -0.5)
            fc = f(contracted)
            if fc < min(fr, values[-1]):
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink toward the best point
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (v - b) for b, v in zip(best, p)] for p in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def fit(model: ModelShape, base: Accelerator, records: list[StepRecord]) -> tuple[Accelerator, ErrorReport]:
    """The base accelerator with the overheads and effective rates that best predict the
    records; and how well it predicts them."""
    if len(records) < len(_FREE):
        raise ValueError(f"calibration needs at least {len(_FREE)} step records, got {len(records)}")
    start = {"bandwidth": base.effective_bandwidth, "gemm_flops": base.effective_gemm_flops,
             "attention_flops": base.effective_attention_flops,
             "step_overhead_s": max(base.step_overhead_s, 1e-5),
             "per_seq_overhead_s": max(base.per_seq_overhead_s, 1e-7),
             "per_token_overhead_s": max(base.per_token_overhead_s, 1e-8),
             "attention_score_bytes": max(base.attention_score_bytes, 1.0)}
    pairs = measured_shapes(records)
    measured = [math.log(seconds) for _, seconds in pairs]
    shapes = [BatchShape.of(r.requests, r.num_sampled) for r, _ in pairs]

    def loss(logs: list[float]) -> float:
        acc = _accelerator(base, {k: math.exp(v) for k, v in zip(_FREE, logs)})
        return statistics.fmean(abs(math.log(step_time(model, acc, s)) - m) for s, m in zip(shapes, measured))

    x = [math.log(start[k]) for k in _FREE]
    for _ in range(3):  # restarts from the best point escape an early collapse of the simplex
        x = nelder_mead(loss, x, step=1.0)
    acc = _accelerator(base, {k: math.exp(v) for k, v in zip(_FREE, x)})
    acc = replace(acc, name=f"{base.name}-calibrated", source=f"kvpilot sim calibrate on {len(records)} steps")
    return acc, errors(model, acc, records)
