"""The LLMDeployment spec as pydantic models: the single source of the CRD schema (see
crd.py), of its defaults and of the operator's own parsing.

Field names are the API (camelCase through aliases). Cross-field rules are CEL expressions
attached with `json_schema_extra`; the API server evaluates them, and validation.py repeats
them for objects read back from it. This module holds the top level and spec.autotune; the
parts live beside it (model.py, engine.py, pod.py)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import ConfigDict, Field

from .fields import DURATION_PATTERN, MAX_SPECULATIVE_TOKENS, Model, URL_PATTERN, rule
from .model import ModelSource
from .engine import EngineSpec, PARALLEL_USES_ALL_GPUS, Resources
from .pod import PodSettings, Scheduling, ServiceSpec


class Autoscaling(Model):
    """Replica bounds for the autotuner (mode Auto) and the HorizontalPodAutoscaler's scale
    subresource."""
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("self.minReplicas <= self.maxReplicas",
             "autoscaling.minReplicas must be <= autoscaling.maxReplicas", ".minReplicas"),
    ]})
    min_replicas: int = Field(default=1, ge=0, le=1000, description=(
        "0 lets the autotuner (mode Auto) scale an idle deployment to zero after scaleToZeroAfter; "
        "kvpilot's gateway holds a request for it and scales it back to one."))
    max_replicas: int = Field(default=4, ge=1, le=1000, description="The most replicas the autotuner "
                                                                    "scales to.")
    scale_to_zero_after: str = Field(default="15m", pattern=DURATION_PATTERN, max_length=32, description=(
        "With minReplicas 0: how long without a request (and with every pod up at least this long) "
        "before the autotuner scales the deployment to zero."))


class IntRange(Model):
    """Bounds the autotuner moves a setting within."""
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("self.min <= self.max", "min must be <= max", ".min"),
    ]})
    min: int = Field(ge=1, le=1048576, description="The least value.")
    max: int = Field(ge=1, le=1048576, description="The most value.")


class SpecTokensRange(Model):
    """Bounds of the live num_speculative_tokens; 0 is speculation off."""
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("!has(self.max) || self.min <= self.max",
             "autotune.numSpeculativeTokens.min must be <= autotune.numSpeculativeTokens.max", ".min"),
    ]})
    min: int = Field(default=0, ge=0, le=MAX_SPECULATIVE_TOKENS, description="0 lets the autotuner turn it off.")
    max: Optional[int] = Field(default=None, ge=0, le=MAX_SPECULATIVE_TOKENS,
                               description="Default and upper limit: engine.speculative.numSpeculativeTokens.")


# kube-prometheus-stack in namespace monitoring: the Prometheus Operator's governing Service of
# every Prometheus it runs, whatever the release's name.
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"


class PrometheusSpec(Model):
    """The Prometheus the autotuner reads the engine metrics from."""
    url: Optional[str] = Field(
        default=None, pattern=URL_PATTERN, max_length=1024,
        description="Prometheus's base URL; default: the operator's (the chart's engine.prometheusURL), "
                    f"else {DEFAULT_PROMETHEUS_URL} (kube-prometheus-stack in namespace monitoring).")


class Objectives(Model):
    """Service-level objectives the autotuner tunes for."""
    tpot: Optional[str] = Field(
        default=None, pattern=DURATION_PATTERN, max_length=32,
        description="TPOT objective: p95 over requests of each request's mean time per output "
                    "token (e.g. 50ms). Set, the autotuner narrows the batch (max_num_seqs) when "
                    "TPOT p95 exceeds it and never widens it past it; unset, TPOT is not tuned for.")
    ttft: Optional[str] = Field(
        default=None, pattern=DURATION_PATTERN, max_length=32,
        description="TTFT objective: p95 time to first token (e.g. 2s). Set, a queue counts as "
                    "pressure (a reason to widen the batch or add a replica) only while its queue-time "
                    "p95 is at least half of it, and a replica is given back while bursts still queue "
                    "if that p95 grown with the load stays under half of it; unset, any queue is pressure.")
    attainment: Optional[float] = Field(
        default=None, gt=0.0, le=1.0,
        description="The share of requests that must meet the objectives (e.g. 0.95). Unset, the "
                    "autotuner adds a replica only where it can raise good requests per GPU-hour: "
                    "at R replicas, k more only while more than k/(R+k) of the requests miss the "
                    "objectives. Set, it also adds them while fewer than this share meet them, "
                    "paying GPUs for attainment.")


class AutotuneSpec(Model):
    """The autotuner: what it may change, how often, and from which metrics."""
    mode: Literal["Off", "Recommend", "Auto"] = Field(
        default="Off", description="Off: spec values; Recommend: report only; Auto: apply within bounds.")
    interval: str = Field(default="30s", pattern=DURATION_PATTERN, max_length=32,
                          description="Time between two diagnoses (e.g. 30s, 1m30s).")
    window: str = Field(default="5m", pattern=DURATION_PATTERN, max_length=32,
                        description="Metrics window the diagnosis reads.")
    cooldown: str = Field(default="2m", pattern=DURATION_PATTERN, max_length=32,
                          description="Minimum time between two changes.")
    prometheus: PrometheusSpec = Field(default_factory=PrometheusSpec,
                                       description="Where the engine metrics are read from.")
    max_num_seqs: IntRange = Field(default_factory=lambda: IntRange(min=1, max=1024),
                                   description="Bounds of the live max_num_seqs.")
    max_model_len: IntRange = Field(default_factory=lambda: IntRange(min=128, max=32768),
                                    description="Bounds of the live max_model_len (min is also the "
                                                "engine's start-up floor).")
    num_speculative_tokens: Optional[SpecTokensRange] = Field(
        default=None, description="Bounds of num_speculative_tokens (with engine.speculative; default "
                                  "[0, engine.speculative.numSpeculativeTokens]).")
    max_num_batched_tokens: Optional[IntRange] = Field(
        default=None, description="Bounds of the live chunked-prefill budget (default [min(512, "
                                  "engine.maxNumBatchedTokens), engine.maxNumBatchedTokens]; the max is capped "
                                  "at engine.maxNumBatchedTokens, which the engine sized its memory for).")
    objectives: Objectives = Field(default_factory=Objectives, description="Objectives to tune for.")
    shared_prefix: bool = Field(
        default=False,
        description="Prompts share a prefix (a system prompt, a few-shot header): enables the "
                    "diagnose-only PrefixCacheIneffective warning when the prefix cache rarely hits.")
    season: Optional[str] = Field(
        default=None, pattern=DURATION_PATTERN, max_length=32,
        description="The traffic's period (e.g. 24h), when it repeats: the autotuner keeps a season of the "
                    "request rate it saw and adds replicas a pod's start-up ahead of a rise it saw a period ago "
                    "(unset: no forecast).")
    controller: Literal["Rules", "Model"] = Field(
        default="Rules",
        description="Rules: fixed-ratio steps per diagnosis. Model: replicas and maxNumSeqs sized "
                    "from a model of this deployment fitted online to its own metrics (needs "
                    "objectives.tpot); the safety rules stay around it.")


SPEC_BOUNDS_NEED_SPECULATIVE = "autotune.numSpeculativeTokens needs engine.speculative"
SPEC_BOUNDS_WITHIN_K = ("autotune.numSpeculativeTokens [min, max] may not exceed "
                        "engine.speculative.numSpeculativeTokens")


class LLMDeploymentSpec(Model):
    """What to serve, how to start the engine, and the bounds the autotuner may move within."""
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("self.autotune.mode == 'Off' || (self.engine.maxNumSeqs >= self.autotune.maxNumSeqs.min"
             " && self.engine.maxNumSeqs <= self.autotune.maxNumSeqs.max)",
             "engine.maxNumSeqs must lie within autotune.maxNumSeqs [min, max]", ".engine.maxNumSeqs"),
        rule("self.autotune.mode == 'Off' || (self.engine.maxModelLen >= self.autotune.maxModelLen.min"
             " && self.engine.maxModelLen <= self.autotune.maxModelLen.max)",
             "engine.maxModelLen must lie within autotune.maxModelLen [min, max]", ".engine.maxModelLen"),
        rule("self.engine.maxNumBatchedTokens >= self.engine.maxNumSeqs",
             "engine.maxNumBatchedTokens must be >= engine.maxNumSeqs", ".engine.maxNumBatchedTokens"),
        rule("self.resources.gpus > 0 || !has(self.engine.gpuMemoryUtilization)",
             "engine.gpuMemoryUtilization needs resources.gpus > 0", ".engine.gpuMemoryUtilization"),
        rule("has(self.model.source) || has(self.engine.simulate)",
             "model.source is required unless engine.simulate is set", ".model.source"),
        # Integer division: an unset tensorParallelSize is gpus / pp, which passes only when pp divides gpus.
        rule("self.resources.gpus == 0 || (has(self.engine.tensorParallelSize) ? self.engine.tensorParallelSize : "
             "self.resources.gpus / (has(self.engine.pipelineParallelSize) ? self.engine.pipelineParallelSize : 1))"
             " * (has(self.engine.pipelineParallelSize) ? self.engine.pipelineParallelSize : 1) == self.resources.gpus",
             PARALLEL_USES_ALL_GPUS, ".engine.tensorParallelSize"),
        rule("!has(self.autotune.numSpeculativeTokens) || has(self.engine.speculative)",
             SPEC_BOUNDS_NEED_SPECULATIVE, ".autotune.numSpeculativeTokens"),
        rule("!has(self.autotune.numSpeculativeTokens) || !has(self.engine.speculative) || "
             "(self.autotune.numSpeculativeTokens.min <= self.engine.speculative.numSpeculativeTokens && "
             "(!has(self.autotune.numSpeculativeTokens.max) || "
             "self.autotune.numSpeculativeTokens.max <= self.engine.speculative.numSpeculativeTokens))",
             SPEC_BOUNDS_WITHIN_K, ".autotune.numSpeculativeTokens"),
    ]})
    model: ModelSource = Field(description=ModelSource.__doc__)
    engine: EngineSpec = Field(default_factory=EngineSpec, description=EngineSpec.__doc__)
    resources: Resources = Field(default_factory=Resources, description=Resources.__doc__)
    replicas: int = Field(default=1, ge=0, le=1000, description="Engine pods (the scale subresource; "
                                                                "the autotuner's in mode Auto).")
    autoscaling: Autoscaling = Field(default_factory=Autoscaling, description=Autoscaling.__doc__)
    autotune: AutotuneSpec = Field(default_factory=AutotuneSpec, description=AutotuneSpec.__doc__)
    scheduling: Scheduling = Field(default_factory=Scheduling, description=Scheduling.__doc__)
    pod: PodSettings = Field(default_factory=PodSettings, description=PodSettings.__doc__)
    service: ServiceSpec = Field(default_factory=ServiceSpec, description=ServiceSpec.__doc__)
