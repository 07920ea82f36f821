"""Paged decode attention: Triton kernel (interpreted) vs torch reference vs float64 dense.

Dtypes under the interpreter: fp32 and fp16 run the GPU code path as is; bf16 runs
it with tl.dot operands upcast to fp32 (the interpreter cannot multiply bf16), with
the softmax probabilities still rounded to bf16 as on the GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvpilot.kernels import paged_decode_attention as decode_module  # noqa: E402
from kvpilot.kernels._common import KERNEL_RTOL, REFERENCE_RTOL  # noqa: E402
from kvpilot.kernels.paged_decode_attention import (  # noqa: E402
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from kvpilot.kernels.testing import dense_attention_float64, make_paged_case, rel_error  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits)
CASES = {
    "one-seq-len1": ([1], 4, 4, 32, 16, F32, None),
    "bs-1/bs/bs+1-gqa4": ([15, 16, 17], 8, 2, 64, 16, F16, None),
    "long-gqa8-hd128-split4": ([300], 8, 1, 128, 16, BF16, 4),
    "many-bs32-hd80-split3": ([1, 31, 32, 33, 200, 7, 64, 5], 4, 1, 80, 32, F32, 3),
    "bs8-hd96-gqa1": ([7, 8, 9, 100], 2, 2, 96, 8, F16, None),
    "hd256-gqa4-bf16-split2": ([17, 250], 4, 1, 256, 16, BF16, 2),
    "tiny-model-shape": ([1, 5, 16, 33], 8, 4, 32, 16, F32, None),
    "more-splits-than-tiles": ([3, 40, 130], 4, 4, 64, 16, F32, 8),
    "mqa-gqa8-bs32-fp16-split2": ([33, 400], 8, 1, 64, 32, F16, 2),
    "bf16-gqa1-hd64": ([16, 17, 90], 2, 2, 64, 16, BF16, None),
}


@pytest.fixture
def nan_empty(monkeypatch):
    """Make torch.empty/empty_like return NaN-filled float tensors, so a wrapper's
    scratch buffers (split partials) are poisoned too."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


@pytest.mark.parametrize("name", list(CASES))
def test_decode_kernel_matches_reference_and_dense(name, nan_empty):
    seq_lens, heads, kv_heads, head_dim, block_size, dtype, num_splits = CASES[name]
    case = make_paged_case(
        seq_lens, [1] * len(seq_lens), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, seed=len(name),
    )
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    out = torch.full_like(case.query, float("nan"))
    result = paged_decode_attention(*args, num_splits, out=out)
    assert result is out
    ref = paged_decode_attention_reference(*args, num_splits)
    dense = dense_attention_float64(case)

    assert not out.isnan().any()
    assert rel_error(out, ref) <= KERNEL_RTOL[dtype]
    assert rel_error(ref, dense) <= REFERENCE_RTOL[dtype]


def test_decode_allocates_output_and_takes_strided_query():
    """A query sliced out of a fused qkv tensor (non-contiguous rows) and no out=."""
    case = make_paged_case([16, 17], [1, 1], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    qkv = torch.randn(2, 8, 32)
    qkv[:, :4] = case.query
    query = qkv[:, :4]  # [num_seqs, num_heads, head_dim], stride(0) = 8 * 32
    out = paged_decode_attention(query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert rel_error(out, dense_attention_float64(case)) <= KERNEL_RTOL[torch.float32] + REFERENCE_RTOL[torch.float32]


def test_split_and_unsplit_agree():
    case = make_paged_case([333, 65], [1, 1], num_heads=4, num_kv_heads=1, head_dim=32, block_size=16, seed=3)
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    one = paged_decode_attention(*args, 1)
    five = paged_decode_attention(*args, 5)
    assert rel_error(five, one) <= 1e-5


def test_rejects_mismatched_shapes():
    case = make_paged_case([4], [1], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    with pytest.raises(ValueError):
        paged_decode_attention(case.query[:, :3], case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0)
    with pytest.raises(ValueError):
        paged_decode_attention(case.query.half(), case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0)


@pytest.mark.parametrize(
    ("num_seqs", "kv_heads", "max_context", "sms", "expected"),
    [
        (1, 8, 8192, 132, 32),  # one long request: fill the device
        (1, 8, 512, 132, 2),  # short context: at most 256 tokens a split
        (16, 8, 8192, 132, 3),  # 128 programs -> 3 splits reach 2 per SM
        (64, 8, 8192, 132, 1),  # 512 programs already fill 132 SMs
        (256, 8, 2048, 132, 1),
        (4, 8, 256, 132, 1),  # never split a context that fits in one slice
        (1, 1, 1 << 20, 132, 64),  # capped at MAX_SPLITS
        (2, 4, 4096, 1, 1),  # CPU/interpreter: one "SM", no split
        (0, 8, 4096, 132, 1),
    ],
)
def test_choose_num_splits(num_seqs, kv_heads, max_context, sms, expected):
    assert choose_num_splits(num_seqs, kv_heads, max_context, sms) == expected


def test_choose_num_splits_is_monotone_in_batch():
    splits = [choose_num_splits(b, 8, 8192, 132) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert splits == sorted(splits, reverse=True)
    assert all(1 <= s <= decode_module.MAX_SPLITS for s in splits)
