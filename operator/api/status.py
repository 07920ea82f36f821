"""The LLMDeployment status as pydantic models. The operator writes it
explicitly (never kopf's handler-keyed status). `autotune` is the autotuner's
report: typed where the shape is settled, open (`extra="allow"`, rendered with
x-kubernetes-preserve-unknown-fields) where the autotuner may add figures."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import ConfigDict, Field

from .fields import Model

ConditionType = Literal["Ready", "Progressing", "Degraded", "Reconciling", "Stalled"]
# PreemptionBound | SchedulerBound | KVCacheBound | LengthBound | TPOTBound | HardwareBound | Healthy |
# Idle | NoData. A plain string in the schema: a new diagnosis from the autotuner must never
# make the API server refuse the whole status write.
Diagnosis = str


# What the Kubernetes API conventions (metav1.Condition) require of every condition; the
# operator always writes them all (conditions.complete).
CONDITION_REQUIRED = ["type", "status", "observedGeneration", "lastTransitionTime", "reason", "message"]
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class Condition(Model):
    """One observation of the LLMDeployment's state, as metav1.Condition."""
    model_config = ConfigDict(json_schema_extra={"required": CONDITION_REQUIRED})
    type: str = Field(max_length=316, description="Ready, Progressing, Degraded, Reconciling, Stalled, "
                                                  "ModelReady, MetricsAvailable, PrefixCacheIneffective, ...")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", max_length=1024,
                        description="A CamelCase word saying why (e.g. AllReplicasReady, InvalidSpec).")
    message: str = Field(default="", max_length=32768, description="What a person should read.")
    observed_generation: Optional[int] = Field(default=None, ge=0,
                                               description="The spec generation the condition was computed for.")
    last_transition_time: Optional[str] = Field(default=None, json_schema_extra={"format": "date-time"},
                                                description="When status last changed.")


class Effective(Model):
    """The settings in effect (the spec's, or the autotuner's within bounds)."""
    max_num_seqs: Optional[int] = Field(default=None, description="max_num_seqs in effect.")
    max_model_len: Optional[int] = Field(default=None, description="max_model_len in effect.")
    replicas: Optional[int] = Field(default=None, description="Replicas in effect.")
    num_speculative_tokens: Optional[int] = Field(
        default=None, description="Draft tokens per step in effect (0: speculation off); absent "
                                  "without engine.speculative.")
    max_num_batched_tokens: Optional[int] = Field(
        default=None, description="The chunked-prefill budget in effect, where the autotuner moved it.")


class DecisionStatus(Model):
    """One autotuner decision, as kvpilot.operator.autotune.report writes it."""
    time: Optional[str] = Field(default=None, json_schema_extra={"format": "date-time"},
                                description="When it was decided.")
    diagnosis: Optional[Diagnosis] = Field(default=None, description="The diagnosis it acted on.")
    action: Optional[str] = Field(default=None, description="change | revert | hold")
    change: dict[str, list[int]] = Field(
        default_factory=dict, description="setting -> [old, new], e.g. {maxNumSeqs: [64, 24]}")
    reason: str = Field(default="", description="Why, in words.")
    applied: Optional[bool] = Field(default=None, description="False in Recommend mode.")
    target: Optional[str] = Field(default=None, description="The signal the change should improve.")
    baseline: Optional[float] = Field(default=None, description="The target signal's value when decided.")
    throughput_baseline: Optional[float] = Field(
        default=None, description="Output tokens/s when decided; the change is reverted if it loses more than 15%.")
    good_per_replica: Optional[float] = Field(
        default=None, ge=0, description="Good requests/s per replica: a scale-out's before it (its replicas go back "
                                        "if, once they serve, the fleet makes clearly fewer), or what the grown "
                                        "fleet made, on that return.")
    finished_per_replica: Optional[float] = Field(
        default=None, ge=0, description="Finished requests/s per replica, when goodPerReplica was read.")
    verified: Optional[bool] = Field(default=None, description="Whether the change was checked against "
                                                             "its baseline (False: reverted).")


class Capacity(Model):
    """The capacity plan (KV formula run backwards); open for more figures."""
    model_config = ConfigDict(extra="allow")
    kv_cache_bytes: Optional[int] = Field(default=None, description="KV cache bytes per replica.")
    bytes_per_token: Optional[int] = Field(default=None, description="KV cache bytes one token takes.")
    seq_len: Optional[int] = Field(default=None, description="The sequence length planned for.")
    bytes_per_sequence: Optional[int] = Field(default=None, description="KV cache bytes one such sequence takes.")
    max_concurrent_seqs: Optional[int] = Field(default=None, description="Sequences of seqLen the KV cache holds at once.")
    max_num_seqs: Optional[int] = Field(default=None, description="The max_num_seqs the plan gives.")
    bound: Optional[str] = Field(default=None, description="What limits the plan.")
    summary: Optional[str] = Field(default=None, description="The plan, as a sentence.")
    fp8_max_concurrent_seqs: Optional[int] = Field(
        default=None, description="Sequences of seqLen an fp8 KV cache would hold in the same bytes.")
    weight_bytes: Optional[int] = Field(default=None, description="The pods' model weights (quantized size where quantized).")


