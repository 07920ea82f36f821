"""The LLMDeployment status as pydantic models. The operator writes it
explicitly (never kopf's handler-keyed status). `autotune` is the autotuner's
report: typed where the shape is settled, open (`extra="allow"`, rendered with
x-kubernetes-preserve-unknown-fields) where the autotuner may add figures."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import ConfigDict, Field

from .spec import Model

ConditionType = Literal["Ready", "Progressing", "Degraded", "Reconciling", "Stalled"]
# PreemptionBound | SchedulerBound | KVCacheBound | LengthBound | TPOTBound | HardwareBound | Healthy |
# Idle | NoData. A plain string in the schema: a new diagnosis from the autotuner must never
# make the API server refuse the whole status write.
Diagnosis = str


class Condition(Model):
    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(default="", max_length=1024)
    message: str = Field(default="", max_length=32768)
    observed_generation: Optional[int] = Field(default=None, ge=0)
    last_transition_time: Optional[str] = Field(default=None, json_schema_extra={"format": "date-time"})


class Effective(Model):
    """The settings in effect (the spec's, or the autotuner's within bounds)."""
    max_num_seqs: Optional[int] = None
    max_model_len: Optional[int] = None
    replicas: Optional[int] = None
    num_speculative_tokens: Optional[int] = Field(
        default=None, description="Draft tokens per step in effect (0: speculation off); absent "
                                  "without engine.speculative.")
    max_num_batched_tokens: Optional[int] = Field(
        default=None, description="The chunked-prefill budget in effect, where the autotuner moved it.")


class Decision(Model):
    """One autotuner decision (kvpilot.operator.autotune.report.DecisionStatus)."""
    time: Optional[str] = Field(default=None, json_schema_extra={"format": "date-time"})
    diagnosis: Optional[Diagnosis] = None
    action: Optional[str] = Field(default=None, description="change | revert | hold")
    change: dict[str, list[int]] = Field(
        default_factory=dict, description="setting -> [old, new], e.g. {maxNumSeqs: [64, 24]}")
    reason: str = ""
    applied: Optional[bool] = Field(default=None, description="False in Recommend mode.")
    target: Optional[str] = Field(default=None, description="The signal the change should improve.")
    baseline: Optional[float] = None
    throughput_baseline: Optional[float] = Field(
        default=None, description="Output tokens/s when decided; the change is reverted if it loses more than 15%.")
    verified: Optional[bool] = None


class Capacity(Model):
    """The capacity plan (KV formula run backwards); open for more figures."""
    model_config = ConfigDict(extra="allow")
    kv_cache_bytes: Optional[int] = None
    bytes_per_token: Optional[int] = None
    seq_len: Optional[int] = None
    bytes_per_sequence: Optional[int] = None
    max_concurrent_seqs: Optional[int] = None
    max_num_seqs: Optional[int] = None
    bound: Optional[str] = None
    summary: Optional[str] = None
    fp8_max_concurrent_seqs: Optional[int] = Field(
        default=None, description="Sequences of seqLen an fp8 KV cache would hold in the same bytes.")
    weight_bytes: Optional[int] = Field(default=None, description="The pods' model weights (quantized size where quantized).")


class Snapshot(Model):
    """The engine signals the last diagnosis read (over autotune.window); open for more."""
    model_config = ConfigDict(extra="allow")
    time: Optional[str] = Field(default=None, json_schema_extra={"format": "date-time"})
    window_seconds: Optional[float] = None
    kv_usage_mean: Optional[float] = Field(default=None, description="0..1, mean over pods.")
    kv_usage_max: Optional[float] = None
    preemptions_per_second: Optional[float] = None
    queue_time_p95_seconds: Optional[float] = None
    ttft_p95_seconds: Optional[float] = None
    tpot_p95_seconds: Optional[float] = None
    generation_tokens_per_second: Optional[float] = None
    num_waiting: Optional[float] = None
    num_running: Optional[float] = None
    running_min: Optional[float] = Field(default=None, description="Running at the window's emptiest sample.")
    request_rate_per_second: Optional[float] = None
    request_latency_mean_seconds: Optional[float] = None
    request_len_p99: Optional[float] = None
    prefix_hit_rate: Optional[float] = None
    length_refusals_per_second: Optional[float] = None
    missing: list[str] = Field(default_factory=list)
    stale: list[str] = Field(default_factory=list)


class ModelMemory(Model):
    """What autotune.controller Model keeps between passes: the windows it fitted on and
    the replica counts it planned (a scale-in waits for a run of them)."""
    fit: Optional[str] = Field(default=None, description="The fitted model, as a sentence.")
    observations: list[list[float]] = Field(
        default_factory=list, max_length=40,
        description="[unix time, running per replica, prompt tokens/s per replica, mean TPOT s], oldest first.")
    plans: list[list[float]] = Field(default_factory=list, max_length=20,
                                     description="[unix time, planned replicas], oldest first.")


class Advice(Model):
    """A setting the autotuner recommends but never applies (it needs a restart)."""
    setting: str = Field(max_length=128, description="The spec field, e.g. engine.kvCacheDtype.")
    value: str = Field(max_length=128)
    reason: str = Field(default="", max_length=4096)
    since: Optional[str] = Field(default=None, json_schema_extra={"format": "date-time"})


class AutotuneStatus(Model):
    """The autotuner's report (kvpilot.operator.autotune.report.AutotuneStatus) plus
    the operator's own notes (message, recommendation)."""
    diagnosis: Optional[Diagnosis] = Field(
        default=None, description="PreemptionBound, SchedulerBound, KVCacheBound, LengthBound, "
                                  "TPOTBound, HardwareBound, Healthy, Idle or NoData.")
    message: Optional[str] = None
    recommendation: Optional[Effective] = Field(default=None, description="What Recommend mode would apply.")
    last_decision: Optional[Decision] = None
    history: list[Decision] = Field(default_factory=list, max_length=100)
    recent_diagnoses: list[Diagnosis] = Field(default_factory=list, max_length=100)
    capacity: Optional[Capacity] = None
    snapshot: Optional[Snapshot] = None
    model: Optional[ModelMemory] = None
    advice: list[Advice] = Field(default_factory=list, max_length=8, description=(
        "Settings that need a restart, so the autotuner recommends them and never applies them "
        "(e.g. engine.kvCacheDtype fp8 while the KV cache's size binds)."))


