"""The LLMDeployment spec as pydantic models: the single source of the CRD
schema (see crd.py), of its defaults and of the operator's own parsing.

Field names are the API (camelCase through aliases). Cross-field rules are
CEL expressions attached with `json_schema_extra`; the API server evaluates
them, and `validate_spec` repeats them for objects read back from it."""
from __future__ import annotations

import json
import re
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator
from pydantic.alias_generators import to_camel

from ..names import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION  # noqa: F401  (the API's names)
from kvpilot.engine.fetch.uri import (BUILTIN_NAME, DNS_SUBDOMAIN, HF_URI, REL_PATH,  # the parser's own pieces
                                     S3_URI)

PROJECT_VERSION = "0.1.0"
DEFAULT_IMAGE = f"kvpilot/engine:{PROJECT_VERSION}"
# Simulated pods (engine.simulate) run the operator's image: the server without torch.
DEFAULT_SIMULATED_IMAGE = f"kvpilot/operator:{PROJECT_VERSION}"

QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
# Bounded digits: a duration the autotuner's parser reads without overflowing.
DURATION_PATTERN = r"^([0-9]{1,6}(ms|s|m|h)){1,4}$"
# Kubernetes expands $(VAR) in container args and env values (and reads $$ as a literal $):
# a spec string that reaches them may not contain "$(", nor control characters. The builders
# escape every "$" of a user's string as "$$" too, for objects stored before this rule.
NO_EXPANSION = r"([^$\x00-\x1f\x7f]|\$+[^$(\x00-\x1f\x7f])*\$*"
SAFE_TEXT_PATTERN = rf"^{NO_EXPANSION}$"
# The model URIs, built from the pieces kvpilot.engine.fetch.uri parses them with.
MODEL_SOURCE_PATTERN = (rf"^(builtin:{BUILTIN_NAME}|pvc://{DNS_SUBDOMAIN}(/|/{REL_PATH}/?)?|file:///{REL_PATH}/?"
                        rf"|/{REL_PATH}/?|{HF_URI}|{S3_URI})$")
# The lengths a pattern cannot bound (the Hub's 96-character names; S3's 3-63-character buckets).
MODEL_SOURCE_LENGTHS = ("!has(self.source) || !self.source.startsWith('hf://') || "
                        "self.source.matches('^hf://[^/@]{1,96}/[^/@]{1,96}(@.{1,255})?$')",
                        "!has(self.source) || !self.source.startsWith('s3://') || "
                        "self.source.matches('^s3://[^/]{3,63}(/.*)?$')")
URL_PATTERN = r"^https?://[^$\x00-\x20\x7f]+$"
FILE_GLOB_PATTERN = r"^[^$\x00-\x20\x7f]{1,255}$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = rf"^{DNS_SUBDOMAIN}$"
CONFIGMAP_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# A served model name: what clients send as "model" (and a Prometheus label value).
SERVED_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._:/@+-]*[A-Za-z0-9])?$"
# A draft model: builtin:NAME, or a path inside the image or the model volume (/models for pvc://).
DRAFT_MODEL_PATTERN = rf"^(builtin:{BUILTIN_NAME}|file:///{REL_PATH}|/{REL_PATH})$"
# Byte sizes both Kubernetes and the engine's parser (engine/config/quantity.py) read, from 1 MB up:
# a bare count of at least 7 digits, or a mantissa with a binary or decimal suffix.
BYTES_PATTERN = r"^([1-9][0-9]{6,15}|[1-9][0-9]{0,4}(\.[0-9]{1,3})?(Mi|Gi|Ti|M|G|T))$"
BYTES_MIN, BYTES_MAX = 10**6, 2**50
# CPU: cores (0.5, 2) or millicores (500m); never zero or negative.
CPU_PATTERN = r"^([1-9][0-9]{0,3}(\.[0-9]{1,3})?|0\.[0-9]{0,2}[1-9][0-9]{0,2}|[1-9][0-9]{0,6}m)$"
# Kubernetes label keys (qualified names) and values; annotation keys are qualified names too.
LABEL_KEY = (rf"({DNS_SUBDOMAIN}/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
LABEL_KEY_PATTERN = rf"^{LABEL_KEY}$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# An image reference: [registry[:port]/]path[:tag][@digest], no spaces or '$'.
IMAGE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$"
EXTENDED_RESOURCE_PATTERN = rf"^{DNS_SUBDOMAIN}/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
MAX_SPECULATIVE_TOKENS = 16  # the engine's limit (engine/config/speculative.py)
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
MAX_PARALLEL_SIZE = 16  # the engine's (engine/config/engine.py) and resources.gpus' limit



def quantity(pattern: str, lo: int, hi: int) -> type:
    """An int-or-string Kubernetes quantity: an integer in [lo, hi] or a string matching
    `pattern` (crd.py renders both branches' bounds on one x-kubernetes-int-or-string node)."""
    return Union[Annotated[StrictInt, Field(ge=lo, le=hi)], Annotated[StrictStr, Field(pattern=pattern, max_length=24)]]


Bytes = quantity(BYTES_PATTERN, BYTES_MIN, BYTES_MAX)
Cpu = quantity(CPU_PATTERN, 1, 1024)
SafeText = Annotated[str, Field(pattern=SAFE_TEXT_PATTERN, max_length=1024)]
LabelKey = Annotated[str, Field(pattern=LABEL_KEY_PATTERN, max_length=316)]


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
    """A key of a Secret in the LLMDeployment's namespace."""
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="The Secret's name.")
    key: str = Field(pattern=CONFIGMAP_KEY_PATTERN, max_length=253, description="The key in the Secret's data.")


