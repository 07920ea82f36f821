"""The replica-only autoscalers users run today, as contenders for the contest: each
reads the same Prometheus as kvpilot (the fleet's scrapes, in virtual time) and moves
only the replica count, at the engine's default settings.

- `Hpa`: the Kubernetes HorizontalPodAutoscaler's algorithm (pkg/controller/podautoscaler):
  every 15 s, desired = ceil(current x metric / target) for a per-pod average (or
  ceil(total / target) for an external AverageValue metric), nothing within the 10 %
  tolerance, scale-up at most max(+100 %, +4 pods) per period, and scale-down only to the
  highest recommendation of the last 300 s (the default behavior).
- KEDA on `sum(vllm:num_requests_waiting)` with threshold 5, as vLLM production-stack
  documents: an external AverageValue metric of target 5 through that HPA.
- AIBrix's KV-cache autoscaling: the HPA on the pods' mean `vllm:kv_cache_usage_perc`
  with target 0.5.
- llm-d's Workload Variant Autoscaler, saturation mode: from the last minute's peak KV
  usage and queue per pod, a replica is saturated at KV >= 0.8 or queue >= 5; one more
  replica when the non-saturated ones' mean spare KV < 0.1 or spare queue < 3, one fewer
  when the load spread over one replica fewer would still leave both spares; its desired
  count goes through the HPA as an external metric, as WVA deploys it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from kvpilot.engine.fleet.fleet import Fleet

from .autotuner import LABEL, NAME, NAMESPACE, VirtualPrometheus, ready_pods, set_replicas

SELECTOR = f'{{namespace="{NAMESPACE}",{LABEL}="{NAME}"}}'


def per_pod(prom: VirtualPrometheus, expr: str, t: float, pods: set[str]) -> dict[str, float]:
    """`expr` evaluated per pod (it must keep the pod label), for the ready pods only: an
    HPA reads the metrics of the pods its target selects."""
    out = {}
    for row in prom.custom_query(expr, {"time": t}):
        pod = row["metric"].get("pod")
        value = float(row["value"][1])
        if pod in pods and math.isfinite(value):
            out[pod] = value
    return out


@dataclass
class HpaBehavior:
    """autoscaling/v2's default behavior."""

    sync_s: float = 15.0
    tolerance: float = 0.1
    scale_down_stabilization_s: float = 300.0
    scale_up_percent: float = 100.0
    scale_up_pods: int = 4


@dataclass
class Hpa:
    """One HPA on one metric: `metric(t, fleet, prom)` -> (value, kind) where kind is
    "average" (a per-pod average against the target) or "total" (an external
    AverageValue metric: the total against target per replica)."""

    name: str
    target: float
    metric: Callable[[float, Fleet, VirtualPrometheus], tuple[float | None, str]]
    min_replicas: int = 1
    max_replicas: int = 8
    startup_s: float = 60.0
    behavior: HpaBehavior = field(default_factory=HpaBehavior)
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    events: list[tuple[float, int, int, str]] = field(default_factory=list)  # (t, old, new, why)

    @property
    def interval_s(self) -> float:
        return self.behavior.sync_s

    def desired(self, current: int, ready: int, value: float, kind: str) -> int:
        b = self.behavior
        if kind == "total":
            ratio = value / (self.target * max(current, 1))
            raw = math.ceil(value / self.target)
        else:
            ratio = value / self.target
            raw = math.ceil(ratio * max(ready, 1))
        if abs(ratio - 1.0) <= b.tolerance:
            return current
        return raw

    def tick(self, t: float, fleet: Fleet, prom: VirtualPrometheus) -> None:
        value, kind = self.metric(t, fleet, prom)
        current = fleet.num_replicas
        if value is None:
            return  # no metric: the HPA keeps the scale (FailedGetExternalMetric)
        ready = len(ready_pods(fleet))
        rec = max(self.min_replicas, min(self.max_replicas, self.desired(current, ready, value, kind)))
        b = self.behavior
        self.recommendations.append((t, rec))
        self.recommendations = [(s, r) for s, r in self.recommendations if s > t - b.scale_down_stabilization_s]
        if rec < current:  # scale down only as far as the window's highest recommendation
            rec = min(current, max(r for _, r in self.recommendations))
        elif rec > current:
            limit = max(math.floor(current * (1 + b.scale_up_percent / 100)), current + b.scale_up_pods)
            rec = min(rec, limit)
        if rec != current:
            self.events.append((t, current, rec, f"{kind} metric {value:.2f} vs target {self.target:g}"))
            set_replicas(fleet, rec, self.startup_s)


