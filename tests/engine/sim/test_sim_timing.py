"""The simulator's timing model and memory plan: hand-computed figures, monotonicity,
the memory/compute regimes, and clear errors for bad descriptions."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.sim.hardware import PRESETS as ACCELERATORS, resolve_accelerator
from kvpilot.engine.sim.shapes import PRESETS as MODELS, ModelShape, resolve_model_shape
from kvpilot.engine.sim.timing import BatchShape, plan_memory, step_cost, step_time

H100 = ACCELERATORS["h100-80gb"]
LLAMA8B = resolve_model_shape("llama-3.1-8b")


def test_llama_8b_parameter_count_and_kv_bytes_are_the_published_ones():
    assert LLAMA8B.num_params == 8_030_261_248  # Llama-3.1-8B's published count
    assert LLAMA8B.weight_bytes == 2 * 8_030_261_248
    assert LLAMA8B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB


def test_one_h100_llama_8b_decode_step_matches_the_hand_computation():
    # Batch 1 at a 1,024-token context, every figure written out from the formulas.
    bw = 3350e9 * 0.85  # effective bytes/s
    flops = 989e12 * 0.70
    layer_params = 4096 * 48 * 128 + 4096 * 4096 + 3 * 4096 * 14336  # q/k/v, o, MLP = 218,103,808
    act = 5 * 4096 + 48 * 128 + 3 * 14336  # 69,632 activations per token per layer
    gemm = max(2 * layer_params / flops, (2 * layer_params + 2 * act) / bw)  # memory-bound
    attn_bytes = 1024 * 2 * 8 * 128 * 2 + (2 * 32 + 2 * 8) * 128 * 2  # K/V read + q/o/new K/V
    attn = max(4 * 32 * 128 * 1024 / (989e12 * 0.45), attn_bytes / bw)
    lm_head = max(2 * 4096 * 128256 / flops, (4096 * 128256 * 2 + 128256 * 4) / bw)
    sampling = 2 * 128256 * 4 / bw
    overhead = 1e-3 + 15e-6
    expected = overhead + 32 * (gemm + attn) + lm_head + sampling
    got = step_time(LLAMA8B, H100, BatchShape.of([(1, 1024)]))
    assert got == pytest.approx(expected, rel=1e-9)
    assert got == pytest.approx(6.335e-3, rel=1e-3)  # ~158 tokens/s for one stream


def test_decode_is_memory_bound_at_small_batch_and_prefill_compute_bound():
    decode = step_cost(LLAMA8B, H100, BatchShape.of([(1, 512)] * 4))
    assert decode.gemm_memory_bound and decode.attention_memory_bound
    prefill = step_cost(LLAMA8B, H100, BatchShape.of([(2048, 2048)]))
    assert not prefill.gemm_memory_bound and not prefill.attention_memory_bound
    # Batching decode is nearly free while memory-bound: 8 streams cost far less than 8 x 1.
    one = step_time(LLAMA8B, H100, BatchShape.of([(1, 1024)]))
    eight = step_time(LLAMA8B, H100, BatchShape.of([(1, 1024)] * 8))
    assert eight < 1.2 * one


def test_prefill_attention_is_quadratic_in_the_chunk():
    a = step_cost(LLAMA8B, H100, BatchShape.of([(4096, 4096)])).attention_s
    b = step_cost(LLAMA8B, H100, BatchShape.of([(8192, 8192)])).attention_s
    assert b / a == pytest.approx(4.0, rel=0.01)


@settings(max_examples=200, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 512), st.integers(0, 8192)), min_size=1, max_size=16),
       which=st.integers(0, 15), more_tokens=st.integers(1, 256), more_context=st.integers(1, 4096))
def test_step_time_is_monotonic_in_tokens_and_context(reqs, which, more_tokens, more_context):
    shape = [(new, start + new) for new, start in reqs]
    i = which % len(shape)
    base = step_time(LLAMA8B, H100, BatchShape.of(shape))
    longer = list(shape)
    longer[i] = (shape[i][0] + more_tokens, shape[i][1] + more_tokens)
    deeper = list(shape)
    deeper[i] = (shape[i][0], shape[i][1] + more_context)
    assert step_time(LLAMA8B, H100, BatchShape.of(longer)) >= base
    assert step_time(LLAMA8B, H100, BatchShape.of(deeper)) >= base
    assert step_time(LLAMA8B, H100, BatchShape.of(shape + [(1, 100)])) >= base


def test_kv_capacity_is_memory_times_utilisation_minus_weights_activations_reserve():
    plan = plan_memory(LLAMA8B, H100, 0.9, 2048, 256)
    budget = int(81559 * 2**20 * 0.9)
    activations = 2048 * (3 * 14336 + 4 * 4096) * 2 + 256 * 128256 * 4
    assert plan.activation_bytes == activations
    assert plan.kv_cache_bytes == budget - LLAMA8B.weight_bytes - activations - 2**30
    tokens = plan.kv_cache_bytes // (16 * LLAMA8B.kv_bytes_per_token) * 16
    assert 440_000 < tokens < 460_000  # vLLM logs ~420-460k tokens for this pair at 0.9


def test_a_model_that_does_not_fit_names_both_numbers():
    with pytest.raises(ValueError, match=r"weights take 131.4 GiB but the h100-80gb has 79.6 GiB"):
        plan_memory(resolve_model_shape("llama-3.1-70b"), H100, 0.9, 2048, 256)
    with pytest.raises(ValueError, match="leaves no KV cache"):
        plan_memory(LLAMA8B, ACCELERATORS["l4"], 0.7, 2048, 256)


def test_unknown_presets_and_bad_configs_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown accelerator 'h1000'.*h100-80gb"):
        resolve_accelerator("h1000")
    with pytest.raises(ValueError, match="simulate_model.*neither a preset"):
        resolve_model_shape("llama-9")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ValueError, match="missing intermediate_size, num_hidden_layers, vocab_size"):
        resolve_model_shape(str(cfg))
    cfg.write_text(json.dumps({**MODELS["llama-3.1-8b"], "num_key_value_heads": 5}))
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        resolve_model_shape(str(tmp_path))
    cfg.write_text(json.dumps({**MODELS["mistral-7b"], "sliding_window": 4096}))
    with pytest.raises(ValueError, match="sliding_window=4096"):
        resolve_model_shape(str(cfg))
    cfg.write_text(json.dumps({**MODELS["mistral-7b"], "sliding_window": 4096, "use_sliding_window": False}))
    assert resolve_model_shape(str(cfg)).num_layers == 32  # Qwen2-style: declared but off
    cfg.write_text(json.dumps({**MODELS["mistral-7b"], "num_local_experts": 8}))
    with pytest.raises(ValueError, match="mixture of experts"):
        resolve_model_shape(str(cfg))
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"name": "x", "memory_bytes": 1, "bandwidth": 1}))
    with pytest.raises(ValueError, match=r"missing accelerator field\(s\) \['flops'\]"):
        resolve_accelerator(str(acc))
    acc.write_text(json.dumps({"name": "x", "memory_bytes": 1, "bandwidth": 1, "flops": 1,
                               "gemm_efficiency": 1.5}))
    with pytest.raises(ValueError, match=r"gemm_efficiency must be in \(0, 1\]"):
        resolve_accelerator(str(acc))
    acc.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_accelerator(str(acc))


def test_calibration_and_overrides_replace_only_their_fields(tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"fitted": {"step_overhead_s": 0.002, "gemm_efficiency": 0.5}}))
    acc = resolve_accelerator("a100-80gb", str(cal), memory_bytes=40 * 2**30, bandwidth=1555e9)
    assert acc.step_overhead_s == 0.002 and acc.gemm_efficiency == 0.5
    assert acc.memory_bytes == 40 * 2**30 and acc.bandwidth == 1555e9
    assert acc.flops == ACCELERATORS["a100-80gb"].flops and "calibrated" in acc.name
    cal.write_text(json.dumps({"fitted": {"memory_bytes": 5}}))
    with pytest.raises(ValueError, match="unknown field"):
        resolve_accelerator("a100-80gb", str(cal))


def test_every_preset_pair_that_fits_has_a_positive_kv_cache():
    for acc in ACCELERATORS.values():
        for name in MODELS:
            shape = resolve_model_shape(name)
            if shape.weight_bytes < 0.85 * acc.memory_bytes:
                assert plan_memory(shape, acc, 0.95, 2048, 64).kv_cache_bytes > 0, (acc.name, name)


def test_config_json_dtype_and_float32_default(tmp_path):
    raw = {**MODELS["qwen2.5-7b"], "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert resolve_model_shape(str(tmp_path)).dtype == "bfloat16"  # served in bf16, as vLLM does
    assert resolve_model_shape(str(tmp_path), "float32").kv_bytes_per_token == 2 * 28 * 4 * 128 * 4
    assert isinstance(resolve_model_shape(str(tmp_path)), ModelShape)
    assert resolve_model_shape("qwen2.5-7b").attention_bias


@given(seqs=st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 30000)), min_size=0, max_size=12),
       tp_size=st.sampled_from([1, 2, 8]), name=st.sampled_from(sorted(ACCELERATORS)))
@settings(max_examples=60, deadline=None)
def test_the_step_timer_gives_step_times_bit_for_bit(seqs, tp_size, name):
    # The simulator's per-step StepTimer hoists step_cost's constants: every float must be
    # the same, or a contest's results would move with an optimisation.
    from kvpilot.engine.sim.hardware import INTERCONNECTS
    from kvpilot.engine.sim.parallel import SINGLE_GPU, TensorParallel
    from kvpilot.engine.sim.timing import StepTimer

    acc = ACCELERATORS[name]
    par = TensorParallel(tp_size, INTERCONNECTS["nvlink4"]) if tp_size > 1 else SINGLE_GPU
    batch = BatchShape.of([(new, new + ctx) for new, ctx in seqs])
    assert StepTimer(LLAMA8B, acc, par)(batch) == step_time(LLAMA8B, acc, batch, par)


@given(steps=st.lists(st.tuples(st.integers(1, 1024), st.integers(1, 2_000_000)), min_size=1, max_size=12),
       tp_size=st.sampled_from([1, 2, 8]), name=st.sampled_from(sorted(ACCELERATORS)))
@settings(max_examples=60, deadline=None)
def test_the_step_timers_decode_steps_are_its_step_times_bit_for_bit(steps, tp_size, name):
    # decode() keeps the context-free terms per batch size (the fast-forward asks it every
    # step of a run): asked in any order, each time must equal the general path's.
    from kvpilot.engine.sim.hardware import INTERCONNECTS
    from kvpilot.engine.sim.parallel import SINGLE_GPU, TensorParallel
    from kvpilot.engine.sim.timing import StepTimer

    par = TensorParallel(tp_size, INTERCONNECTS["nvlink4"]) if tp_size > 1 else SINGLE_GPU
    timer = StepTimer(LLAMA8B, ACCELERATORS[name], par)
    for n, context in steps + steps[::-1]:
        assert timer.decode(n, context) == timer(BatchShape(n, n, n, context, context))


def test_next_tokens_are_the_token_sources_tokens():
    from types import SimpleNamespace

    from kvpilot.engine.config.simulation import OutputLengths
    from kvpilot.engine.sim.tokens import TokenSource

    src = TokenSource(3, 128000, 2, OutputLengths.parse("fixed:4"))
    reqs = [SimpleNamespace(seed=s, output_token_ids=[0] * n,
                            sampling_params=SimpleNamespace(ignore_eos=ie, min_tokens=0))
            for s, n, ie in ((1, 0, True), (2**40 + 7, 5, True), (99, 3, False), (5, 17, False))]
    assert src.next_tokens(reqs)[2] == [2]  # EOS at the fourth token where it is not ignored
    want = [[src.token(r.seed, len(r.output_token_ids), r.sampling_params.ignore_eos)] for r in reqs]
    assert src.next_tokens(reqs) == want
