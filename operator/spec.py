"""The LLMDeployment spec as pydantic models: the single source of the CRD
schema (see crd.py), of its defaults and of the operator's own parsing.

Field names are the API (camelCase through aliases). Cross-field rules are
CEL expressions attached with `json_schema_extra`; the API server evaluates
them, and `validate_spec` repeats them for objects read back from it."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

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
MODEL_SOURCE_PATTERN = (r"^(builtin:[a-z0-9-]+|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|file:///.+|/.+"
                        r"|hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?"
                        r"|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?)$")
URL_PATTERN = r"^https?://[^\s]+$"
FILE_GLOB_PATTERN = r"^[^\s]{1,255}$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
CONFIGMAP_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# A draft model: builtin:NAME, or a path inside the image or the model volume (/models for pvc://).
DRAFT_MODEL_PATTERN = r"^(builtin:[a-z0-9-]+|file:///.+|/.+)$"
MAX_SPECULATIVE_TOKENS = 16  # the engine's limit (engine/speculative_config.py)
PROMPT_LOOKUP_DEFAULTS = (1, 4)  # the engine's (min, max) when the spec leaves them out
# A positive number (no zero: the engine rejects it), then the distributions `kvpilot serve
# --simulate-output-len` takes; uniform's LO <= HI is checked in validate_spec.
_POSITIVE = r"([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]*\.[0-9]*[1-9][0-9]*)"
OUTPUT_LEN_PATTERN = (rf"^(fixed:{_POSITIVE}|exponential:{_POSITIVE}"
                      rf"|uniform:{_POSITIVE}:{_POSITIVE}|lognormal:{_POSITIVE}:{_POSITIVE})$")

# The engine's presets (engine/sim/hardware.py and shapes.py; a test keeps them equal).
SimulatedAccelerator = Literal["h200", "h100-80gb", "a100-80gb", "l40s", "l4", "a10g"]
SimulatedModel = Literal["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "mistral-7b"]
SimulatedInterconnect = Literal["nvlink4", "nvlink3", "pcie5", "pcie4"]
MAX_PARALLEL_SIZE = 16  # the engine's (engine/config.py) and resources.gpus' limit

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


class SecretKeyRef(Model):
    name: str = Field(pattern=DNS_LABEL_PATTERN, max_length=253)
    key: str = Field(min_length=1, max_length=253)


class HubTokenRef(Model):
    name: str = Field(pattern=DNS_LABEL_PATTERN, max_length=253)
    key: str = Field(default="HF_TOKEN", min_length=1, max_length=253)


class SecretRef(Model):
    name: str = Field(pattern=DNS_LABEL_PATTERN, max_length=253)


class HubOptions(Model):
    """For hf:// sources: the Hugging Face Hub, or a mirror of it (HF_ENDPOINT)."""
    endpoint: Optional[str] = Field(
        default=None, pattern=URL_PATTERN, max_length=512,
        description="A Hub mirror's URL (as HF_ENDPOINT), e.g. https://hf-mirror.internal; "
                    "default https://huggingface.co.")
    token_secret_ref: Optional[HubTokenRef] = Field(
        default=None, description="Secret key holding a Hub token (HF_TOKEN), for private or gated "
                                  "repositories; key defaults to HF_TOKEN.")


