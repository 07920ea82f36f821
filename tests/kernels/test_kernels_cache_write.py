"""KV-cache write: the Triton kernel (interpreted) scatters exactly what the torch
reference scatters, and nothing else, in every dtype the engine uses."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvpilot.kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference  # noqa: E402
from kvpilot.kernels.testing import make_paged_case  # noqa: E402

# (seq_lens, query_lens, num_kv_heads, head_dim, block_size, dtype)
CASES = {
    "one-token": ([1], [1], 1, 32, 16, torch.float32),
    "decode-batch-bs-1/bs/bs+1": ([15, 16, 17, 300], [1, 1, 1, 1], 4, 64, 16, torch.float16),
    "prefill-mid-block-hd80-bs32": ([37, 70], [10, 70], 2, 80, 32, torch.bfloat16),
    "chunks-hd96-bs8": ([9, 30, 8], [2, 13, 8], 8, 96, 8, torch.float32),
    "long-hd256": ([260], [200], 1, 256, 16, torch.bfloat16),
    "hd128-mixed": ([5, 129], [5, 64], 8, 128, 16, torch.float16),
}


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", list(CASES))
def test_write_matches_reference_and_touches_only_its_slots(name):
    seq_lens, query_lens, kv_heads, head_dim, block_size, dtype = CASES[name]
    # The cache holds each request's prefix; the query tokens' own slots are NaN.
    case = make_paged_case(
        seq_lens, query_lens, num_heads=kv_heads, num_kv_heads=kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, seed=len(name), write_new=False,
    )
    full = make_paged_case(
        seq_lens, query_lens, num_heads=kv_heads, num_kv_heads=kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, seed=len(name), write_new=True,
    )
    k_kernel, v_kernel = case.k_cache.clone(), case.v_cache.clone()
    write_kv_cache(case.key, case.value, k_kernel, v_kernel, case.slot_mapping)
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    write_kv_cache_reference(case.key, case.value, k_ref, v_ref, case.slot_mapping)

    _assert_same_bits(k_kernel, k_ref)
    _assert_same_bits(v_kernel, v_ref)
    # ... and both equal the cache built directly with every token in place
    # (unused slots still NaN, so a stray write would show).
    _assert_same_bits(k_ref, full.k_cache)
    _assert_same_bits(v_ref, full.v_cache)


def test_write_takes_strided_key_value_from_fused_qkv():
    """The engine's key/value are views into one fused qkv projection."""
    num_tokens, heads, kv_heads, head_dim = 5, 4, 2, 32
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim)
    key, value = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    slots = torch.tensor([3, 17, 18, 40, 0], dtype=torch.int64)
    k_cache = torch.full((3, 16, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    write_kv_cache(key, value, k_cache, v_cache, slots)
    k_ref, v_ref = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    write_kv_cache_reference(key, value, k_ref, v_ref, slots)
    _assert_same_bits(k_cache, k_ref)
    _assert_same_bits(v_cache, v_ref)


def test_write_with_no_tokens_is_a_no_op():
    k_cache = torch.zeros(2, 16, 1, 32)
    v_cache = torch.zeros_like(k_cache)
    empty = torch.empty(0, 1, 32)
    write_kv_cache(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64))
    assert k_cache.abs().sum() == 0 and v_cache.abs().sum() == 0


def test_write_rejects_mismatched_cache():
    key = torch.randn(2, 2, 32)
    cache = torch.zeros(2, 16, 2, 64)
    with pytest.raises(ValueError):
        write_kv_cache(key, key, cache, cache.clone(), torch.tensor([0, 1]))
