"""Random paged-cache cases and a float64 dense oracle, shared by tests/ and gpu_check.

A case lays out a batch the way the engine does: each request has ``seq_len``
tokens in total, of which the last ``query_len`` are this step's queries (and its
new K/V, already in the cache unless ``write_new=False``). Physical blocks are
shuffled; block 0 is never used by a request, so the block tables' zero padding
points at it; every cache element not holding a real token (block 0, unused
blocks, the tail of each request's last block) is NaN, so a kernel that reads
past ``seq_len`` or through padding produces NaN and fails its check.

Only torch is imported here (no triton).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, zero-padded
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64: the query tokens' slots
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: the query tokens' new keys
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    max_query_len: int
    scale: float


def make_paged_case(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 2,
    write_new: bool = True,
) -> PagedCase:
    """Build a random paged batch; ``query_lens[i] <= seq_lens[i]``.

    With ``write_new=False`` the query tokens' own K/V are left NaN in the cache
    (for testing the cache-write kernel that fills them).
    """
    if len(seq_lens) != len(query_lens) or any(q > s or q < 0 for s, q in zip(seq_lens, query_lens)):
        raise ValueError(f"bad seq_lens {seq_lens} / query_lens {query_lens}")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks  # block 0: the padding target
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_seq, default=0) + 1  # always at least one padding column
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor(physical[:n], dtype=torch.int32)
        physical = physical[n:]

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    slots: list[int] = []
    keys, values = [], []
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        pos = torch.arange(seq_len)
        seq_slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        cached = seq_len - query_len
        upto = seq_len if write_new else cached
        k_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:upto]] = k[:upto]
        v_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:upto]] = v[:upto]
        slots += seq_slots[cached:].tolist()
        keys.append(k[cached:])
        values.append(v[cached:])

    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    empty = torch.empty(0, num_kv_heads, head_dim, dtype=dtype)
    dev = torch.device(device)
    return PagedCase(
        query=query.to(dev),
        k_cache=k_cache.to(dev),
        v_cache=v_cache.to(dev),
        block_tables=block_tables.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        key=(torch.cat(keys) if keys else empty).to(dev),
        value=(torch.cat(values) if values else empty).to(dev),
        max_query_len=max(query_lens, default=0),
        scale=head_dim**-0.5,
    )


def dense_attention_float64(case: PagedCase) -> torch.Tensor:
    """Float64 causal attention from K/V gathered position by position through the
    block tables (GQA by repeating KV heads), independent of the references.

    Returns ``[num_tokens, num_heads, head_dim]`` float64.
    """
    query = case.query.double()
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = case.k_cache.shape[1], case.k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64, device=query.device)
    starts = case.query_start_loc.tolist()
    for i, seq_len in enumerate(case.seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        pos = torch.arange(seq_len, device=query.device)
        blocks = case.block_tables[i].long()[pos // block_size]
        k = case.k_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)  # [seq_len, H, D]
        v = case.v_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)  # [seq_len, H, D]
        q = query[start:end]  # [query_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        q_pos = seq_len - query_len + torch.arange(query_len, device=query.device)
        scores[:, pos[None, :] > q_pos[:, None]] = float("-inf")
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out[start:end] = torch.einsum("hqk,khd->qhd", weights, v)
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if ``out`` holds any NaN)."""
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300))


def fp8_case(case: PagedCase, k_scale: float, v_scale: float) -> tuple[PagedCase, PagedCase]:
    """``case`` with its caches stored in fp8 (x / scale, saturated, as the engine writes
    them; NaN slots stay NaN), and its float twin holding exactly what the fp8 cache reads
    back as (stored x scale, in the case's dtype), for the float64 oracle."""
    from dataclasses import replace

    fp8, dtype = torch.float8_e4m3fn, case.k_cache.dtype
    max_fp8 = torch.finfo(fp8).max

    def store(cache: torch.Tensor, scale: float) -> torch.Tensor:
        return (cache.float() / scale).clamp(-max_fp8, max_fp8).to(fp8)

    k8, v8 = store(case.k_cache, k_scale), store(case.v_cache, v_scale)
    twin = replace(case, k_cache=(k8.float() * k_scale).to(dtype), v_cache=(v8.float() * v_scale).to(dtype))
    return replace(case, k_cache=k8, v_cache=v8), twin
