"""A replica-only contender modelled on NVIDIA Dynamo's SLA planner (aggregated serving):
every adjustment interval it predicts the next interval's load (request rate, mean input
and output lengths) and maps it, through a performance profile of the accelerator made
offline, to the replica count that meets the SLOs.

- The profile, as Dynamo's pre-deployment profiler makes it by running the engine on the
  accelerator: prefill throughput per GPU at the input length (chunks of
  max_num_batched_tokens), and the widest decode batch whose inter-token latency stays
  within the TPOT objective at the mean context, with the decode throughput it gives.
  In the simulator the accelerator's step times stand in for those measurements (this
  contender, like Dynamo's planner, is told the hardware; kvpilot's autotuner is not).
- The load predictor: Dynamo's default, the last interval's values held constant
  (arrivals counted as completions plus the growth of requests in flight, as a frontend
  would count them).
- Replicas: the share of a GPU the predicted prefill tokens need plus the share the
  decode tokens need at the SLO-bound batch, rounded up, within [1, max_replicas];
  applied at once in both directions (the planner has no stabilization window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from kvpilot.engine.fleet.fleet import Fleet

from .autotuner import LABEL, NAME, NAMESPACE, VirtualPrometheus, set_replicas

SELECTOR = f'{{namespace="{NAMESPACE}",{LABEL}="{NAME}"}}'


@lru_cache(maxsize=64)
def _profile(accelerator: str, model: str, dtype: str, mbt: int, kv_tokens: int, isl: int, osl: int,
             itl_s: float) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s at the SLO-bound batch) per replica."""
    from kvpilot.engine.sim.hardware import resolve_accelerator
    from kvpilot.engine.sim.shapes import resolve_model_shape
    from kvpilot.engine.sim.timing import BatchShape, step_time

    shape, acc = resolve_model_shape(model, dtype), resolve_accelerator(accelerator)
    prefill_s, done = 0.0, 0
    while done < isl:
        chunk = min(mbt, isl - done)
        done += chunk
        prefill_s += step_time(shape, acc, BatchShape.of([(chunk, done)]))
    ctx = max(1, isl + osl // 2)
    best_b, best_itl = 1, step_time(shape, acc, BatchShape.of([(1, ctx)]))
    b = 2
    while b <= min(1024, max(1, kv_tokens // ctx)):
        itl = step_time(shape, acc, BatchShape.of([(1, ctx)] * b))
        if itl > itl_s:
            break
        best_b, best_itl = b, itl
        b = b * 2 if b < 64 else b + 64
    return isl / prefill_s, best_b / best_itl


def _value(prom: VirtualPrometheus, expr: str, t: float) -> float | None:
    rows = prom.custom_query(expr, {"time": t})
    if not rows:
        return None
    v = float(rows[0]["value"][1])
    return v if math.isfinite(v) else None


@dataclass
class DynamoPlanner:
    """Dynamo-SLA-planner-style replica scaling on the fleet's Prometheus."""

    accelerator: str
    model: str
    tpot_s: float
    max_replicas: int = 8
    min_replicas: int = 1
    startup_s: float = 60.0
    interval_s: float = 60.0
    dtype: str = "bfloat16"
    name: str = "dynamo"
    events: list[tuple[float, int, int, str]] = field(default_factory=list)
    _in_flight: float | None = None

    def tick(self, t: float, fleet: Fleet, prom: VirtualPrometheus) -> None:
        w = f"{self.interval_s:g}s"
        done = _value(prom, f"sum(rate(vllm:request_success_total{SELECTOR}[{w}]))", t)
        prompt = _value(prom, f"sum(rate(vllm:prompt_tokens_total{SELECTOR}[{w}]))", t)
        gen = _value(prom, f"sum(rate(vllm:generation_tokens_total{SELECTOR}[{w}]))", t)
        flight = _value(prom, f"sum(vllm:num_requests_running{SELECTOR}) + sum(vllm:num_requests_waiting{SELECTOR})", t)
        if done is None or prompt is None or gen is None:
            return  # no metrics yet: keep the scale
        growth = 0.0
        if flight is not None:
            if self._in_flight is not None:
                growth = max(0.0, (flight - self._in_flight) / self.interval_s)
            self._in_flight = flight
        rate = done + growth
        current = fleet.num_replicas
        if done <= 0:
            want = self.min_replicas if rate <= 0 else current
        else:
            isl, osl = max(1, round(prompt / done)), max(1, round(gen / done))
            engine = fleet.replicas[0].engine
            prefill_tps, decode_tps = _profile(self.accelerator, self.model, self.dtype, engine.max_num_batched_tokens,
                                               engine.kv_capacity_tokens, _bucket(isl), _bucket(osl), self.tpot_s)
            share = rate * isl / prefill_tps + rate * osl / decode_tps
            want = math.ceil(share) if share > 0 else self.min_replicas
        want = max(self.min_replicas, min(self.max_replicas, want))
        if want != current:
            self.events.append((t, current, want, f"predicted {rate:.2f} req/s"))
            set_replicas(fleet, want, self.startup_s)


def _bucket(n: int) -> int:
    """Lengths rounded to 1/8 of a power of two, so the profile is reused across intervals."""
    if n <= 16:
        return n
    step = 2 ** (n.bit_length() - 4)
    return (n + step - 1) // step * step
