"""spec.engine and spec.resources: the engine's settings (flags it owns and the extra ones a
user may pass), speculative decoding, and what a pod asks of the node."""
from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import ConfigDict, Field, field_validator

from .fields import Bytes, Cpu, DRAFT_MODEL_PATTERN, EXTENDED_RESOURCE_PATTERN, IMAGE_PATTERN, MAX_PARALLEL_SIZE, MAX_SPECULATIVE_TOKENS, Model, PROMPT_LOOKUP_DEFAULTS, SafeText, rule
from .model import SecretKeyRef, SimulateSpec


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
               "--simulate-spec-draft-cost", "--simulate-tflops", "--write-timeout")
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
