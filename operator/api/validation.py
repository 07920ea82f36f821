"""The CEL rules again and what CEL cannot see, for a parsed spec: the operator refuses here
what the API server would, for objects admitted before a rule existed."""
from __future__ import annotations



from .fields import InvalidSpec, PROMPT_LOOKUP_DEFAULTS
from .model import ModelSource, SIMULATE_NEEDS_MODEL, SimulateSpec
from .engine import DRAFT_NEEDS_MODEL, LOOKUP_IS_NGRAM, LOOKUP_ORDER, NGRAM_TAKES_NO_MODEL, SPECULATIVE_NEEDS_METHOD, SpeculativeSpec
from .spec import LLMDeploymentSpec, SPEC_BOUNDS_NEED_SPECULATIVE, SPEC_BOUNDS_WITHIN_K
from .parallel import validate_parallel


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