class S3Options(Model):
    """For s3:// sources: AWS S3 or an S3-compatible store (MinIO, Ceph RGW, R2, SeaweedFS)."""
    endpoint: Optional[str] = Field(
        default=None, pattern=URL_PATTERN, max_length=512,
        description="The store's URL (AWS_ENDPOINT_URL), e.g. http://minio.storage:9000; default AWS.")
    region: Optional[str] = Field(default=None, pattern=r"^[a-z0-9-]{1,64}$",
                                  description="AWS_REGION; default us-east-1.")
    path_style: bool = Field(default=False, description="Path-style addressing (MinIO and most "
                                                        "self-hosted stores need it).")
    credentials_secret_ref: Optional[SecretRef] = Field(
        default=None, description="Secret with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                                  "(and optionally AWS_SESSION_TOKEN).")


class ModelCache(Model):
    claim_name: Optional[str] = Field(
        default=None, pattern=DNS_LABEL_PATTERN, max_length=253,
        description="A PersistentVolumeClaim that holds downloaded models, shared by replicas and "
                    "restarts (ReadWriteMany for pods on several nodes); default: an emptyDir per pod.")


class ModelSource(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("!has(self.hf) || (has(self.source) && self.source.startsWith('hf://'))",
             "model.hf applies to hf:// sources only", ".hf"),
        rule("!has(self.s3) || (has(self.source) && self.source.startsWith('s3://'))",
             "model.s3 applies to s3:// sources only", ".s3"),
        rule("(!has(self.cache) && size(self.files) == 0) || (has(self.source) && "
             "(self.source.startsWith('hf://') || self.source.startsWith('s3://')))",
             "model.cache and model.files apply to hf:// and s3:// sources only", ".cache"),
    ]})
    source: Optional[str] = Field(
        default=None, pattern=MODEL_SOURCE_PATTERN, max_length=1024,
        description="builtin:tiny, hf://ORG/NAME[@REVISION] (the Hugging Face Hub or a mirror; "
                    "the revision is pinned to a commit in status.model), s3://BUCKET/PREFIX, "
                    "pvc://CLAIM/PATH (mounted read-only at /models), file:///PATH or /PATH (a "
                    "path inside the image). Required unless engine.simulate is set.")
    served_name: Optional[str] = Field(
        default=None, max_length=253,
        description="The model name clients send; defaults to the LLMDeployment's name.")
    hf: Optional[HubOptions] = None
    s3: Optional[S3Options] = None
    cache: Optional[ModelCache] = None
    files: list[Annotated[str, Field(pattern=FILE_GLOB_PATTERN, max_length=255)]] = Field(
        default_factory=list, max_length=32,
        description="More files to download from hf:// or s3:// (globs such as 'original/*' or "
                    "'*.bin'); by default only config, tokenizer and *.safetensors files.")


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
    interconnect: Optional[SimulatedInterconnect] = Field(
        default=None, description="With more than one GPU an engine (tensor parallelism): the link its "
                                  "all-reduces cross, nvlink4 (H100/H200 SXM), nvlink3 (A100 SXM), pcie5 "
                                  "or pcie4; default the accelerator's.")


PARALLEL_USES_ALL_GPUS = ("engine.tensorParallelSize x engine.pipelineParallelSize must equal resources.gpus "
                          "(one rank a GPU; tensorParallelSize defaults to resources.gpus / pipelineParallelSize)")
PIPELINE_NOT_SIMULATED = "engine.pipelineParallelSize > 1 is not modelled by engine.simulate"
SPECULATIVE_NEEDS_METHOD = "engine.speculative needs method ngram, or model (a draft model)"
DRAFT_NEEDS_MODEL = "engine.speculative.model is required for method draft_model"
NGRAM_TAKES_NO_MODEL = "engine.speculative.model is for a draft model; method ngram takes none"
LOOKUP_IS_NGRAM = "engine.speculative.promptLookupMax and promptLookupMin apply to method ngram only"
LOOKUP_ORDER = "engine.speculative.promptLookupMin must be <= engine.speculative.promptLookupMax"


