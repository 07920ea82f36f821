"""The LLMDeployment spec as pydantic models: the single source of the CRD
schema (see crd.py), of its defaults and of the operator's own parsing.

Field names are the API (camelCase through aliases). Cross-field rules are
CEL expressions attached with `json_schema_extra`; the API server evaluates
them, and `validate_spec` repeats them for objects read back from it."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "serving.kvpilot.dev"
VERSION = "v1alpha1"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
SINGULAR = "llmdeployment"
SHORT_NAMES = ["llmd"]
PROJECT_VERSION = "0.1.0"
DEFAULT_IMAGE = f"kvpilot/engine:{PROJECT_VERSION}"

QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
DURATION_PATTERN = r"^([0-9]+(ms|s|m|h))+$"
MODEL_SOURCE_PATTERN = r"^(builtin:[a-z0-9-]+|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|file:///.+|/.+)$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
CONFIGMAP_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# A positive number (no zero: the engine rejects it), then the distributions `kvpilot serve
# --simulate-output-len` takes; uniform's LO <= HI is checked in validate_spec.
_POSITIVE = r"([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]*\.[0-9]*[1-9][0-9]*)"
OUTPUT_LEN_PATTERN = (rf"^(fixed:{_POSITIVE}|exponential:{_POSITIVE}"
                      rf"|uniform:{_POSITIVE}:{_POSITIVE}|lognormal:{_POSITIVE}:{_POSITIVE})$")

# The engine's presets (engine/sim/hardware.py and shapes.py; a test keeps them equal).
SimulatedAccelerator = Literal["h200", "h100-80gb", "a100-80gb", "l40s", "l4", "a10g"]
SimulatedModel = Literal["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "mistral-7b"]

Quantity = Union[int, str]  # rendered as int-or-string with the Kubernetes quantity pattern


def rule(expr: str, message: str, field_path: str | None = None) -> dict:
    out = {"rule": expr, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


class Model(BaseModel):
    # camelCase names on the wire; unknown fields ignored (the API server prunes them).

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def dump(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class ModelSource(Model):
    source: Optional[str] = Field(
        default=None, pattern=MODEL_SOURCE_PATTERN, max_length=1024,
        description="builtin:tiny, pvc://CLAIM/PATH (mounted read-only at /models), "
                    "file:///PATH or /PATH (a path inside the image). Required unless "
                    "engine.simulate is set.")
    served_name: Optional[str] = Field(
        default=None, max_length=253,
        description="The model name clients send; defaults to the LLMDeployment's name.")


class SecretKeyRef(Model):
    name: str = Field(pattern=DNS_LABEL_PATTERN, max_length=253)
    key: str = Field(min_length=1, max_length=253)


class ConfigMapKeyRef(Model):
    name: str = Field(pattern=DNS_LABEL_PATTERN, max_length=253)
    key: str = Field(default="config.json", pattern=CONFIGMAP_KEY_PATTERN, max_length=253)


SIMULATE_NEEDS_MODEL = ("engine.simulate needs model (a preset such as llama-3.1-8b) or modelConfigMap "
                        "(a config.json); the shape is not read from model.source")


class SimulateSpec(Model):
    """A simulated accelerator: the real server, scheduler, KV cache manager and metrics,
    with the forward pass replaced by a timing model (no GPU, no weights)."""
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("!(has(self.model) && has(self.modelConfigMap))",
             "engine.simulate.model and engine.simulate.modelConfigMap are mutually exclusive",
             ".modelConfigMap"),
        rule("has(self.model) || has(self.modelConfigMap)", SIMULATE_NEEDS_MODEL),
    ]})
    accelerator: SimulatedAccelerator = Field(description="The accelerator to model.")
    model: Optional[SimulatedModel] = Field(
        default=None, description="The model shape to model, a preset; or give modelConfigMap.")
    model_config_map: Optional[ConfigMapKeyRef] = Field(
        default=None, description="A ConfigMap holding a Hugging Face config.json under key "
                                  "(mounted read-only); or give model.")
    output_len: Optional[str] = Field(
        default=None, pattern=OUTPUT_LEN_PATTERN, max_length=64,
        description="Where EOS comes for requests that do not ignore it: fixed:N, uniform:LO:HI, "
                    "exponential:MEAN or lognormal:MEDIAN:SIGMA (the engine's default: "
                    "lognormal:256:1.0).")
    load_seconds: Optional[float] = Field(
        default=None, ge=0, le=3600,
        description="Seconds the simulated model takes to load before the pod is ready (a real 8B "
                    "model: about a minute); default 0.")


class EngineSpec(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("!(has(self.kvCacheMemory) && has(self.gpuMemoryUtilization))",
             "engine.kvCacheMemory and engine.gpuMemoryUtilization are mutually exclusive"),
    ]})
    image: str = Field(default=DEFAULT_IMAGE, min_length=1, max_length=512)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_num_seqs: int = Field(default=64, ge=1, le=4096,
                              description="Initial max_num_seqs (live-tunable).")
    max_model_len: int = Field(default=2048, ge=16, le=1048576,
                               description="Initial max_model_len (live-tunable).")
    max_num_batched_tokens: int = Field(default=2048, ge=16, le=1048576)
    block_size: Literal[8, 16, 32, 64] = 16
    kv_cache_memory: Optional[Quantity] = Field(
        default=None, description="KV cache bytes (a quantity such as 64Mi); CPU pods default to 1Gi.")
    gpu_memory_utilization: Optional[float] = Field(default=None, gt=0, le=1)
    enable_prefix_caching: bool = True
    api_key_secret_ref: Optional[SecretKeyRef] = Field(
        default=None, description="Secret key holding the API key clients must send.")
    extra_args: list[str] = Field(default_factory=list, max_length=64,
                                  description="More `kvpilot serve` flags (non-live).")
    simulate: Optional[SimulateSpec] = Field(
        default=None, description="Run on a simulated accelerator instead of a GPU (pods still "
                                  "request resources.gpus, so they schedule like GPU pods).")


class Resources(Model):
    gpus: int = Field(default=0, ge=0, le=16, description="nvidia.com/gpu per replica.")
    cpu: Quantity = "1"
    memory: Quantity = "2Gi"


class Autoscaling(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("self.minReplicas <= self.maxReplicas",
             "autoscaling.minReplicas must be <= autoscaling.maxReplicas", ".minReplicas"),
    ]})
    min_replicas: int = Field(default=1, ge=0, le=1000)
    max_replicas: int = Field(default=4, ge=1, le=1000)


class IntRange(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("self.min <= self.max", "min must be <= max", ".min"),
    ]})
    min: int = Field(ge=1, le=1048576)
    max: int = Field(ge=1, le=1048576)


class PrometheusSpec(Model):
    url: str = Field(default="http://prometheus.monitoring.svc:9090", pattern=r"^https?://.+",
                     max_length=1024)


class Objectives(Model):
    tpot: Optional[str] = Field(
        default=None, pattern=DURATION_PATTERN,
        description="TPOT objective: p95 over requests of each request's mean time per output "
                    "token (e.g. 50ms). Set, the autotuner narrows the batch (max_num_seqs) when "
                    "TPOT p95 exceeds it and never widens it past it; unset, TPOT is not tuned for.")


class AutotuneSpec(Model):
    mode: Literal["Off", "Recommend", "Auto"] = Field(
        default="Off", description="Off: spec values; Recommend: report only; Auto: apply within bounds.")
    interval: str = Field(default="30s", pattern=DURATION_PATTERN)
    window: str = Field(default="5m", pattern=DURATION_PATTERN,
                        description="Metrics window the diagnosis reads.")
    cooldown: str = Field(default="2m", pattern=DURATION_PATTERN,
                          description="Minimum time between two changes.")
    prometheus: PrometheusSpec = Field(default_factory=PrometheusSpec)
    max_num_seqs: IntRange = Field(default_factory=lambda: IntRange(min=1, max=1024))
    max_model_len: IntRange = Field(default_factory=lambda: IntRange(min=128, max=32768))
    objectives: Objectives = Field(default_factory=Objectives)
    shared_prefix: bool = Field(
        default=False,
        description="Prompts share a prefix (a system prompt, a few-shot header): enables the "
                    "diagnose-only PrefixCacheIneffective warning when the prefix cache rarely hits.")
    controller: Literal["Rules", "Model"] = Field(
        default="Rules",
        description="Rules: fixed-ratio steps per diagnosis. Model: replicas and maxNumSeqs sized "
                    "from a model of this deployment fitted online to its own metrics (needs "
                    "objectives.tpot); the safety rules stay around it.")


class Toleration(Model):
    key: Optional[str] = None
    operator: Optional[Literal["Exists", "Equal"]] = None
    value: Optional[str] = None
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = None
    toleration_seconds: Optional[int] = None


class Scheduling(Model):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: Optional[dict] = Field(default=None, description="A core/v1 Affinity, passed through.")
    priority_class_name: Optional[str] = None


class ServiceSpec(Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(default=8000, ge=1, le=65535)


class LLMDeploymentSpec(Model):
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
    ]})
    model: ModelSource
    engine: EngineSpec = Field(default_factory=EngineSpec)
    resources: Resources = Field(default_factory=Resources)
    replicas: int = Field(default=1, ge=0, le=1000)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    autotune: AutotuneSpec = Field(default_factory=AutotuneSpec)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    service: ServiceSpec = Field(default_factory=ServiceSpec)


class InvalidSpec(ValueError):
    """A spec the operator cannot use (PermanentError in the handlers)."""


def validate_spec(spec: LLMDeploymentSpec) -> None:
    """The CEL rules again, for objects the API server admitted before a rule existed."""
    a, e = spec.autoscaling, spec.engine
    if a.min_replicas > a.max_replicas:
        raise InvalidSpec("autoscaling.minReplicas must be <= autoscaling.maxReplicas")
    for name, r in (("maxNumSeqs", spec.autotune.max_num_seqs), ("maxModelLen", spec.autotune.max_model_len)):
        if r.min > r.max:
            raise InvalidSpec(f"autotune.{name}.min must be <= autotune.{name}.max")
    if spec.autotune.mode != "Off":
        for name, value, r in (("maxNumSeqs", e.max_num_seqs, spec.autotune.max_num_seqs),
                               ("maxModelLen", e.max_model_len, spec.autotune.max_model_len)):
            if not r.min <= value <= r.max:
                raise InvalidSpec(f"engine.{name} must lie within autotune.{name} [min, max]")
    if e.kv_cache_memory is not None and e.gpu_memory_utilization is not None:
        raise InvalidSpec("engine.kvCacheMemory and engine.gpuMemoryUtilization are mutually exclusive")
    if e.max_num_batched_tokens < e.max_num_seqs:
        raise InvalidSpec("engine.maxNumBatchedTokens must be >= engine.maxNumSeqs")
    if e.gpu_memory_utilization is not None and spec.resources.gpus == 0:
        raise InvalidSpec("engine.gpuMemoryUtilization needs resources.gpus > 0")
    if spec.model.source is None and e.simulate is None:
        raise InvalidSpec("model.source is required unless engine.simulate is set")
    if e.simulate is not None:
        validate_simulate(e.simulate)


def validate_simulate(sim: SimulateSpec) -> None:
    if sim.model is not None and sim.model_config_map is not None:
        raise InvalidSpec("engine.simulate.model and engine.simulate.modelConfigMap are mutually exclusive")
    if sim.model is None and sim.model_config_map is None:
        raise InvalidSpec(SIMULATE_NEEDS_MODEL)
    kind, _, args = (sim.output_len or "").partition(":")
    if kind == "uniform":  # the pattern cannot compare numbers
        lo, hi = (float(v) for v in args.split(":"))
        if lo > hi:
            raise InvalidSpec(f"engine.simulate.outputLen: uniform:LO:HI needs LO <= HI, got {sim.output_len}")
