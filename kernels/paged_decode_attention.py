"""Paged decode attention: one query token per sequence against its paged K/V cache.

Layout (per layer): ``k_cache``/``v_cache`` are ``[num_blocks, block_size,
num_kv_heads, head_dim]``; sequence i's logical block j lives in physical block
``block_tables[i, j]``; its ``seq_lens[i]`` cached tokens (its own new token
included, already written by ``write_kv_cache``) are all visible to its query.

Design (flash-decoding):
- one program per (sequence, KV head, split): the program loads the query rows of
  every query head sharing that KV head (GQA/MQA, padded to at least 16 rows for
  ``tl.dot``), so each K/V tile is read from memory once per group;
- a tile is ``BLOCK_N`` consecutive token positions, gathered through the block
  table token by token, so any block size (8, 16, 32, ...) and any head dim
  (non-powers of two padded and masked) share one kernel;
- with ``num_splits > 1`` each split covers a slice of the sequence and writes a
  partial output plus its running max and sum; a second kernel merges them.

Tolerances (relative error ``||out - ref|| / ||ref||`` against
``paged_decode_attention_reference``): fp32 1e-5, fp16 1e-3, bf16 1e-2 (see
``kvpilot.kernels._common.KERNEL_RTOL``). An fp8 cache (``float8_e4m3fn`` with
``k_scale``/``v_scale``) is read as stored x scale (multiplied in fp32, then cast to the
query's dtype) and held to the query dtype's tolerance against the reference, which
dequantizes the same way.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kvpilot.kernels._common import FP8_CACHE_DTYPE, check_cache, next_power_of_2, upcast_dots
from kvpilot.kernels._reference import paged_attention_torch

# Finite stand-in for -inf as the running max's start value, so that a row or a
# split that sees no key never computes (-inf) - (-inf).
_NEG_BIG = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # SPLIT: [num_seqs, num_heads, num_splits, head_dim] fp32, else [num_seqs, num_heads, head_dim]
    max_ptr,  # SPLIT only: [num_seqs, num_heads, num_splits] fp32 running max (log2 domain)
    sum_ptr,  # SPLIT only: [num_seqs, num_heads, num_splits] fp32 softmax denominator
    qk_scale,  # softmax scale * log2(e)
    k_scale,  # FP8 only: K = stored x k_scale
    v_scale,  # FP8 only: V = stored x v_scale
    num_splits,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_os, stride_oh, stride_osplit, stride_od,
    stride_ms, stride_mh,  # max/sum buffers share strides; split stride is 1
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_BLOCKS: tl.constexpr,  # programs per KV head = cdiv(GROUP, BLOCK_G)
    BLOCK_G: tl.constexpr,  # query-head rows per program (power of two, >= 16)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # token positions per tile (power of two, >= 16)
    SPLIT: tl.constexpr,
    FP8: tl.constexpr,  # the caches hold float8 e4m3: upcast to the query's dtype on load
    UPCAST: tl.constexpr,  # feed fp32 to tl.dot (interpreter + bf16 only)
    DOT_PRECISION: tl.constexpr,
):
    compute_ty = q_ptr.dtype.element_ty
    seq = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = (pid_h // GROUP_BLOCKS).to(tl.int64)
    group_rows = (pid_h % GROUP_BLOCKS) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G]
    head_mask = group_rows < GROUP
    heads = kv_head * GROUP + group_rows  # [BLOCK_G]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    dim_mask = dims < HEAD_DIM

    seq_len = tl.load(seq_lens_ptr + seq)
    # Every split of a sequence covers the same whole number of tiles. (Plain integer
    # math rather than tl.cdiv: nested jit calls are slow in the interpreter.)
    tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    tokens_per_split = ((tiles + num_splits - 1) // num_splits) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    q_offs = seq * stride_qs + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=head_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_G, HEAD_DIM_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq * stride_bts

    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        pos_mask = pos < end
        # Physical block of every position; masked positions never touch the table.
        blocks = tl.load(table_row + (pos // BLOCK_SIZE) * stride_btb, mask=pos_mask, other=0).to(tl.int64)
        offsets = pos % BLOCK_SIZE
        kv_mask = pos_mask[:, None] & dim_mask[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
        k_offs = (blocks[:, None] * stride_kb + offsets[:, None] * stride_ks
                  + kv_head * stride_kh + dims[None, :] * stride_kd)
        v_offs = (blocks[:, None] * stride_vb + offsets[:, None] * stride_vs
                  + kv_head * stride_vh + dims[None, :] * stride_vd)
        k = tl.load(k_cache_ptr + k_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        v = tl.load(v_cache_ptr + v_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        if FP8:
            k = (k.to(tl.float32) * k_scale).to(compute_ty)
            v = (v.to(tl.float32) * v_scale).to(compute_ty)
        if UPCAST:
            k = k.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(compute_ty)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # [BLOCK_G, HEAD_DIM_PAD]
    out_mask = head_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        o_offs = seq * stride_os + heads[:, None] * stride_oh + split * stride_osplit + dims[None, :] * stride_od
        tl.store(out_ptr + o_offs, out, mask=out_mask)
        ml_offs = seq * stride_ms + heads * stride_mh + split
        tl.store(max_ptr + ml_offs, m_i, mask=head_mask)
        tl.store(sum_ptr + ml_offs, l_i, mask=head_mask)
    else:
        o_offs = seq * stride_os + heads[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32
    max_ptr,  # [num_seqs, num_heads, num_splits] fp32
    sum_ptr,  # [num_seqs, num_heads, num_splits] fp32
    out_ptr,  # [num_seqs, num_heads, head_dim]
    num_splits,
    stride_ps, stride_ph, stride_psplit, stride_pd,
    stride_ms, stride_mh,
    stride_os, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    dim_mask = dims < HEAD_DIM

    ml_offs = seq * stride_ms + head * stride_mh + splits
    m = tl.load(max_ptr + ml_offs, mask=split_mask, other=float("-inf"))
    total = tl.load(sum_ptr + ml_offs, mask=split_mask, other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0)) * total  # [SPLITS_PAD]; empty splits weigh 0
    denom = tl.sum(weight, axis=0)

    p_offs = seq * stride_ps + head * stride_ph + splits[:, None] * stride_psplit + dims[None, :] * stride_pd
    partial = tl.load(partial_ptr + p_offs, mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    out = tl.sum(partial * weight[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)  # [HEAD_DIM_PAD]
    o_offs = seq * stride_os + head * stride_oh + dims * stride_od
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_context_len: int,
    num_sms: int,
    *,
    min_tokens_per_split: int = 256,
    max_splits: int = MAX_SPLITS,
) -> int:
    """How many KV splits the decode kernel should use (pure; no device queries).

    Without splitting the grid has ``num_seqs * num_kv_heads`` programs. When that
    is fewer than two per streaming multiprocessor, long contexts are split so the
    grid fills the device, but never into slices shorter than
    ``min_tokens_per_split`` tokens (the merge pass and per-split overhead would
    then cost more than the parallelism gains).
    """
    if num_seqs <= 0 or num_kv_heads <= 0 or max_context_len <= min_tokens_per_split:
        return 1
    programs = num_seqs * num_kv_heads
    target = 2 * max(1, num_sms)
    if programs >= target:
        return 1
    by_occupancy = math.ceil(target / programs)
    by_length = math.ceil(max_context_len / min_tokens_per_split)
    return max(1, min(by_occupancy, by_length, max_splits))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # CPU (Triton's interpreter runs programs one after another): splitting only adds work.
    return 1


def _launch_config(head_dim_pad: int, group: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes and launch options (gpu_check sweeps alternatives by replacing this).

    BLOCK_G: query-head rows per program (>= 16 for tl.dot; a group larger than 64
    is split over several programs). BLOCK_N: key positions per tile.
    """
    return {
        "BLOCK_G": max(16, min(64, next_power_of_2(group))),
        "BLOCK_N": 64 if head_dim_pad <= 128 else 32,
        "num_warps": 4,
    }