class HubTokenRef(Model):
    """The Secret key holding a Hugging Face token."""
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="The Secret's name.")
    key: str = Field(default="HF_TOKEN", pattern=CONFIGMAP_KEY_PATTERN, max_length=253,
                     description="The key in the Secret's data.")


class SecretRef(Model):
    """A Secret in the LLMDeployment's namespace."""
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="The Secret's name.")


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
    region: Optional[str] = Field(default=None, pattern=r"^[a-z0-9-]{1,64}$", max_length=64,
                                  description="AWS_REGION; default us-east-1.")
    path_style: bool = Field(default=False, description="Path-style addressing (MinIO and most "
                                                        "self-hosted stores need it).")
    credentials_secret_ref: Optional[SecretRef] = Field(
        default=None, description="Secret with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                                  "(and optionally AWS_SESSION_TOKEN).")


class ModelCache(Model):
    """Where an hf:// or s3:// model is downloaded to."""
    claim_name: Optional[str] = Field(
        default=None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253,
        description="A PersistentVolumeClaim that holds downloaded models, shared by replicas and "
                    "restarts (ReadWriteMany for pods on several nodes); default: an emptyDir per pod.")
    size_limit: Optional[Bytes] = Field(
        default=None,
        description="The emptyDir cache's sizeLimit and the pods' ephemeral-storage request (e.g. "
                    "40Gi); default: the hf:// model's files plus 10% and 1Gi, or 20Gi for s3://. "
                    "Unused with claimName.")


class ModelSource(Model):
    """What to serve: where the weights come from and the name clients ask for."""
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule(MODEL_SOURCE_LENGTHS[0], "model.source: a Hub organisation or name is at most 96 "
             "characters, a revision at most 255", ".source"),
        rule(MODEL_SOURCE_LENGTHS[1], "model.source: an S3 bucket name is 3-63 characters", ".source"),
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
        default=None, pattern=SERVED_NAME_PATTERN, max_length=253,
        description="The model name clients send (letters, digits and . _ : / @ + -); defaults to "
                    "the LLMDeployment's name.")
    hf: Optional[HubOptions] = Field(default=None, description="Options for an hf:// source.")
    s3: Optional[S3Options] = Field(default=None, description="Options for an s3:// source.")
    cache: Optional[ModelCache] = Field(default=None, description="Where an hf:// or s3:// model is "
                                                                  "downloaded to.")
    files: list[Annotated[str, Field(pattern=FILE_GLOB_PATTERN, max_length=255)]] = Field(
        default_factory=list, max_length=32,
        description="More files to download from hf:// or s3:// (globs such as 'original/*' or "
                    "'*.bin'); by default only config, tokenizer and *.safetensors files.")


