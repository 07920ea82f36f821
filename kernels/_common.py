"""Small helpers shared by the kernel wrappers (no triton import here)."""

from __future__ import annotations

import os

import torch

# Relative error ||out - ref|| / ||ref|| that a kernel may show against its torch
# reference, per dtype. fp32 runs its dots in IEEE fp32; fp16/bf16 feed the tensor
# cores 16-bit operands (the softmax probabilities are rounded to the input dtype
# before the P @ V dot, as every flash-attention kernel does) and accumulate in fp32.
KERNEL_RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}

# Relative error the fp32-computing torch reference may show against float64 dense
# attention on the same (already dtype-rounded) inputs: only the final cast to the
# output dtype (and fp32 arithmetic) separates them.
REFERENCE_RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether a kernel should feed its dots fp32 operands instead of ``dtype``.

    Triton's interpreter multiplies bfloat16 operands of ``tl.dot`` as their raw
    uint16 bit patterns (it stores bf16 as uint16 in numpy), so under the
    interpreter bf16 tiles are upcast to fp32 before each dot. On a GPU the dots
    always take the cache's own dtype.
    """
    return dtype == torch.bfloat16 and interpreting()


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# An fp8 KV cache (--kv-cache-dtype fp8): e4m3 elements with a per-layer K and V scale. The
# attention kernels upcast what they load to the query's dtype (e4m3 values are exact in
# fp16, bf16 and fp32; the scale multiplies in fp32 first), so their tolerances against the
# reference on the dequantized cache are the query dtype's KERNEL_RTOL.
FP8_CACHE_DTYPE = torch.float8_e4m3fn


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype, *,
                fp8_ok: bool = False) -> None:
    """Validate a layer's paged K/V caches: [num_blocks, block_size, num_kv_heads, head_dim],
    in `dtype` (or, with `fp8_ok`, both in FP8_CACHE_DTYPE)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if fp8_ok and k_cache.dtype == FP8_CACHE_DTYPE and v_cache.dtype == FP8_CACHE_DTYPE:
        return
    if k_cache.dtype != dtype or v_cache.dtype != dtype:
        raise ValueError(f"cache dtype {k_cache.dtype}/{v_cache.dtype} does not match {dtype}")
