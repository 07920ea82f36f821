"""Paged attention behind one function, with two backends reading the same cache.

`torch`: plain torch (gather the request's blocks, then SDPA with a causal offset).
`triton`: the kernels in kvpilot.kernels, imported only when chosen.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata


def resolve_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


class PagedAttention:
    """Writes the step's new K/V into the paged cache, then attends over it."""

    def __init__(self, backend: str) -> None:
        if backend not in ("triton", "torch"):
            raise ValueError(f"attention_backend must be auto, triton or torch, got {backend!r}")
        self.backend = backend
        if backend == "triton":
            from kvpilot.kernels.kv_cache_write import write_kv_cache
            from kvpilot.kernels.paged_decode_attention import paged_decode_attention
            from kvpilot.kernels.paged_prefill_attention import paged_prefill_attention

            self._write: Callable = write_kv_cache
            self._decode: Callable = paged_decode_attention
            self._prefill: Callable = paged_prefill_attention

    def __call__(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if self.backend == "torch":
            write_kv_cache_torch(key, value, k_cache, v_cache, meta.slot_mapping)
            return paged_attention_torch(query, k_cache, v_cache, meta, scale)
        self._write(key, value, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return self._decode(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                max_seq_len=meta.max_seq_len,
            )
        return self._prefill(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, meta.max_query_len, scale,
        )


def write_kv_cache_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if meta.is_decode_only:
        return _decode_batched(query, k_cache, v_cache, meta, scale)
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[i, :num_blocks]
        k = k_cache[blocks].flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
        v = v_cache[blocks].flatten(0, 1)[:seq_len]
        q = query[start : start + q_len]  # [q_len, num_heads, head_dim]
        # Query row j sits at position seq_len - q_len + j and sees keys up to it.
        mask = None
        if q_len > 1:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )  # [num_heads, q_len, head_dim]
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def _decode_batched(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    block_size = k_cache.shape[1]
    max_blocks = -(-meta.max_seq_len // block_size)
    tables = meta.block_tables[:, :max_blocks]  # [num_seqs, max_blocks]
    k = k_cache[tables].flatten(1, 2)  # [num_seqs, max_blocks * block_size, kv_heads, head_dim]
    v = v_cache[tables].flatten(1, 2)
    positions = torch.arange(k.shape[1], device=query.device)
    mask = positions[None, :] < meta.seq_lens[:, None].to(positions.dtype)  # [num_seqs, L]
    o = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [num_seqs, num_heads, 1, head_dim]
        k.transpose(1, 2), v.transpose(1, 2),  # [num_seqs, kv_heads, L, head_dim]
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True,
    )  # [num_seqs, num_heads, 1, head_dim]
    return o.squeeze(2)
