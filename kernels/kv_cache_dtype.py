"""The KV cache's storage dtype (--kv-cache-dtype, as vLLM names it) and its fp8 codec.

`auto` stores K/V in the model's dtype. `fp8` (= `fp8_e4m3`) stores them as
float8_e4m3fn, one byte per element, with a per-layer float32 scale for K and one for V
(vLLM's k_scale / v_scale): a write stores x / scale saturated to e4m3's +-448, a read
upcasts to the compute dtype and multiplies by the scale. Scales are 1.0 unless a
checkpoint provides calibrated ones, as vLLM does without calibration."""

from __future__ import annotations

import torch

# The names that mean fp8 storage (the engine's config lists every choice, "auto" too, and
# refuses others before a cache is made; the codec needs only these).
FP8_NAMES = ("fp8", "fp8_e4m3")
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for `--kv-cache-dtype name` with a model in `model_dtype`."""
    if name == "auto":
        return model_dtype
    if name in FP8_NAMES:
        return FP8
    raise ValueError(f"kv_cache_dtype must be 'auto' or one of {FP8_NAMES}, got {name!r}")


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:  # same shape, float8_e4m3fn
    # Clamp first: torch's cast to float8_e4m3fn does not saturate (out of range becomes NaN).
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:  # same shape, dtype
    return (q.to(torch.float32) * scale).to(dtype)
