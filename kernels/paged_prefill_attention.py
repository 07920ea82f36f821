"""Paged prefill/extend attention for a ragged batch of query chunks.

Request i owns query rows ``query_start_loc[i]:query_start_loc[i + 1]`` (its
``query_len`` newest tokens, already written to the paged cache by
``write_kv_cache``). Row j sits at position ``seq_lens[i] - query_len + j`` and
attends causally to every cached key at or before that position: the prefix
(from an earlier chunk or a prefix-cache hit, possibly ending mid-block) and the
chunk itself. Decode rows (``query_len == 1``) may share the batch.

Design (flash-attention over a paged cache):
- one program per (request, block of query tokens, KV head); its ``BLOCK_M`` rows
  are ``BLOCK_Q`` query tokens x the ``GROUP`` query heads of that KV head, so each
  K/V tile is loaded once per GQA group;
- a K/V tile is ``BLOCK_N`` consecutive positions gathered through the block table,
  so any block size and head dim (padded, masked) share one kernel;
- tiles past the block's last query position are skipped (causal), programs past a
  request's ``query_len`` exit at once (the grid is sized by ``max_query_len``).

Tolerances (relative error ``||out - ref|| / ||ref||`` against
``paged_prefill_attention_reference``): fp32 1e-5, fp16 1e-3, bf16 1e-2 (see
``kvpilot.kernels._common.KERNEL_RTOL``), with a cache in the query's dtype or in fp8
(``float8_e4m3fn`` with ``k_scale``/``v_scale``, upcast on load as the decode kernel does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._common import FP8_CACHE_DTYPE, check_cache, next_power_of_2, upcast_dots
from kvpilot.kernels._reference import paged_attention_torch

_NEG_BIG = tl.constexpr(-1.0e30)  # finite start for the running max: fully masked rows stay NaN-free
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    qk_scale,  # softmax scale * log2(e)
    k_scale,  # FP8 only: K = stored x k_scale
    v_scale,  # FP8 only: V = stored x v_scale
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q tokens x GROUP heads (+ padding)
    BLOCK_Q: tl.constexpr,  # query tokens per program
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # key positions per tile
    FP8: tl.constexpr,  # the caches hold float8 e4m3: upcast to the query's dtype on load
    UPCAST: tl.constexpr,  # feed fp32 to tl.dot (interpreter + bf16 only)
    DOT_PRECISION: tl.constexpr,
):
    compute_ty = q_ptr.dtype.element_ty
    seq = tl.program_id(0).to(tl.int64)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2).to(tl.int64)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this chunk

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_idx = q_block * BLOCK_Q + rows // GROUP  # query token within the request
    row_mask = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    heads = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    q_pos = context_len + q_idx  # [BLOCK_M] absolute positions
    tokens = q_start.to(tl.int64) + q_idx  # [BLOCK_M] rows of the flattened batch
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]  # [BLOCK_M, HEAD_DIM_PAD]

    q_offs = tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq * stride_bts
    # Keys up to this block's last query position (causal skip of later tiles).
    kv_end = context_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)

    for tile_start in range(0, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        pos_mask = pos < kv_end
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

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = pos_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(compute_ty)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_offs = tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _launch_config(head_dim_pad: int, group: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes and launch options (gpu_check may sweep alternatives by replacing this).

    BLOCK_M: rows per program (query tokens x group heads; at least one whole group).
    BLOCK_N: key positions per tile. Smaller tiles for head dim 256 and for fp32,
    whose operands take twice the registers (64x64 fp32 tiles at head dim 32 spill).
    """
    tile = 64 if head_dim_pad <= 128 and dtype != torch.float32 else 32
    return {"BLOCK_M": max(tile, next_power_of_2(group)), "BLOCK_N": tile, "num_warps": 4}


def _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    check_cache(k_cache, v_cache, query.dtype, fp8_ok=True)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != query head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    num_seqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} must agree on num_seqs"
        )
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}], got {tuple(query_start_loc.shape)}")


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    k_scale: float = 1.0,  # an fp8 cache's scales (ignored for a cache in the query's dtype)
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each request's query chunk over its paged cache.

    ``max_query_len`` must be >= every request's query length (it sizes the grid;
    no device sync). Returns ``[num_tokens, num_heads, head_dim]`` in the query's
    dtype; rows that belong to no request are left unwritten.
    """
    _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    head_dim_pad = next_power_of_2(head_dim)
    config = dict(_launch_config(head_dim_pad, group, query.dtype))
    block_q = config["BLOCK_M"] // group
    upcast = upcast_dots(query.dtype)
    precision = "ieee" if (query.dtype == torch.float32 or upcast) else None

    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * _LOG2E,
        float(k_scale), float(v_scale),
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        GROUP=group,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        FP8=k_cache.dtype == FP8_CACHE_DTYPE,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        **config,  # BLOCK_M, BLOCK_N, num_warps (, num_stages)
    )
    return out


def paged_prefill_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain-torch ``paged_prefill_attention`` (fp32 math; rows that belong to no
    request come back as zeros)."""
    _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    seq_lens_list = [int(n) for n in seq_lens.tolist()]
    starts = [int(n) for n in query_start_loc.tolist()]
    result = paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens_list, starts, scale,
                                   k_scale=k_scale, v_scale=v_scale)
    if out is None:
        return result
    out.copy_(result)
    return out
