"""Capacity planning: the KV formula run backwards."""

import pytest

from kvpilot.engine.config.quantity import format_bytes, parse_bytes
from kvpilot.operator.autotune.capacity import TINY_FLOAT32, ModelShape, kv_cache_bytes, plan_capacity

MiB, GiB = 2**20, 2**30


def test_tiny_model_is_4_kib_per_token_in_float32():
    # 2 (K and V) x 4 layers x 4 KV heads x head dim 32 x 4 bytes
    assert TINY_FLOAT32.kv_bytes_per_token == 4096


def test_64_mib_at_p99_512_holds_32_sequences():
    plan = plan_capacity(TINY_FLOAT32, seq_len=512, max_num_seqs=64, kv_cache_memory="64Mi")
    assert plan.kv_cache_bytes == 64 * MiB
    assert plan.bytes_per_sequence == 512 * 4096 == 2 * MiB
    assert plan.max_concurrent_seqs == 32
    assert plan.bound == "HardwareBound"
    assert "32 sequences" in plan.summary and "hardware-bound" in plan.summary


def test_tuning_bound_when_the_cache_holds_more_than_max_num_seqs():
    plan = plan_capacity(TINY_FLOAT32, seq_len=512, max_num_seqs=8, kv_cache_memory=64 * MiB)
    assert plan.max_concurrent_seqs == 32
    assert plan.bound == "TuningBound"
    assert "tuning-bound" in plan.summary


def test_equal_counts_are_hardware_bound():
    plan = plan_capacity(TINY_FLOAT32, seq_len=512, max_num_seqs=32, kv_cache_memory="64Mi")
    assert plan.bound == "HardwareBound"


@pytest.mark.parametrize("seq_len,tokens,fits", [(500, 512, 32), (512, 512, 32), (513, 528, 31), (1, 16, 1024)])
def test_lengths_round_up_to_whole_blocks(seq_len, tokens, fits):
    plan = plan_capacity(TINY_FLOAT32, seq_len=seq_len, max_num_seqs=64, kv_cache_memory="64Mi", block_size=16)
    assert plan.seq_len == tokens
    assert plan.max_concurrent_seqs == fits


def test_gpu_budget_is_memory_times_utilisation_minus_weights_and_reserve():
    shape = ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, weight_bytes=16 * GiB)
    assert shape.kv_bytes_per_token == 128 * 1024  # Llama-3-8B-like: 128 KiB per token
    total = kv_cache_bytes(shape, gpu_memory_bytes=80 * GiB, gpu_memory_utilization=0.9,
                           activation_reserve_bytes=2 * GiB)
    assert total == int(80 * GiB * 0.9) - 18 * GiB
    plan = plan_capacity(shape, seq_len=4096, max_num_seqs=256, gpu_memory_bytes=80 * GiB,
                         gpu_memory_utilization=0.9, activation_reserve_bytes=2 * GiB)
    assert plan.max_concurrent_seqs == total // (4096 * 128 * 1024)
    assert plan.max_concurrent_seqs == 108  # 54 GiB / 512 MiB


def test_weights_larger_than_the_gpu_share_leave_nothing():
    shape = ModelShape(num_layers=2, num_kv_heads=1, head_dim=8, dtype_bytes=2, weight_bytes=10 * GiB)
    plan = plan_capacity(shape, seq_len=128, max_num_seqs=4, gpu_memory_bytes=8 * GiB, gpu_memory_utilization=0.9)
    assert plan.kv_cache_bytes == 0
    assert plan.max_concurrent_seqs == 0
    assert "not even one sequence" in plan.summary


def test_needs_a_memory_source_and_a_positive_length():
    with pytest.raises(ValueError):
        kv_cache_bytes(TINY_FLOAT32)
    with pytest.raises(ValueError):
        plan_capacity(TINY_FLOAT32, seq_len=0, max_num_seqs=1, kv_cache_memory="1Mi")


def test_from_hf_config_matches_the_tiny_defaults():
    cfg = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4}
    assert ModelShape.from_hf_config(cfg, "float32") == TINY_FLOAT32
    half = ModelShape.from_hf_config(dict(cfg, head_dim=64), "bfloat16")
    assert (half.head_dim, half.dtype_bytes) == (64, 2)


@pytest.mark.parametrize("text,n", [("64Mi", 64 * MiB), ("1G", 10**9), ("1.5Gi", int(1.5 * GiB)),
                                    ("1073741824", GiB), (4096, 4096), ("2k", 2000)])
def test_quantities_parse_with_the_engines_parser(text, n):
    assert parse_bytes("kv_cache_memory", text) == n
    assert kv_cache_bytes(None, kv_cache_memory=text) == n


def test_plan_from_the_pods_own_gauges_needs_no_model_shape():
    """kvpilot:kv_cache_bytes and kvpilot:kv_cache_bytes_per_token size any model."""
    plan = plan_capacity(seq_len=160, max_num_seqs=64, kv_cache_memory=2 * MiB, bytes_per_token=4096)
    assert (plan.bytes_per_token, plan.seq_len, plan.max_concurrent_seqs) == (4096, 160, 3)
    assert plan.bound == "HardwareBound"
    with pytest.raises(ValueError):
        plan_capacity(seq_len=160, max_num_seqs=4, kv_cache_memory=2 * MiB)


def test_status_keys_are_camel_case():
    d = plan_capacity(TINY_FLOAT32, seq_len=512, max_num_seqs=64, kv_cache_memory="64Mi").to_status()
    assert d["maxConcurrentSeqs"] == 32 and d["bytesPerToken"] == 4096 and d["bound"] == "HardwareBound"
    assert format_bytes(64 * MiB) == "64.0 MiB"
