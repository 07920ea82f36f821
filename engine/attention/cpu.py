"""Paged attention in plain torch (the CPU path): planned once per step, run per layer.

Decode rows (one query token each) go to the C kernel (cpu_decode_kernel.py) where it
is built and the cache is float32: it reads the paged cache in place. Otherwise they
are sorted by length and split into a few groups; each group gathers its blocks with
one `index_select` into a persistent workspace and runs one masked SDPA, the query
heads of a KV head folded into its query rows (K/V read once per KV head: half the time
of SDPA's `enable_gqa` at 4 heads per group). Padding every row to the batch's longest
sequence, and a fresh allocation for the gathered K/V in every layer, had cost more
than the attention itself (2-core host, 64 rows of 50..800 tokens: 19 ms padded, 7 ms
grouped).

Prefill rows (a request's query_len > 1 new tokens) run one SDPA per request: on the
step's own K/V when nothing was cached before (a fresh prompt needs no gather), on its
gathered blocks with a causal offset otherwise (a later chunk or a prefix-cache hit).

An fp8 cache (--kv-cache-dtype fp8) is gathered in fp8, then upcast to the query's dtype
and scaled by the layer's k_scale / v_scale; a fresh prompt's own K/V stay unquantized
(read from the step, not the cache), as vLLM's prefill over a step's own tokens does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cpu_decode_kernel import DecodeKernel
from kvpilot.kernels.kv_cache_dtype import dequantize_fp8, is_fp8

MAX_DECODE_GROUPS = 4
MIN_ROWS_PER_GROUP = 8


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [n] int64: the group's query rows
    blocks: torch.Tensor  # [n * num_blocks] int64: each row's first num_blocks block ids
    num_blocks: int
    mask: torch.Tensor | None  # [n, 1, 1, num_blocks * block_size] bool; None if no padding


@dataclass
class PrefillItem:
    start: int  # first query row
    query_len: int
    seq_len: int
    blocks: torch.Tensor | None  # [ceil(seq_len / block_size)] int64; None: no cached prefix
    mask: torch.Tensor | None  # [query_len, seq_len] bool, with blocks


@dataclass
class KernelDecodeRows:
    """Every decode row of the step, for the C kernel (cpu_decode_kernel.py)."""

    rows: torch.Tensor  # [n] int64: query rows
    block_tables: torch.Tensor  # [n, width] int32
    seq_lens: torch.Tensor  # [n] int32


@dataclass
class TorchAttentionPlan:
    decode: list[DecodeGroup]  # SDPA's length groups (empty when the kernel runs decode)
    prefill: list[PrefillItem]
    decode_rows: KernelDecodeRows | None = None  # with the kernel


def split_sorted(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` in ascending order of length, cut into at most
    MAX_DECODE_GROUPS groups of equal count (at least MIN_ROWS_PER_GROUP each)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups = max(1, min(MAX_DECODE_GROUPS, len(order) // MIN_ROWS_PER_GROUP))
    return [order[g * len(order) // groups:(g + 1) * len(order) // groups] for g in range(groups)]


def plan_torch_attention(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, on the host
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device,
    decode_kernel: bool = False,
) -> TorchAttentionPlan:
    """Everything the layers share about one step's attention, computed once: decode rows
    for the C kernel (`decode_kernel`) or in SDPA length groups."""
    starts, decode_idx, prefill = [], [], []
    row = 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        starts.append(row)
        if q_len == 1:
            decode_idx.append(i)
        else:
            blocks = mask = None
            if seq_len > q_len:
                blocks = block_tables[i, :-(-seq_len // block_size)].long().to(device)
                # Query row j sits at position seq_len - q_len + j and sees keys up to it.
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            prefill.append(PrefillItem(row, q_len, seq_len, blocks, mask))
        row += q_len
    if decode_kernel and decode_idx:
        seqs = torch.tensor(decode_idx)
        width = -(-max(seq_lens[i] for i in decode_idx) // block_size)
        rows = KernelDecodeRows(torch.tensor([starts[i] for i in decode_idx], device=device),
                          block_tables[seqs, :width].to(device),
                          torch.tensor([seq_lens[i] for i in decode_idx], dtype=torch.int32,
                                       device=device))
        return TorchAttentionPlan([], prefill, rows)
    groups = []
    for members in split_sorted([seq_lens[i] for i in decode_idx]) if decode_idx else []:
        seqs = [decode_idx[m] for m in members]
        lens = torch.tensor([seq_lens[i] for i in seqs])  # [n]
        longest = int(lens.max())
        num_blocks = -(-longest // block_size)
        mask = None
        if int(lens.min()) < num_blocks * block_size:
            positions = torch.arange(num_blocks * block_size)
            mask = (positions[None, :] < lens[:, None])[:, None, None, :].to(device)
        groups.append(DecodeGroup(
            rows=torch.tensor([starts[i] for i in seqs], device=device),
            blocks=block_tables[torch.tensor(seqs), :num_blocks].flatten().long().to(device),
            num_blocks=num_blocks, mask=mask))
    return TorchAttentionPlan(groups, prefill)


class TorchPagedAttention:
    """Runs a plan against one layer's cache; the gather workspace is reused by every
    layer and step, grown when a step needs more."""

    def __init__(self, decode_kernel: DecodeKernel | None = None) -> None:
        self.decode_kernel = decode_kernel
        self._k_work = torch.empty(0)  # [capacity_blocks, block_size, num_kv_heads, head_dim]
        self._v_work = torch.empty(0)

    def _read(self, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
              dtype: torch.dtype, k_scale: float, v_scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:  # each [len(blocks), block_size, kv_heads, head_dim]
        """The blocks' K/V in `dtype`; an fp8 cache's gathered bytes upcast and scaled."""
        if not is_fp8(k_cache):
            return self._gather(k_cache, v_cache, blocks)
        # Gathered as bytes (index_select has no float8 kernel on the CPU), a quarter of
        # float32's bytes moved, then upcast and scaled.
        k, v = self._gather(k_cache.view(torch.uint8), v_cache.view(torch.uint8), blocks)
        return dequantize_fp8(k.view(k_cache.dtype), k_scale, dtype), dequantize_fp8(v.view(v_cache.dtype), v_scale, dtype)

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:  # each [len(blocks), block_size, kv_heads, head_dim]
        n = blocks.numel()
        same_layout = self._k_work.shape[1:] == k_cache.shape[1:] and self._k_work.dtype == k_cache.dtype
        if not same_layout or self._k_work.shape[0] < n:
            # Doubling amortises growth; a new layout starts afresh (doubling across layouts
            # alternating step by step would grow without bound).
            shape = (max(n, 2 * self._k_work.shape[0]) if same_layout else n, *k_cache.shape[1:])
            self._k_work = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
            self._v_work = torch.empty_like(self._k_work)
        return (torch.index_select(k_cache, 0, blocks, out=self._k_work[:n]),
                torch.index_select(v_cache, 0, blocks, out=self._v_work[:n]))

    def __call__(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (this step's, already cached)
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        plan: TorchAttentionPlan,
        scale: float,
        k_scale: float = 1.0,  # an fp8 cache's scales (see kv_cache_dtype.py)
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        out = torch.empty_like(query)
        num_heads = query.shape[1]
        kv_heads, head_dim = k_cache.shape[2:]
        if plan.decode_rows is not None:
            d = plan.decode_rows
            if self.decode_kernel is None:
                raise RuntimeError("a plan for the decode kernel, but no kernel is loaded")
            out[d.rows] = self.decode_kernel(query[d.rows], k_cache, v_cache, d.block_tables,
                                             d.seq_lens, scale)
        for g in plan.decode:
            k, v = self._read(k_cache, v_cache, g.blocks, query.dtype, k_scale, v_scale)
            n = g.rows.numel()
            k = k.view(n, -1, kv_heads, head_dim).transpose(1, 2)  # [n, kv_heads, L, head_dim]
            v = v.view(n, -1, kv_heads, head_dim).transpose(1, 2)
            # The query heads sharing a KV head go in as that head's query rows, so each
            # K/V row is read once per KV head rather than once per query head.
            q = query[g.rows].view(n, kv_heads, num_heads // kv_heads, head_dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
            out[g.rows] = o.reshape(n, num_heads, head_dim)  # o [n, kv_heads, group, head_dim]
        for p in plan.prefill:
            rows = slice(p.start, p.start + p.query_len)
            q = query[rows].transpose(0, 1)  # [num_heads, q_len, head_dim]
            if p.blocks is None:  # the whole sequence is this step's: plain causal
                o = F.scaled_dot_product_attention(
                    q, key[rows].transpose(0, 1), value[rows].transpose(0, 1),
                    is_causal=True, scale=scale, enable_gqa=True)
            else:
                k, v = self._read(k_cache, v_cache, p.blocks, query.dtype, k_scale, v_scale)
                k = k.flatten(0, 1)[:p.seq_len].transpose(0, 1)  # [kv_heads, seq_len, head_dim]
                v = v.flatten(0, 1)[:p.seq_len].transpose(0, 1)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, scale=scale,
                                                   enable_gqa=True)
            out[rows] = o.transpose(0, 1)  # [q_len, num_heads, head_dim]
        return out
