"""Per-LLMDeployment series on the operator's /metrics, written from each status the
reconcile computes: what the dashboards' autotuner row and the alerts read.

  kvpilot_operator_setting{setting}            max_num_seqs, max_model_len, replicas (and
                                               num_speculative_tokens where configured) in effect
  kvpilot_operator_autotune_diagnosis{diagnosis}   1 for the current diagnosis, 0 for the others
  kvpilot_operator_capacity_fit_seqs           sequences of the p99 length the KV cache holds
  kvpilot_operator_objective_seconds{objective}  spec.autotune.objectives (tpot)
  kvpilot_operator_condition{condition,status,reason}  1 for each condition as it stands

and, in mode Recommend or Auto, kvpilot_operator_autotune_decisions_total{action,setting} at 0
until the first change (a rate over "no change yet" is 0, not an empty result).

Every series carries llmdeployment_namespace and llmdeployment (not `namespace`, which a pod
scrape sets to the operator's own). A deployment's series go when it does (`forget`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from .runtime import metrics
from .autotune.hook import parse_duration
from .api.spec import LLMDeploymentSpec
from .api.status import LLMDeploymentStatus

ACTIONS = ("change", "revert")
SETTINGS = ("max_num_seqs", "max_model_len", "replicas", "num_speculative_tokens")
DIAGNOSES = ("PreemptionBound", "SchedulerBound", "KVCacheBound", "LengthBound", "TPOTBound", "HardwareBound",
             "Healthy", "Idle", "NoData")
KEY = ["llmdeployment_namespace", "llmdeployment"]


@dataclass
class DeploymentMetrics:
    registry: CollectorRegistry = REGISTRY
    _series: dict[tuple[str, str], set[tuple[Gauge, tuple[str, ...]]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        r = self.registry
        self.setting = Gauge("kvpilot_operator_setting", "Settings in effect (status.effective)",
                             KEY + ["setting"], registry=r)
        self.diagnosis = Gauge("kvpilot_operator_autotune_diagnosis",
                               "1 for the autotuner's current diagnosis, 0 for the others", KEY + ["diagnosis"],
                               registry=r)
        self.fit = Gauge("kvpilot_operator_capacity_fit_seqs",
                         "Sequences of the p99 request length the KV cache holds (the capacity plan)", KEY,
                         registry=r)
        self.objective = Gauge("kvpilot_operator_objective_seconds", "The deployment's latency objectives",
                               KEY + ["objective"], registry=r)
        self.condition = Gauge("kvpilot_operator_condition", "1 for each status condition as it stands",
                               KEY + ["condition", "status", "reason"], registry=r)

    def record(self, namespace: str, name: str, spec: LLMDeploymentSpec, status: LLMDeploymentStatus) -> None:
        key = (namespace, name)
        seen: set[tuple[Gauge, tuple[str, ...]]] = set()

        def put(gauge: Gauge, value: float, *labels: str) -> None:
            gauge.labels(*key, *labels).set(value)
            seen.add((gauge, labels))

        effective = status.effective
        if effective is not None:
            for setting in SETTINGS:
                value = getattr(effective, setting)  # num_speculative_tokens: None without speculation
                if value is not None:
                    put(self.setting, value, setting)
        autotune = status.autotune
        if autotune is not None and autotune.diagnosis:
            for diagnosis in {*DIAGNOSES, autotune.diagnosis}:
                put(self.diagnosis, 1.0 if diagnosis == autotune.diagnosis else 0.0, diagnosis)
        capacity = autotune.capacity if autotune is not None else None
        if capacity is not None and capacity.max_concurrent_seqs is not None:
            put(self.fit, capacity.max_concurrent_seqs)
        tpot = spec.autotune.objectives.tpot
        if tpot:
            put(self.objective, parse_duration(tpot), "tpot")
        for c in status.conditions:
            put(self.condition, 1.0, c.type, c.status, c.reason)
        if spec.autotune.mode != "Off":  # at 0 until a change: "no change" reads as 0, not as no data
            for action in ACTIONS:
                for setting in SETTINGS:
                    if setting != "num_speculative_tokens" or spec.engine.speculative is not None:
                        metrics.AUTOTUNE_DECISIONS.labels(*key, action, setting)
        for gauge, labels in self._series.get(key, set()) - seen:  # a condition that changed, a setting gone
            gauge.remove(*key, *labels)
        self._series[key] = seen

    def forget(self, namespace: str, name: str) -> None:
        for gauge, labels in self._series.pop((namespace, name), set()):
            gauge.remove(namespace, name, *labels)
        for action in ACTIONS:
            for setting in SETTINGS:
                try:
                    metrics.AUTOTUNE_DECISIONS.remove(namespace, name, action, setting)
                except KeyError:  # never created (mode Off)
                    pass

    def keep_only(self, present: set[tuple[str, str]]) -> None:
        """Drops the series of every deployment not in `present` (deleted since)."""
        for key in set(self._series) - present:
            self.forget(*key)