class SnapshotStatus(Model):
    """The engine signals the last diagnosis read (over autotune.window); open for more."""
    model_config = ConfigDict(extra="allow")
    time: Optional[str] = Field(default=None, json_schema_extra={"format": "date-time"},
                                description="When it was read.")
    window_seconds: Optional[float] = Field(default=None, description="The window's length.")
    kv_usage_mean: Optional[float] = Field(default=None, description="0..1, mean over pods.")
    kv_usage_max: Optional[float] = Field(default=None, description="0..1, the fullest pod.")
    preemptions_per_second: Optional[float] = Field(default=None, description="Preempted sequences per second.")
    queue_time_p95_seconds: Optional[float] = Field(default=None, description="p95 time a request waited.")
    ttft_p95_seconds: Optional[float] = Field(default=None, description="p95 time to first token.")
    tpot_p95_seconds: Optional[float] = Field(default=None, description="p95 of each request's mean time per output token.")
    generation_tokens_per_second: Optional[float] = Field(default=None, description="Output tokens per second, all pods.")
    num_waiting: Optional[float] = Field(default=None, description="Requests waiting (mean).")
    num_running: Optional[float] = Field(default=None, description="Requests running (mean).")
    running_min: Optional[float] = Field(default=None, description="Running at the window's emptiest sample.")
    running_busiest_pod: Optional[float] = Field(
        default=None, description="Requests running on the busiest pod (mean): what its max_num_seqs caps.")
    request_rate_per_second: Optional[float] = Field(default=None, description="Requests finished per second.")
    request_latency_mean_seconds: Optional[float] = Field(default=None, description="Mean end-to-end request latency.")
    request_len_p99: Optional[float] = Field(default=None, description="p99 prompt plus output tokens.")
    prefix_hit_rate: Optional[float] = Field(default=None, description="0..1, prefix cache hits per lookup.")
    length_refusals_per_second: Optional[float] = Field(default=None, description="Requests refused as too long per second.")
    spec_acceptance_rate: Optional[float] = Field(default=None, description="0..1, accepted draft tokens per drafted.")
    spec_mean_accepted_len: Optional[float] = Field(default=None, description="Mean tokens a verified draft step yields.")
    spec_drafts_per_second: Optional[float] = Field(default=None, description="Draft steps per second.")
    num_speculative_tokens: Optional[float] = Field(default=None, description="Draft tokens per step the pods run.")
    missing: list[str] = Field(default_factory=list, description="Series Prometheus did not have.")
    stale: list[str] = Field(default_factory=list, description="Series older than the window.")


class ModelMemory(Model):
    """What the autotuner keeps between passes: the windows autotune.controller Model fitted on
    and the replica counts it planned (a scale-in waits for a run of them), the season's rates,
    and the good requests per replica a scale-out must beat."""
    fit: Optional[str] = Field(default=None, description="The fitted model, as a sentence.")
    observations: list[list[float]] = Field(
        default_factory=list, max_length=40,
        description="[unix time, running per replica, prompt tokens/s per replica, mean TPOT s], oldest first.")
    plans: list[list[float]] = Field(default_factory=list, max_length=20,
                                     description="[unix time, planned replicas], oldest first.")
    grown: list[float] = Field(
        default_factory=list, max_length=3,
        description="[unix time, pods] when the pods reporting last grew, then the pods reporting now.")
    startup_s: Optional[float] = Field(
        default=None, ge=0, le=86400,
        description="Seconds a replica took to start here (a scale-out to its pods reporting): how long "
                    "a scale-in waits in calm intervals.")
    rates: list[list[float]] = Field(
        default_factory=list, max_length=128,
        description="With autotune.season: [unix time, request rate /s, serving replicas], oldest first.")
    good_rates: list[list[float]] = Field(
        default_factory=list, max_length=20,
        description="[unix time, good requests/s per replica, finished requests/s per replica, replicas], one "
                    "per interval, oldest first: what a scale-out is checked against.")


class AdviceStatus(Model):
    """A setting the autotuner recommends but never applies (it needs a restart)."""
    setting: str = Field(max_length=128, description="The spec field, e.g. engine.kvCacheDtype.")
    value: str = Field(max_length=128, description="The value recommended.")
    reason: str = Field(default="", max_length=4096, description="Why, in words.")
    since: Optional[str] = Field(default=None, json_schema_extra={"format": "date-time"},
                                 description="Since when it is recommended.")


