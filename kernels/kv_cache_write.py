"""Scatter a step's new keys and values into one layer's paged KV cache.

Layout (per layer): ``k_cache``/``v_cache`` are ``[num_blocks, block_size,
num_kv_heads, head_dim]``; token t goes to slot ``slot_mapping[t]`` = block_id *
block_size + offset, i.e. ``k_cache[slot // block_size, slot % block_size]``.

Tolerance: the kernel copies bits (no arithmetic), so it must match
``write_kv_cache_reference`` exactly in every dtype.

An fp8 cache (``float8_e4m3fn``): K/V are quantized in torch first (x / scale, saturated
to +-448, rounded to nearest even: ``kvpilot.kernels.kv_cache_dtype.quantize_fp8``, the
torch path's own codec) and the kernel scatters their bytes. The cast stays out of the
kernel because Triton 3.9's interpreter rounds float32 -> e4m3 wrongly when the rounding
carries into the exponent (124 becomes 64), so an in-kernel cast could not be tested
here; on a GPU this costs one elementwise pass over the step's new K/V per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._common import FP8_CACHE_DTYPE, check_cache, next_power_of_2


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    num_tokens,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_T: tl.constexpr,  # tokens per program
):
    # One program writes BLOCK_T tokens of one KV head.
    pid_t = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)

    tokens = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    token_mask = tokens < num_tokens
    mask = token_mask[:, None] & (dims[None, :] < HEAD_DIM)  # [BLOCK_T, HEAD_DIM_PAD]

    slots = tl.load(slot_mapping_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
    blocks = slots // BLOCK_SIZE
    offsets = slots % BLOCK_SIZE

    src_k = key_ptr + tokens[:, None] * stride_kt + head * stride_kh + dims[None, :] * stride_kd
    src_v = value_ptr + tokens[:, None] * stride_vt + head * stride_vh + dims[None, :] * stride_vd
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)

    dst_k = (
        k_cache_ptr
        + blocks[:, None] * stride_kcb
        + offsets[:, None] * stride_kcs
        + head * stride_kch
        + dims[None, :] * stride_kcd
    )
    dst_v = (
        v_cache_ptr
        + blocks[:, None] * stride_vcb
        + offsets[:, None] * stride_vcs
        + head * stride_vch
        + dims[None, :] * stride_vcd
    )
    tl.store(dst_k, k, mask=mask)
    tl.store(dst_v, v, mask=mask)


def _check(key, value, k_cache, v_cache, slot_mapping) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            "key and value must both be [num_tokens, num_kv_heads, head_dim], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    check_cache(k_cache, v_cache, key.dtype)
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} != key's {tuple(key.shape[1:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens] (>= {key.shape[0]}), got {tuple(slot_mapping.shape)}")


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: float = 1.0,  # an fp8 cache's scales (ignored for a cache in key's dtype)
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` into the caches in place at ``slot_mapping``'s slots."""
    if k_cache.dtype == FP8_CACHE_DTYPE and key.dtype != FP8_CACHE_DTYPE:
        key, value, k_cache, v_cache = _as_fp8_bytes(key, value, k_cache, v_cache, k_scale, v_scale)
    _check(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    head_dim_pad = next_power_of_2(head_dim)
    # Keep a program's tile around 4K elements; at least one token.
    block_t = max(1, min(64, 4096 // head_dim_pad, next_power_of_2(num_tokens)))
    grid = (triton.cdiv(num_tokens, block_t), num_kv_heads)
    _write_kv_cache_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        num_tokens,
        *key.stride(), *value.stride(),
        *k_cache.stride(), *v_cache.stride(),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_T=block_t,
        num_warps=4,
    )


def _as_fp8_bytes(key, value, k_cache, v_cache, k_scale: float, v_scale: float):
    """The step's K/V quantized for an fp8 cache, and all four as uint8 views."""
    from kvpilot.kernels.kv_cache_dtype import quantize_fp8

    return (quantize_fp8(key, k_scale).view(torch.uint8), quantize_fp8(value, v_scale).view(torch.uint8),
            k_cache.view(torch.uint8), v_cache.view(torch.uint8))


def write_kv_cache_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain-torch ``write_kv_cache``: same arguments, same in-place effect."""
    if k_cache.dtype == FP8_CACHE_DTYPE and key.dtype != FP8_CACHE_DTYPE:
        key, value, k_cache, v_cache = _as_fp8_bytes(key, value, k_cache, v_cache, k_scale, v_scale)
    _check(key, value, k_cache, v_cache, slot_mapping)
    num_tokens = key.shape[0]
    block_size = k_cache.shape[1]
    slots = slot_mapping[:num_tokens].long()  # [num_tokens]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value
