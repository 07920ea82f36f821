"""The torch backend's planned attention equals the reference paged attention on mixed
steps: decode rows in length groups, fresh prompts, and chunks over a cached prefix."""

import random

import pytest
import torch

from kvpilot.engine.attention.layer import PagedAttention, write_kv_cache_torch
from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.attention.cpu import MAX_DECODE_GROUPS, plan_torch_attention, split_sorted
from kvpilot.engine.attention.cpu_decode_kernel import load_decode_kernel
from kvpilot.kernels._reference import paged_attention_torch


@pytest.fixture(scope="module")
def decode_kernel():
    kernel = load_decode_kernel()
    if kernel is None:  # make test's machines have cc; the image has none
        pytest.skip("no C compiler here: the decode kernel cannot be built")
    return kernel

BLOCK, KV_HEADS, HEADS, HEAD_DIM = 8, 2, 8, 16


def _step(rng: random.Random, num_decode: int, num_fresh: int, num_chunked: int):
    """(seq_lens, query_lens) of a shuffled mixed step."""
    rows = ([(rng.randint(1, 90), 1) for _ in range(num_decode)]
            + [(q, q) for q in (rng.randint(2, 40) for _ in range(num_fresh))]
            + [(c + q, q) for c, q in ((rng.randint(1, 50), rng.randint(2, 30))
                                       for _ in range(num_chunked))])
    rng.shuffle(rows)
    return [s for s, _ in rows], [q for _, q in rows]


@pytest.mark.parametrize("kernel", ["sdpa", "c"])
@pytest.mark.parametrize("seed,num_decode,num_fresh,num_chunked", [
    (0, 40, 0, 0), (1, 17, 2, 1), (2, 0, 3, 2), (3, 1, 0, 0), (4, 64, 1, 3), (5, 9, 0, 1)])
def test_planned_attention_equals_the_reference(seed, num_decode, num_fresh, num_chunked, kernel,
                                                request):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seq_lens, query_lens = _step(rng, num_decode, num_fresh, num_chunked)
    widths = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(widths) + 3
    perm = torch.randperm(num_blocks).tolist()  # blocks scattered through the cache
    tables = torch.zeros(len(seq_lens), max(widths), dtype=torch.int32)
    for i, w in enumerate(widths):
        tables[i, :w] = torch.tensor([perm.pop() for _ in range(w)])
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, HEADS, HEAD_DIM)
    key = torch.randn(num_tokens, KV_HEADS, HEAD_DIM)
    value = torch.randn(num_tokens, KV_HEADS, HEAD_DIM)
    slots = []
    for i, (s, q) in enumerate(zip(seq_lens, query_lens)):
        slots += [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(s - q, s)]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        seq_lens_cpu=seq_lens, query_lens_cpu=query_lens,
        torch_plan=plan_torch_attention(tables, seq_lens, query_lens, BLOCK, torch.device("cpu"),
                                        decode_kernel=kernel == "c"))
    attention = PagedAttention("torch")
    if kernel == "c":
        attention.use_decode_kernel(request.getfixturevalue("decode_kernel"))
        assert (meta.torch_plan.decode_rows is not None) == (num_decode > 0)
    elif num_decode >= 2 * 8:
        assert len(meta.torch_plan.decode) > 1
    ours = attention(query, key, value, k_cache, v_cache, meta, 0.25)
    # The reference reads the cache after the same write.
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_torch(key, value, ref_k, ref_v, meta.slot_mapping)
    ref = paged_attention_torch(query, ref_k, ref_v, tables, seq_lens, starts, 0.25)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    # The workspace is reused: a second layer's call gives the same answer.
    torch.testing.assert_close(attention(query, key, value, k_cache, v_cache, meta, 0.25), ours)


def test_split_sorted_groups_rows_by_length():
    lengths = [50, 3, 800, 7, 400, 9] * 8
    groups = split_sorted(lengths)
    assert len(groups) == min(MAX_DECODE_GROUPS, len(lengths) // 8)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(lengths)
    assert split_sorted([5, 1]) == [[1, 0]]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block", [
    (8, 8, 32, 16), (8, 2, 64, 16), (16, 2, 128, 32), (4, 1, 256, 8), (6, 3, 80, 64)])
def test_decode_kernel_equals_the_reference(decode_kernel, heads, kv_heads, head_dim, block):
    """Ragged lengths (1 token, block edges, long), shuffled blocks, GQA 1..8, and NaN in
    the cache past each sequence's end (never read)."""
    torch.manual_seed(heads * head_dim + block)
    seq_lens = [1, block, block + 1, 3 * block - 1, 200, 37]
    widths = [-(-s // block) for s in seq_lens]
    num_blocks = sum(widths) + 2
    k_cache = torch.full((num_blocks, block, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(seq_lens), max(widths) + 1, dtype=torch.int32)
    for i, (s, w) in enumerate(zip(seq_lens, widths)):
        ids = [perm.pop() for _ in range(w)]
        tables[i, :w] = torch.tensor(ids)
        flat = torch.tensor([b * block + p for b in ids for p in range(block)][:s])
        k_cache.view(-1, kv_heads, head_dim)[flat] = torch.randn(s, kv_heads, head_dim)
        v_cache.view(-1, kv_heads, head_dim)[flat] = torch.randn(s, kv_heads, head_dim)
    query = torch.randn(len(seq_lens), heads, head_dim)
    ours = decode_kernel(query, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
                         head_dim**-0.5)
    ref = paged_attention_torch(query, k_cache, v_cache, tables, seq_lens,
                                list(range(len(seq_lens) + 1)), head_dim**-0.5)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_the_gather_workspace_stays_bounded_when_cache_layouts_alternate():
    """A target and a draft model with different KV layouts sharing one workspace: each
    switch allocates what the step needs, never double the last (which, switching every
    step, grew to terabytes within a few dozen steps)."""
    from kvpilot.engine.attention.cpu import TorchPagedAttention

    attn = TorchPagedAttention()
    caches = [torch.randn(64, 16, 2, 8), torch.randn(64, 16, 1, 8)]  # [blocks, block_size, kv_heads, head_dim]
    blocks = torch.arange(6)
    for step in range(100):
        cache = caches[step % 2]
        k, v = attn._gather(cache, cache, blocks)
        assert torch.equal(k, cache[:6])
        assert attn._k_work.shape[0] <= 12, attn._k_work.shape
