"""kvpilot's serving engine: paged KV cache, continuous batching, prefix caching.

Names are resolved lazily, so `kvpilot crd` or `kvpilot operator` never pay for
importing torch.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": ".llm",
    "LLMEngine": ".llm_engine",
    "EngineConfig": ".config.engine",
    "SamplingParams": ".core.sampling_params",
    "RequestOutput": ".core.outputs",
    "CompletionOutput": ".core.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name], __name__), name)
