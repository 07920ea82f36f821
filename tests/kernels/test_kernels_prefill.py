"""Paged prefill/extend attention: Triton kernel (interpreted) vs torch reference vs
float64 dense, on ragged batches mixing decode rows, fresh prompts and chunks whose
cached prefix ends mid-block.

Dtypes under the interpreter: fp32 and fp16 run the GPU code path as is; bf16 runs
it with tl.dot operands upcast to fp32 (the interpreter cannot multiply bf16).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvpilot.kernels._common import KERNEL_RTOL, REFERENCE_RTOL  # noqa: E402
from kvpilot.kernels.paged_prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from kvpilot.kernels.testing import dense_attention_float64, make_paged_case, rel_error  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
CASES = {
    "one-prompt-len1": ([1], [1], 4, 4, 32, 16, F32),
    "fresh-prompts-bs-1/bs/bs+1": ([15, 16, 17], [15, 16, 17], 8, 2, 32, 16, F16),
    "prefix-mid-block-gqa8": ([37], [10], 8, 1, 64, 16, F32),
    "ragged-mix-bs32-hd80": ([1, 40, 33, 70, 5], [1, 1, 33, 29, 5], 4, 1, 80, 32, BF16),
    "bs8-hd96-gqa1-chunks": ([9, 30, 8], [2, 13, 8], 2, 2, 96, 8, F16),
    "long-prompt-few-heads": ([300], [300], 2, 1, 32, 16, F32),
    "long-prefix-short-chunk-hd128": ([350, 17], [20, 17], 4, 1, 128, 16, BF16),
    "hd256-decodes-and-chunk": ([100, 1, 18], [1, 1, 18], 4, 4, 256, 32, F32),
    "tiny-model-shape-chunked": ([48, 23], [16, 23], 8, 4, 32, 16, F32),
    "gqa5-non-power-of-two-group": ([21, 3], [21, 2], 10, 2, 64, 16, F16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_kernel_matches_reference_and_dense(name):
    seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype = CASES[name]
    case = make_paged_case(
        seq_lens, query_lens, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, seed=len(name),
    )
    args = (
        case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
        case.query_start_loc, case.max_query_len, case.scale,
    )
    out = torch.full_like(case.query, float("nan"))
    assert paged_prefill_attention(*args, out=out) is out
    ref = paged_prefill_attention_reference(*args)
    dense = dense_attention_float64(case)

    assert not out.isnan().any()
    assert rel_error(out, ref) <= KERNEL_RTOL[dtype]
    assert rel_error(ref, dense) <= REFERENCE_RTOL[dtype]


def test_decode_batch_through_prefill_kernel_matches_decode_reference():
    """The engine may send decode-only steps to either kernel; they must agree."""
    from kvpilot.kernels.paged_decode_attention import paged_decode_attention_reference

    case = make_paged_case([16, 17, 50], [1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    out = paged_prefill_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
        case.query_start_loc, 1, case.scale,
    )
    ref = paged_decode_attention_reference(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale
    )
    assert rel_error(out, ref) <= KERNEL_RTOL[torch.float32]


def test_prefill_takes_strided_query_from_fused_qkv():
    case = make_paged_case([20, 9], [12, 9], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=5)
    qkv = torch.randn(case.query.shape[0], 8, 32)
    qkv[:, :4] = case.query
    query = qkv[:, :4]  # [num_tokens, num_heads, head_dim], non-contiguous rows
    out = paged_prefill_attention(
        query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
        case.query_start_loc, case.max_query_len, case.scale,
    )
    assert rel_error(out, dense_attention_float64(case)) <= 2e-5


def test_rejects_bad_query_start_loc():
    case = make_paged_case([4], [4], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    with pytest.raises(ValueError):
        paged_prefill_attention(
            case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
            case.query_start_loc[:1], 4, 1.0,
        )