class ConfigMapKeyRef(Model):
    """A key of a ConfigMap in the LLMDeployment's namespace."""
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="The ConfigMap's name.")
    key: str = Field(default="config.json", pattern=CONFIGMAP_KEY_PATTERN, max_length=253,
                     description="The key in the ConfigMap's data.")


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


# `kvpilot serve`'s flags, split in two (tests/operator/api/test_spec_validation.py keeps them equal to the
# engine's parser): those the operator sets or the spec owns (extraArgs may not restate them,
# in any form: a later --api-key "" would switch authentication off), and the rest, which
# extraArgs may set. Anything else (an abbreviation, -h, a typo) would make the engine exit.
OWNED_FLAGS = ("--api-key", "--block-size", "--drain-timeout", "--dtype", "--enable-prefix-caching",
               "--gpu-memory-utilization", "--help", "--host", "--kv-cache-dtype", "--kv-cache-memory",
               "--max-model-len", "--max-num-batched-tokens", "--max-num-seqs", "--model",
               "--no-enable-prefix-caching", "--pipeline-parallel-size", "--port", "--quantization",
               "--served-model-name", "--simulate", "--simulate-interconnect", "--simulate-load-seconds",
               "--simulate-model", "--simulate-output-len", "--speculative-config", "--tensor-parallel-size",
               "--tuning-file", "-h")
EXTRA_FLAGS = ("--attention-backend", "--body-read-timeout", "--cpu-threads", "--device",
               "--disable-uvicorn-access-log", "--enforce-eager", "--header-read-timeout",
               "--max-queued-requests", "--max-request-body-bytes", "--no-enforce-eager",
               "--pipeline-micro-batches", "--record-steps", "--seed", "--simulate-bandwidth-gbps",
               "--simulate-calibration", "--simulate-memory", "--simulate-spec-acceptance",
               "--simulate-spec-draft-cost", "--simulate-tflops")
# An item starting with '-' (but not a negative number) is a flag: one of EXTRA_FLAGS, alone or
# as FLAG=VALUE.
EXTRA_ARG_RULE = ("self.all(a, !a.startsWith('-') || a.matches('^-[0-9.]') || a in %s || "
                  "%s.exists(f, a.startsWith(f + '=')))" % (list(EXTRA_FLAGS), list(EXTRA_FLAGS)))
EXTRA_ARG_MESSAGE = ("engine.extraArgs may set only flags the spec does not own, as --flag, --flag=value or "
                     "--flag value (the operator owns --model, --host, --port, --api-key, --served-model-name, "
                     "--tuning-file and every flag a spec field sets)")