class AutotuneStatus(Model):
    """status.autotune: the autotuner's report (built by kvpilot.operator.autotune.report, the
    one schema it is written and read back with) plus the operator's own notes (message,
    recommendation)."""
    diagnosis: Optional[Diagnosis] = Field(
        default=None, description="PreemptionBound, SchedulerBound, KVCacheBound, LengthBound, "
                                  "TPOTBound, HardwareBound, Healthy, Idle or NoData.")
    message: Optional[str] = Field(default=None, description="The operator's note (e.g. why no data).")
    recommendation: Optional[Effective] = Field(default=None, description="What Recommend mode would apply.")
    last_decision: Optional[DecisionStatus] = Field(default=None, description="The latest decision.")
    history: list[DecisionStatus] = Field(default_factory=list, max_length=100, description="Decisions, oldest first.")
    recent_diagnoses: list[Diagnosis] = Field(default_factory=list, max_length=100,
                                              description="The last diagnoses, oldest first.")
    capacity: Optional[Capacity] = Field(default=None, description=Capacity.__doc__)
    snapshot: Optional[SnapshotStatus] = Field(default=None, description=SnapshotStatus.__doc__)
    model: Optional[ModelMemory] = Field(default=None, description=ModelMemory.__doc__)
    advice: list[AdviceStatus] = Field(default_factory=list, max_length=8, description=(
        "Settings that need a restart, so the autotuner recommends them and never applies them "
        "(e.g. engine.kvCacheDtype fp8 while the KV cache's size binds)."))


class ModelDownloadStatus(Model):
    """status.model: a downloaded model (spec.model.source hf:// or s3://): the pinned revision and the
    download as the pods' init containers report it."""
    source: Optional[str] = Field(default=None, max_length=1024, description="The spec's model.source.")
    revision: Optional[str] = Field(default=None, max_length=255,
                                    description="hf://: the commit the revision resolved to (pinned).")
    phase: Optional[str] = Field(default=None, description="Resolving | Pending | Downloading | Ready | Failed")
    progress: Optional[str] = Field(default=None, max_length=64,
                                    description="What `kubectl get llmd` shows, e.g. 'Downloading 37%'.")
    bytes_done: Optional[int] = Field(default=None, ge=0, description="Bytes downloaded.")
    bytes_total: Optional[int] = Field(default=None, ge=0, description="The model's bytes.")
    bytes_per_second: Optional[int] = Field(default=None, ge=0, description="The download's rate.")
    files: Optional[int] = Field(default=None, ge=0, description="Files of the model.")
    reason: Optional[str] = Field(default=None, max_length=128, description="Why it failed, e.g. ModelUnauthorized.")
    message: Optional[str] = Field(default=None, max_length=2048, description="The download, in words.")
    checked_at: Optional[str] = Field(default=None, json_schema_extra={"format": "date-time"},
                                      description="When the operator last asked the source.")
    sizing: Optional[str] = Field(default=None, max_length=1024, description=(
        "s3://: why the model's size is unknown (the operator could not list the prefix in time), "
        "so the download cache keeps its default size; unset once the listing sized it."))


class LLMDeploymentStatus(Model):
    """What the operator observed: conditions, replicas, the settings in effect, the autotuner's
    report and the model download."""
    observed_generation: Optional[int] = Field(default=None, description="The spec generation the pods run.")
    conditions: list[Condition] = Field(default_factory=list, max_length=32, description="The latest observations.")
    replicas: int = Field(default=0, description="Engine pods.")
    ready_replicas: int = Field(default=0, description="Engine pods ready.")
    updated_replicas: int = Field(default=0, description="Engine pods running the current template.")
    selector: Optional[str] = Field(default=None, description="Label selector of the pods (scale subresource).")
    endpoint: Optional[str] = Field(default=None, description="The Service's OpenAI base URL in the cluster.")
    effective: Optional[Effective] = Field(default=None, description=Effective.__doc__)
    kv_cache_usage_percent: Optional[int] = Field(default=None, ge=0, le=100,
                                                  description="Mean KV cache usage over the pods.")
    simulated: Optional[str] = Field(
        default=None, max_length=512,
        description="ACCELERATOR/MODEL (or ACCELERATOR/configmap:NAME) when the pods run on a "
                    "simulated accelerator (spec.engine.simulate); absent otherwise.")
    autotune: Optional[AutotuneStatus] = Field(default=None, description=AutotuneStatus.__doc__)
    model: Optional[ModelDownloadStatus] = Field(default=None, description=ModelDownloadStatus.__doc__)

    def condition(self, type_: str) -> Optional[Condition]:
        return next((c for c in self.conditions if c.type == type_), None)