class SpeculativeSpec(Model):
    """Speculative decoding, rendered as the engine's --speculative-config (vLLM's JSON, snake_case).
    numSpeculativeTokens is the most the engine drafts (it sizes for it); the value in effect is
    live (the tuning ConfigMap), and the autotuner moves it within autotune.numSpeculativeTokens."""
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("has(self.method) || has(self.model)", SPECULATIVE_NEEDS_METHOD),
        rule("!has(self.method) || self.method != 'draft_model' || has(self.model)", DRAFT_NEEDS_MODEL, ".model"),
        rule("!has(self.method) || self.method != 'ngram' || !has(self.model)", NGRAM_TAKES_NO_MODEL, ".model"),
        rule("(!has(self.promptLookupMax) && !has(self.promptLookupMin)) || "
             "(has(self.method) && self.method == 'ngram')", LOOKUP_IS_NGRAM, ".promptLookupMax"),
        rule(f"(has(self.promptLookupMin) ? self.promptLookupMin : {PROMPT_LOOKUP_DEFAULTS[0]}) <= "
             f"(has(self.promptLookupMax) ? self.promptLookupMax : {PROMPT_LOOKUP_DEFAULTS[1]})",
             LOOKUP_ORDER, ".promptLookupMin"),
    ]})
    method: Optional[Literal["ngram", "draft_model"]] = Field(
        default=None, description="ngram (prompt lookup: drafts copied from earlier text, no second "
                                  "model) or draft_model; a model without a method is a draft model.")
    model: Optional[str] = Field(
        default=None, pattern=DRAFT_MODEL_PATTERN, max_length=1024,
        description="The draft model: builtin:NAME, or a path inside the image or the model volume "
                    "(/models/... with a pvc:// source).")
    num_speculative_tokens: int = Field(
        ge=1, le=MAX_SPECULATIVE_TOKENS,
        description="K, the tokens drafted per step (the most; the value in effect is live-tunable).")
    prompt_lookup_max: Optional[int] = Field(default=None, ge=1, le=1024,
                                             description="ngram: the longest n-gram matched (engine default 4).")
    prompt_lookup_min: Optional[int] = Field(default=None, ge=1, le=1024,
                                             description="ngram: the shortest n-gram matched (engine default 1).")

    def engine_config(self) -> dict:
        """The engine's --speculative-config object (vLLM's snake_case keys; a model path as
        the engine sees it)."""
        out: dict = {"num_speculative_tokens": self.num_speculative_tokens}
        if self.method is not None:
            out["method"] = self.method
        if self.model is not None:
            out["model"] = self.model[len("file://"):] if self.model.startswith("file://") else self.model
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class EngineSpec(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("!(has(self.kvCacheMemory) && has(self.gpuMemoryUtilization))",
             "engine.kvCacheMemory and engine.gpuMemoryUtilization are mutually exclusive"),
        rule("!has(self.quantization) || !has(self.simulate)",
             "engine.quantization is not modelled by engine.simulate", ".quantization"),
        rule("!has(self.kvCacheDtype) || self.kvCacheDtype == 'auto' || !has(self.simulate)",
             "engine.kvCacheDtype fp8 is not modelled by engine.simulate", ".kvCacheDtype"),
        rule("!has(self.pipelineParallelSize) || self.pipelineParallelSize == 1 || !has(self.simulate)",
             PIPELINE_NOT_SIMULATED, ".pipelineParallelSize"),
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
    speculative: Optional[SpeculativeSpec] = Field(
        default=None, description="Speculative decoding: {method: ngram, numSpeculativeTokens: 4} or "
                                  "{model: builtin:NAME or a path, numSpeculativeTokens: 3}.")
    quantization: Optional[Literal["int8", "int4"]] = Field(
        default=None, description="Quantize the decoder's linear layers at load (the engine's "
                                  "--quantization): int8 = W8A16 per channel, int4 = W4A16 in groups of "
                                  "128. A quantized checkpoint (compressed-tensors, GPTQ, AWQ) needs "
                                  "nothing here: it is read as its config.json says.")
    kv_cache_dtype: Optional[Literal["auto", "fp8", "fp8_e4m3"]] = Field(
        default=None, description="The KV cache's element type (the engine's --kv-cache-dtype): auto = "
                                  "the model's dtype; fp8 (= fp8_e4m3) holds 2x the tokens of a 16-bit "
                                  "cache in the same memory, read by the torch attention path.")
    tensor_parallel_size: Optional[int] = Field(
        default=None, ge=1, le=MAX_PARALLEL_SIZE,
        description="GPUs each layer is split over (the engine's --tensor-parallel-size, one rank a GPU, "
                    "the KV cache split by KV head); default resources.gpus / pipelineParallelSize, so "
                    "resources.gpus: 4 is one engine over four GPUs. Without GPUs: CPU worker processes, "
                    "or the simulated accelerator's GPUs.")
    pipeline_parallel_size: Optional[int] = Field(
        default=None, ge=1, le=MAX_PARALLEL_SIZE,
        description="Pipeline stages the layers are split into (the engine's --pipeline-parallel-size); "
                    "default 1. tensorParallelSize x pipelineParallelSize must equal resources.gpus.")


class Resources(Model):
    gpus: int = Field(default=0, ge=0, le=MAX_PARALLEL_SIZE,
                      description="nvidia.com/gpu per replica, all for one engine: by default "
                                  "--tensor-parallel-size resources.gpus (see engine.tensorParallelSize).")
    cpu: Quantity = "1"
    memory: Quantity = "2Gi"


class Autoscaling(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("self.minReplicas <= self.maxReplicas",
             "autoscaling.minReplicas must be <= autoscaling.maxReplicas", ".minReplicas"),
    ]})
    min_replicas: int = Field(default=1, ge=0, le=1000, description=(
        "0 lets the autotuner (mode Auto) scale an idle deployment to zero after scaleToZeroAfter; "
        "kvpilot's gateway holds a request for it and scales it back to one."))
    max_replicas: int = Field(default=4, ge=1, le=1000)
    scale_to_zero_after: str = Field(default="15m", pattern=DURATION_PATTERN, description=(
        "With minReplicas 0: how long without a request (and with every pod up at least this long) "
        "before the autotuner scales the deployment to zero."))


class IntRange(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("self.min <= self.max", "min must be <= max", ".min"),
    ]})
    min: int = Field(ge=1, le=1048576)
    max: int = Field(ge=1, le=1048576)