class ModelStatus(Model):
    """A downloaded model (spec.model.source hf:// or s3://): the pinned revision and the
    download as the pods' init containers report it."""
    source: Optional[str] = Field(default=None, max_length=1024)
    revision: Optional[str] = Field(default=None, max_length=255,
                                    description="hf://: the commit the revision resolved to (pinned).")
    phase: Optional[str] = Field(default=None, description="Resolving | Pending | Downloading | Ready | Failed")
    progress: Optional[str] = Field(default=None, max_length=64,
                                    description="What `kubectl get llmd` shows, e.g. 'Downloading 37%'.")
    bytes_done: Optional[int] = Field(default=None, ge=0)
    bytes_total: Optional[int] = Field(default=None, ge=0)
    bytes_per_second: Optional[int] = Field(default=None, ge=0)
    files: Optional[int] = Field(default=None, ge=0)
    reason: Optional[str] = Field(default=None, max_length=128, description="Why it failed, e.g. ModelUnauthorized.")
    message: Optional[str] = Field(default=None, max_length=2048)
    checked_at: Optional[str] = Field(default=None, json_schema_extra={"format": "date-time"},
                                      description="When the operator last asked the source.")


class LLMDeploymentStatus(Model):
    observed_generation: Optional[int] = None
    conditions: list[Condition] = Field(default_factory=list)
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    selector: Optional[str] = Field(default=None, description="Label selector of the pods (scale subresource).")
    endpoint: Optional[str] = None
    effective: Optional[Effective] = None
    kv_cache_usage_percent: Optional[int] = Field(default=None, ge=0, le=100)
    simulated: Optional[str] = Field(
        default=None, max_length=512,
        description="ACCELERATOR/MODEL (or ACCELERATOR/configmap:NAME) when the pods run on a "
                    "simulated accelerator (spec.engine.simulate); absent otherwise.")
    autotune: Optional[AutotuneStatus] = None
    model: Optional[ModelStatus] = None

    def condition(self, type_: str) -> Optional[Condition]:
        return next((c for c in self.conditions if c.type == type_), None)