def keda_waiting(threshold: float = 5.0, **kw) -> Hpa:
    """vLLM production-stack's KEDA ScaledObject: Prometheus trigger on the queue length."""

    def metric(t, fleet, prom):
        rows = per_pod(prom, f"sum by (pod) (vllm:num_requests_waiting{SELECTOR})", t, ready_pods(fleet))
        return (sum(rows.values()), "total") if rows else (None, "total")

    return Hpa(name="KEDA waiting>5", target=threshold, metric=metric, **kw)


def hpa_kv_usage(target: float = 0.5, **kw) -> Hpa:
    """AIBrix's documented HPA on KV-cache usage (a per-pod average)."""

    def metric(t, fleet, prom):
        rows = per_pod(prom, f"avg by (pod) (vllm:kv_cache_usage_perc{SELECTOR})", t, ready_pods(fleet))
        return (sum(rows.values()) / len(rows), "average") if rows else (None, "average")

    return Hpa(name="HPA KV 0.5", target=target, metric=metric, **kw)


@dataclass
class WvaSaturation:
    kv_threshold: float = 0.80
    queue_threshold: float = 5.0
    kv_spare_trigger: float = 0.10
    queue_spare_trigger: float = 3.0

    def target(self, kv: dict[str, float], queue: dict[str, float], desired: int) -> int:
        """The replica target from per-pod peaks (ready pods only); `desired` is WVA's
        previous target, kept while it is still being reached."""
        ready = len(kv)
        if ready == 0:
            return desired
        if desired > ready:
            return desired  # a scale-up is still starting: do not stack another on it
        free = [p for p in kv if kv[p] < self.kv_threshold and queue.get(p, 0.0) < self.queue_threshold]
        if not free:
            return ready + 1
        spare_kv = sum(self.kv_threshold - kv[p] for p in free) / len(free)
        spare_q = sum(self.queue_threshold - queue.get(p, 0.0) for p in free) / len(free)
        if spare_kv < self.kv_spare_trigger or spare_q < self.queue_spare_trigger:
            return ready + 1
        if len(free) >= 2:
            after = len(free) - 1
            kv_after = self.kv_threshold - sum(kv[p] for p in free) / after
            q_after = self.queue_threshold - sum(queue.get(p, 0.0) for p in free) / after
            if kv_after >= self.kv_spare_trigger and q_after >= self.queue_spare_trigger:
                return ready - 1
        return ready


def wva(period_s: float = 30.0, **kw) -> Hpa:
    """WVA's saturation analyzer every `period_s` over the peaks of twice that, its target
    applied through the HPA."""
    analyzer = WvaSaturation()
    state = {"desired": 0, "at": -math.inf}
    span = f"{2 * period_s:g}s"

    def metric(t, fleet, prom):
        if t - state["at"] >= period_s:
            pods = ready_pods(fleet)
            kv = per_pod(prom, f"max by (pod) (max_over_time(vllm:kv_cache_usage_perc{SELECTOR}[{span}]))", t, pods)
            queue = per_pod(prom, f"max by (pod) (max_over_time(vllm:num_requests_waiting{SELECTOR}[{span}]))",
                            t, pods)
            state["desired"] = analyzer.target(kv, queue, state["desired"] or fleet.num_replicas)
            state["at"] = t
        return float(state["desired"]), "total"

    return Hpa(name="WVA saturation", target=1.0, metric=metric, **kw)