class SpecTokensRange(Model):
    """Bounds of the live num_speculative_tokens; 0 is speculation off."""
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("!has(self.max) || self.min <= self.max",
             "autotune.numSpeculativeTokens.min must be <= autotune.numSpeculativeTokens.max", ".min"),
    ]})
    min: int = Field(default=0, ge=0, le=MAX_SPECULATIVE_TOKENS, description="0 lets the autotuner turn it off.")
    max: Optional[int] = Field(default=None, ge=0, le=MAX_SPECULATIVE_TOKENS,
                               description="Default and upper limit: engine.speculative.numSpeculativeTokens.")


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
    num_speculative_tokens: Optional[SpecTokensRange] = Field(
        default=None, description="Bounds of num_speculative_tokens (with engine.speculative; default "
                                  "[0, engine.speculative.numSpeculativeTokens]).")
    max_num_batched_tokens: Optional[IntRange] = Field(
        default=None, description="Bounds of the live chunked-prefill budget (default [min(512, "
                                  "engine.maxNumBatchedTokens), engine.maxNumBatchedTokens]; the max is capped "
                                  "at engine.maxNumBatchedTokens, which the engine sized its memory for).")
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


SPEC_BOUNDS_NEED_SPECULATIVE = "autotune.numSpeculativeTokens needs engine.speculative"
SPEC_BOUNDS_WITHIN_K = ("autotune.numSpeculativeTokens [min, max] may not exceed "
                        "engine.speculative.numSpeculativeTokens")


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
    validate_model(spec.model)
    if e.simulate is not None:
        validate_simulate(e.simulate)
        if e.quantization is not None:
            raise InvalidSpec("engine.quantization is not modelled by engine.simulate")
        if e.kv_cache_dtype not in (None, "auto"):
            raise InvalidSpec(f"engine.kvCacheDtype {e.kv_cache_dtype} is not modelled by engine.simulate")
    if e.speculative is not None:
        validate_speculative(e.speculative)
    validate_spec_bounds(spec)
    from .parallel import validate_parallel
    validate_parallel(spec)


def validate_speculative(sp: SpeculativeSpec) -> None:
    if sp.method is None and sp.model is None:
        raise InvalidSpec(SPECULATIVE_NEEDS_METHOD)
    if sp.method == "draft_model" and sp.model is None:
        raise InvalidSpec(DRAFT_NEEDS_MODEL)
    if sp.method == "ngram" and sp.model is not None:
        raise InvalidSpec(NGRAM_TAKES_NO_MODEL)
    if (sp.prompt_lookup_max is not None or sp.prompt_lookup_min is not None) and sp.method != "ngram":
        raise InvalidSpec(LOOKUP_IS_NGRAM)
    lo = sp.prompt_lookup_min if sp.prompt_lookup_min is not None else PROMPT_LOOKUP_DEFAULTS[0]
    hi = sp.prompt_lookup_max if sp.prompt_lookup_max is not None else PROMPT_LOOKUP_DEFAULTS[1]
    if lo > hi:
        raise InvalidSpec(f"{LOOKUP_ORDER}, got {lo} > {hi}")


def validate_spec_bounds(spec: LLMDeploymentSpec) -> None:
    r, sp = spec.autotune.num_speculative_tokens, spec.engine.speculative
    if r is None:
        return
    if sp is None:
        raise InvalidSpec(SPEC_BOUNDS_NEED_SPECULATIVE)
    if r.max is not None and r.min > r.max:
        raise InvalidSpec("autotune.numSpeculativeTokens.min must be <= autotune.numSpeculativeTokens.max")
    k = sp.num_speculative_tokens
    if r.min > k or (r.max is not None and r.max > k):
        raise InvalidSpec(f"{SPEC_BOUNDS_WITHIN_K} ({k})")


def spec_tokens_bounds(spec: LLMDeploymentSpec) -> tuple[int, int] | None:
    """(min, max) the autotuner may move num_speculative_tokens within; None without speculation."""
    sp = spec.engine.speculative
    if sp is None:
        return None
    r = spec.autotune.num_speculative_tokens
    lo = r.min if r is not None else 0
    hi = r.max if r is not None and r.max is not None else sp.num_speculative_tokens
    return lo, hi


def validate_model(m: ModelSource) -> None:
    src = m.source or ""
    remote = src.startswith(("hf://", "s3://"))
    if m.hf is not None and not src.startswith("hf://"):
        raise InvalidSpec("model.hf applies to hf:// sources only")
    if m.s3 is not None and not src.startswith("s3://"):
        raise InvalidSpec("model.s3 applies to s3:// sources only")
    if (m.cache is not None or m.files) and not remote:
        raise InvalidSpec("model.cache and model.files apply to hf:// and s3:// sources only")
    if remote:
        from kvpilot.engine.model_uri import parse_source
        try:
            parse_source(src)
        except ValueError as e:
            raise InvalidSpec(f"model.source: {e}") from None


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