def _check(query, k_cache, v_cache, block_tables, seq_lens) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs, num_heads, head_dim], got {tuple(query.shape)}")
    check_cache(k_cache, v_cache, query.dtype, fp8_ok=True)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != query head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got {tuple(seq_lens.shape)}")


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    k_scale: float = 1.0,  # an fp8 cache's scales (ignored for a cache in the query's dtype)
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of each sequence's single query token over its paged cache.

    ``num_splits=None`` lets ``choose_num_splits`` decide from the batch, the
    longest possible context (``max_seq_len`` when given, else the block table's
    capacity ``max_blocks_per_seq * block_size``: no device sync) and the device's
    multiprocessor count. ``out`` may be passed to write into an existing buffer.
    Returns ``[num_seqs, num_heads, head_dim]`` in the query's dtype.
    """
    _check(query, k_cache, v_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    head_dim_pad = next_power_of_2(head_dim)
    config = dict(_launch_config(head_dim_pad, group, query.dtype))
    block_g = config.pop("BLOCK_G")
    group_blocks = triton.cdiv(group, block_g)
    if num_splits is None:
        max_context = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, _num_sms(query.device))
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    split = num_splits > 1
    upcast = upcast_dots(query.dtype)
    precision = "ieee" if (query.dtype == torch.float32 or upcast) else None

    if split:
        partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        maxes = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        sums = torch.empty_like(maxes)
        dest, dest_strides = partial, partial.stride()
        ml_strides = maxes.stride()[:2]
    else:
        dest, maxes, sums = out, out, out  # max/sum pointers are unused without splits
        dest_strides = (out.stride(0), out.stride(1), 0, out.stride(2))
        ml_strides = (0, 0)

    grid = (num_seqs, num_kv_heads * group_blocks, num_splits)
    _paged_decode_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens,
        dest, maxes, sums,
        scale * _LOG2E,
        float(k_scale), float(v_scale),
        num_splits,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *dest_strides,
        *ml_strides,
        GROUP=group,
        GROUP_BLOCKS=group_blocks,
        BLOCK_G=block_g,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        SPLIT=split,
        FP8=k_cache.dtype == FP8_CACHE_DTYPE,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        **config,  # BLOCK_N, num_warps (, num_stages)
    )
    if split:
        _merge_splits_kernel[(num_seqs, num_heads)](
            partial, maxes, sums, out,
            num_splits,
            *partial.stride(),
            *maxes.stride()[:2],
            *out.stride(),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=next_power_of_2(num_splits),
            num_warps=4,
        )
    return out


def paged_decode_attention_reference(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain-torch ``paged_decode_attention`` (fp32 math; ``num_splits`` and
    ``max_seq_len`` are accepted for signature parity and ignored)."""
    _check(query, k_cache, v_cache, block_tables, seq_lens)
    num_seqs = query.shape[0]
    seq_lens_list = [int(n) for n in seq_lens.tolist()]
    starts = list(range(num_seqs + 1))  # one query row per sequence
    result = paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens_list, starts, scale,
                                   k_scale=k_scale, v_scale=v_scale)
    if out is None:
        return result
    out.copy_(result)
    return out
