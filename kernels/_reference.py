"""Plain-torch paged attention shared by the decode and prefill references.

This is also the engine's CPU attention path, so it is vectorised per request
(one gather and two matmuls each) rather than per token.
"""

from __future__ import annotations

import torch


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_row: torch.Tensor,  # [max_blocks_per_seq]
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """One sequence's first ``seq_len`` cached tokens, in logical order."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table_row[:num_blocks].long()
    if cache.dtype == torch.float8_e4m3fn:  # indexing has no float8 kernel on the CPU: gather bytes
        return gather_kv(cache.view(torch.uint8), block_table_row, seq_len).view(cache.dtype)
    return cache[blocks].reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    seq_lens: list[int],
    query_start_loc: list[int],
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
    k_scale: float = 1.0,  # an fp8 cache's scales: K = stored x k_scale (unused otherwise)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query's dtype
    """Causal attention of each request's last ``query_len`` tokens over its cache.

    Request i's query rows are ``query_start_loc[i]:query_start_loc[i + 1]``; rows
    that belong to no request (if any) are returned as zeros. An fp8 cache is read as
    its stored values times its scale, in ``compute_dtype``.
    """
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    for i, seq_len in enumerate(seq_lens):
        start = query_start_loc[i]
        query_len = query_start_loc[i + 1] - start
        if query_len <= 0:
            continue
        k = gather_kv(k_cache, block_tables[i], seq_len).to(compute_dtype)  # [seq_len, num_kv_heads, head_dim]
        v = gather_kv(v_cache, block_tables[i], seq_len).to(compute_dtype)  # [seq_len, num_kv_heads, head_dim]
        if fp8:
            k, v = k * k_scale, v * v_scale
        q = query[start : start + query_len].to(compute_dtype)  # [query_len, num_heads, head_dim]
        # [kv_heads, group, query_len, head_dim]
        q = q.view(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        k = k.permute(1, 2, 0).unsqueeze(1)  # [kv_heads, 1, head_dim, seq_len]
        v = v.permute(1, 0, 2).unsqueeze(1)  # [kv_heads, 1, seq_len, head_dim]
        scores = torch.matmul(q, k) * scale  # [kv_heads, group, query_len, seq_len]
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        future = k_pos[None, :] > q_pos[:, None]  # [query_len, seq_len]
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v)  # [kv_heads, group, query_len, head_dim]
        out[start : start + query_len] = o.permute(2, 0, 1, 3).reshape(query_len, num_heads, head_dim).to(query.dtype)
    return out