def extra_arg_flag_ok(arg: str) -> bool:
    """EXTRA_ARG_RULE in Python."""
    if not arg.startswith("-") or re.match(r"-[0-9.]", arg):
        return True
    return arg.partition("=")[0] in EXTRA_FLAGS


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
    """How the engine (`kvpilot serve`) starts: its image, its static settings and the
    initial values of the live ones."""
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("!(has(self.kvCacheMemory) && has(self.gpuMemoryUtilization))",
             "engine.kvCacheMemory and engine.gpuMemoryUtilization are mutually exclusive"),
        rule("!has(self.quantization) || !has(self.simulate)",
             "engine.quantization is not modelled by engine.simulate", ".quantization"),
        rule("!has(self.kvCacheDtype) || self.kvCacheDtype == 'auto' || !has(self.simulate)",
             "engine.kvCacheDtype fp8 is not modelled by engine.simulate", ".kvCacheDtype"),
        rule("!has(self.pipelineParallelSize) || self.pipelineParallelSize == 1 || !has(self.simulate)",
             PIPELINE_NOT_SIMULATED, ".pipelineParallelSize"),
        rule(f"!has(self.extraArgs) || {EXTRA_ARG_RULE.replace('self.all', 'self.extraArgs.all')}",
             EXTRA_ARG_MESSAGE, ".extraArgs"),
    ]})
    image: Optional[str] = Field(
        default=None, pattern=IMAGE_PATTERN, max_length=512,
        description="The engine image; default: the operator's (its --engine-image, the chart's "
                    "engine.image), so `helm upgrade` rolls the engine pods to the new version.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="The engine container's imagePullPolicy.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="The weights' and activations' type (the engine's --dtype); auto: "
                                    "the checkpoint's.")
    max_num_seqs: int = Field(default=64, ge=1, le=4096,
                              description="Initial max_num_seqs (live-tunable).")
    max_model_len: int = Field(default=2048, ge=16, le=1048576,
                               description="Initial max_model_len (live-tunable).")
    max_num_batched_tokens: int = Field(default=2048, ge=16, le=1048576,
                                        description="Tokens one engine step may process (the engine's "
                                                    "--max-num-batched-tokens).")
    block_size: Literal[8, 16, 32, 64] = Field(default=16, description="Tokens per KV cache block.")
    kv_cache_memory: Optional[Bytes] = Field(
        default=None, description="KV cache bytes: a count of at least 1000000 or a quantity such as "
                                  "512Mi or 2Gi (Mi, Gi, Ti, M, G, T); CPU pods default to their memory "
                                  "less 768Mi, within [64Mi, 1Gi].")
    gpu_memory_utilization: Optional[float] = Field(
        default=None, gt=0, le=1, description="The share of GPU memory the engine may use (weights, "
                                              "activations and KV cache); the engine's default 0.9.")
    enable_prefix_caching: bool = Field(default=True, description="Reuse the KV cache of shared "
                                                                  "prompt prefixes.")
    api_key_secret_ref: Optional[SecretKeyRef] = Field(
        default=None, description="Secret key holding the API key clients must send.")
    extra_args: list[SafeText] = Field(
        default_factory=list, max_length=32,
        description="More `kvpilot serve` flags (non-live), as --flag, --flag=value or --flag value: "
                    "only flags the spec does not own (see docs/kubernetes.md); no '$(' (Kubernetes "
                    "would expand it).")
    @field_validator("extra_args")
    @classmethod
    def _extra_args(cls, v: list[str]) -> list[str]:
        bad = [a for a in v if not extra_arg_flag_ok(a)]
        if bad:
            raise ValueError(f"{EXTRA_ARG_MESSAGE}; got {bad[0]!r}")
        return v

    drain_timeout_seconds: int = Field(
        default=30, ge=0, le=3600,
        description="Seconds a stopping engine lets requests in flight finish (the engine's "
                    "--drain-timeout); the pods' terminationGracePeriodSeconds is derived from it.")
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
    """What each replica's pod requests."""
    gpus: int = Field(default=0, ge=0, le=MAX_PARALLEL_SIZE,
                      description="GPUs per replica (gpuResourceName), all for one engine: by default "
                                  "--tensor-parallel-size resources.gpus (see engine.tensorParallelSize).")
    gpu_resource_name: Optional[str] = Field(
        default=None, pattern=EXTENDED_RESOURCE_PATTERN, max_length=253,
        description="The extended resource GPUs are requested as (nvidia.com/gpu, amd.com/gpu, "
                    "gpu.intel.com/i915, ...); default: the operator's (--gpu-resource-name), else "
                    "nvidia.com/gpu.")
    cpu: Cpu = Field(default="1", description="CPU request: cores (2, 0.5) or millicores (500m).")
    memory: Bytes = Field(default="2Gi", description="Memory request and limit (e.g. 2Gi; at least 1M).")


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
    controller: Literal["Rules", "Model"] = Field(
        default="Rules",
        description="Rules: fixed-ratio steps per diagnosis. Model: replicas and maxNumSeqs sized "
                    "from a model of this deployment fitted online to its own metrics (needs "
                    "objectives.tpot); the safety rules stay around it.")


class Toleration(Model):
    """A core/v1 Toleration."""
    key: Optional[str] = Field(default=None, pattern=LABEL_KEY_PATTERN, max_length=316,
                               description="The taint key; empty with operator Exists: every taint.")
    operator: Optional[Literal["Exists", "Equal"]] = Field(default=None, description="Default Equal.")
    value: Optional[str] = Field(default=None, pattern=LABEL_VALUE_PATTERN, max_length=63,
                                 description="The taint value (operator Equal).")
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = Field(
        default=None, description="The taint effect matched; empty: all.")
    toleration_seconds: Optional[int] = Field(default=None, ge=0, le=31536000,
                                              description="NoExecute: how long the pod stays once tainted.")


