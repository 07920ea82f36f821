"""An fp8 KV cache (--kv-cache-dtype fp8) in the Triton kernels, interpreted: the attention
kernels upcast e4m3 on load and multiply by the layer's scale; the write kernel scatters
the bytes the torch codec quantized.

Tolerances: the attention kernels against their torch reference reading the same fp8 cache,
within the query dtype's KERNEL_RTOL; the reference against float64 dense attention over
the dequantized twin, within REFERENCE_RTOL; the write bit for bit."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvpilot.kernels.kv_cache_dtype import FP8, quantize_fp8  # noqa: E402
from kvpilot.kernels._common import KERNEL_RTOL, REFERENCE_RTOL  # noqa: E402
from kvpilot.kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference  # noqa: E402
from kvpilot.kernels.paged_decode_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_reference,
)
from kvpilot.kernels.paged_prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from kvpilot.kernels.testing import dense_attention_float64, fp8_case, make_paged_case, rel_error  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@triton.jit
def _upcast_kernel(src_ptr, dst_ptr, scale, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs).to(tl.float32) * scale)


def test_the_interpreter_upcasts_every_finite_e4m3_value_as_torch_does():
    """What the attention kernels rely on (the interpreter's float32 -> e4m3 cast is the
    one that is wrong, see kv_cache_write.py; the other direction is exact). The two NaN
    codes (0x7f, 0xff) read as +-480 in Triton 3.9's interpreter, as if e4m3 had no NaN;
    the engine never stores them (its writes saturate at +-448), so only a NaN K/V, already
    a broken model, could meet that difference."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)  # every bit pattern
    out = torch.empty(256, dtype=torch.float32)
    _upcast_kernel[(1,)](codes, out, 0.75, N=256)
    expected = codes.float() * 0.75
    finite = expected.isfinite()
    assert int(finite.sum()) == 254
    torch.testing.assert_close(out[finite], expected[finite], rtol=0, atol=0)
    assert out[~finite].tolist() == [480.0 * 0.75, -480.0 * 0.75]  # the interpreter's reading


# (seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits, k_scale, v_scale)
DECODE = {
    "f32-gqa2": ([1, 15, 16, 17], 8, 4, 32, 16, F32, None, 1.0, 1.0),
    "f16-split3-scales": ([40, 200], 4, 1, 64, 16, F16, 3, 0.37, 1.9),
    "bf16-hd80-bs32": ([33, 70], 4, 2, 80, 32, BF16, None, 0.05, 0.02),
}


@pytest.mark.parametrize("name", list(DECODE))
def test_decode_over_an_fp8_cache_matches_the_reference(name):
    seq_lens, heads, kv_heads, head_dim, block_size, dtype, splits, k_scale, v_scale = DECODE[name]
    base = make_paged_case(seq_lens, [1] * len(seq_lens), num_heads=heads, num_kv_heads=kv_heads,
                           head_dim=head_dim, block_size=block_size, dtype=dtype, seed=len(name))
    case, twin = fp8_case(base, k_scale, v_scale)
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    out = paged_decode_attention(*args, splits, k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_attention_reference(*args, splits, k_scale=k_scale, v_scale=v_scale)
    assert not out.isnan().any()
    assert rel_error(out, ref) <= KERNEL_RTOL[dtype]
    assert rel_error(ref, dense_attention_float64(twin)) <= REFERENCE_RTOL[dtype]
    # The scales are applied: reading the same bytes at scale 1 gives another answer.
    if (k_scale, v_scale) != (1.0, 1.0):
        assert rel_error(paged_decode_attention(*args, splits), ref) > 10 * KERNEL_RTOL[dtype]


# (seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, k_scale, v_scale)
PREFILL = {
    "f32-prefix-mid-block": ([37, 20], [10, 20], 8, 2, 32, 16, F32, 0.5, 0.25),
    "f16-ragged-decodes": ([1, 40, 33], [1, 1, 33], 4, 1, 64, 32, F16, 1.3, 0.7),
    "bf16-chunk-gqa5": ([21, 3], [21, 2], 10, 2, 64, 16, BF16, 1.0, 1.0),
}


@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill_over_an_fp8_cache_matches_the_reference(name):
    seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, k_scale, v_scale = PREFILL[name]
    base = make_paged_case(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           block_size=block_size, dtype=dtype, seed=len(name))
    case, twin = fp8_case(base, k_scale, v_scale)
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc,
            case.max_query_len, case.scale)
    out = paged_prefill_attention(*args, k_scale=k_scale, v_scale=v_scale)
    ref = paged_prefill_attention_reference(*args, k_scale=k_scale, v_scale=v_scale)
    assert not out.isnan().any()
    assert rel_error(out, ref) <= KERNEL_RTOL[dtype]
    assert rel_error(ref, dense_attention_float64(twin)) <= REFERENCE_RTOL[dtype]


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_the_write_stores_the_torch_codecs_bytes_saturated_and_nothing_else(dtype):
    base = make_paged_case([9, 30], [2, 13], num_heads=2, num_kv_heads=2, head_dim=48, block_size=8,
                           dtype=dtype, seed=3, write_new=False)
    case, _ = fp8_case(base, 0.5, 2.0)
    key = case.key.clone()
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 300.0, -0.001], dtype=dtype)  # two saturate at +-448 x 0.5
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    write_kv_cache(key, case.value, k_cache, v_cache, case.slot_mapping, 0.5, 2.0)
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    write_kv_cache_reference(key, case.value, k_ref, v_ref, case.slot_mapping, 0.5, 2.0)
    for got, want in ((k_cache, k_ref), (v_cache, v_ref)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # every byte, NaN slots too
    flat = k_cache.view(torch.uint8).view(-1, *k_cache.shape[2:])[case.slot_mapping]
    assert torch.equal(flat, quantize_fp8(key, 0.5).view(torch.uint8))
    assert flat.view(FP8)[0, 0, :2].float().tolist() == [448.0, -448.0]