_TWO = {"maxProperties": 2}  # each part has two fields: required and preferred terms


class Affinity(Model):
    """A core/v1 Affinity; each part passed through as written."""
    model_config = ConfigDict(extra="forbid")
    node_affinity: Optional[dict] = Field(default=None, description="A core/v1 NodeAffinity.",
                                          json_schema_extra=_TWO)
    pod_affinity: Optional[dict] = Field(default=None, description="A core/v1 PodAffinity.",
                                         json_schema_extra=_TWO)
    pod_anti_affinity: Optional[dict] = Field(default=None, description="A core/v1 PodAntiAffinity.",
                                              json_schema_extra=_TWO)

    @field_validator("node_affinity", "pod_affinity", "pod_anti_affinity")
    @classmethod
    def _bounded(cls, v: Optional[dict]) -> Optional[dict]:
        if v is not None and len(json.dumps(v)) > 16384:
            raise ValueError("at most 16 KiB")
        return v


# A map's keys are checked for length only at the API server: the CEL cost estimator takes an
# unbounded length for map keys, so a regex over them would exceed the CRD's cost budget. Their
# form (a qualified name) is checked by pydantic, and by the API server on the pods themselves.
LabelMap = Annotated[dict[LabelKey, Annotated[str, Field(pattern=LABEL_VALUE_PATTERN, max_length=63)]],
                     Field(max_length=32)]
AnnotationMap = Annotated[dict[LabelKey, Annotated[str, Field(max_length=4096)]], Field(max_length=32)]


class Scheduling(Model):
    """Where the engine pods may run (default: the operator's, from the chart's engine values)."""
    node_selector: LabelMap = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32,
                                          description="Taints the pods tolerate (e.g. nvidia.com/gpu).")
    affinity: Optional[Affinity] = Field(default=None, description=Affinity.__doc__)
    priority_class_name: Optional[str] = Field(default=None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253,
                                               description="The pods' PriorityClass.")


class PodSecurity(Model):
    """The engine pods' security context. Given, it replaces the operator's default (run as
    65532, fsGroup 65532) whole: OpenShift's restricted SCC wants {runAsNonRoot: true} alone,
    so that it assigns the ids."""
    run_as_user: Optional[int] = Field(default=None, ge=1, le=2**31 - 1, description="The UID (never 0).")
    run_as_group: Optional[int] = Field(default=None, ge=0, le=2**31 - 1, description="The GID.")
    fs_group: Optional[int] = Field(default=None, ge=0, le=2**31 - 1,
                                    description="The group volumes are made writable for.")
    supplemental_groups: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(
        default_factory=list, max_length=16, description="More groups the containers run with.")
    run_as_non_root: bool = Field(default=True, description="Refuse images that would run as root.")
    seccomp_profile_type: Literal["RuntimeDefault", "Localhost", "Unconfined"] = Field(
        default="RuntimeDefault", description="The seccomp profile (pod level and each container).")


class PodSettings(Model):
    """The engine pods' identity and metadata (default: the operator's, from the chart's
    engine values; a per-LLMDeployment value replaces it, maps are merged)."""
    image_pull_secrets: list[Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)]] = Field(
        default_factory=list, max_length=16, description="Names of docker-registry Secrets the engine "
                                                         "image is pulled with (private registries).")
    service_account_name: Optional[str] = Field(
        default=None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253,
        description="The pods' ServiceAccount (IRSA, Workload Identity); its token is mounted only "
                    "when this is set. Default: the namespace's default, without a token.")
    annotations: AnnotationMap = Field(default_factory=dict, description="Extra pod annotations.")
    labels: LabelMap = Field(default_factory=dict, description="Extra pod labels (the operator's own "
                                                               "selector labels win).")
    security_context: Optional[PodSecurity] = Field(default=None, description=PodSecurity.__doc__)


class ServiceSpec(Model):
    """The Service in front of the engine pods."""
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(default="ClusterIP",
                                                                   description="The Service type.")
    port: int = Field(default=8000, ge=1, le=65535, description="The Service port.")


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


DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULTS_ENV = "KVPILOT_ENGINE_DEFAULTS"  # the operator's OperatorDefaults as JSON (the CLI sets it)


class OperatorDefaults(Model):
    """What the operator fills in where an LLMDeployment leaves a field out (`kvpilot operator
    --engine-image`, `--engine-defaults`; the chart's engine values): read at each reconcile,
    so `helm upgrade` reaches every engine pod."""
    engine_image: Optional[str] = Field(default=None, pattern=IMAGE_PATTERN, max_length=512)
    simulated_image: Optional[str] = Field(default=None, pattern=IMAGE_PATTERN, max_length=512)
    gpu_resource_name: Optional[str] = Field(default=None, pattern=EXTENDED_RESOURCE_PATTERN, max_length=253)
    prometheus_url: Optional[str] = Field(default=None, pattern=URL_PATTERN, max_length=1024)
    pod: PodSettings = Field(default_factory=PodSettings)
    scheduling: Scheduling = Field(default_factory=Scheduling)

    @classmethod
    def from_env(cls, environ: dict) -> "OperatorDefaults":
        text = environ.get(DEFAULTS_ENV, "").strip()
        return cls.model_validate_json(text) if text else cls()


def engine_image(spec: LLMDeploymentSpec, d: OperatorDefaults | None = None) -> str:
    """The engine container's image: the spec's, else the operator's (a simulated engine runs
    the torch-free operator image, a real one the engine image)."""
    d = d or OperatorDefaults()
    if spec.engine.image:
        return spec.engine.image
    if spec.engine.simulate is not None:
        return d.simulated_image or DEFAULT_SIMULATED_IMAGE
    return d.engine_image or DEFAULT_IMAGE


def with_defaults(spec: LLMDeploymentSpec, d: OperatorDefaults) -> LLMDeploymentSpec:
    """`spec` with the operator's defaults where it names nothing: scalars and lists are
    replaced whole, annotations and labels merged (the spec's win)."""
    e, r, p, s, at = spec.engine, spec.resources, spec.pod, spec.scheduling, spec.autotune
    url = at.prometheus.url or d.prometheus_url or DEFAULT_PROMETHEUS_URL
    return spec.model_copy(update={
        "autotune": at.model_copy(update={"prometheus": at.prometheus.model_copy(update={"url": url})}),
        "engine": e.model_copy(update={"image": engine_image(spec, d)}),
        "resources": r.model_copy(update={
            "gpu_resource_name": r.gpu_resource_name or d.gpu_resource_name or DEFAULT_GPU_RESOURCE}),
        "pod": p.model_copy(update={
            "image_pull_secrets": p.image_pull_secrets or d.pod.image_pull_secrets,
            "service_account_name": p.service_account_name or d.pod.service_account_name,
            "annotations": {**d.pod.annotations, **p.annotations}, "labels": {**d.pod.labels, **p.labels},
            "security_context": p.security_context or d.pod.security_context}),
        "scheduling": s.model_copy(update={
            "node_selector": s.node_selector or d.scheduling.node_selector,
            "tolerations": s.tolerations or d.scheduling.tolerations,
            "affinity": s.affinity or d.scheduling.affinity,
            "priority_class_name": s.priority_class_name or d.scheduling.priority_class_name}),
    })


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
    if e.extra_args:
        validate_extra_args(e.extra_args)
    validate_spec_bounds(spec)
    from ..manifests.parallel import validate_parallel
    validate_parallel(spec)


def validate_extra_args(extra: list[str]) -> None:
    """engine.extraArgs as `kvpilot serve`'s own parser reads them (it loads no torch): a
    value it would refuse at start ("--seed abc", a flag without its value) is refused here,
    not crash-looped in a pod."""
    import argparse

    from kvpilot.engine.server.cli import add_parser

    class Refusing(argparse.ArgumentParser):
        def error(self, message):  # argparse's own: print usage, exit 2
            raise InvalidSpec(f"engine.extraArgs: kvpilot serve would refuse them: {message}")

    serve = add_parser(Refusing(prog="kvpilot").add_subparsers())
    serve.parse_args(["--model", "builtin:tiny", *extra])


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
        from kvpilot.engine.fetch.uri import parse_source
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
