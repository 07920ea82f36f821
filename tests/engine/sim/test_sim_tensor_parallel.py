"""The simulated accelerator over N GPUs (tensor parallelism): each GPU's share of the
weights, KV heads and compute, the all-reduces over the interconnect, the refusals the
real engine makes, and the simulated Llama-3.1-70B on 4 and 8 H100s."""

from __future__ import annotations

import json

import pytest

from kvpilot.engine.cli import build_parser
from kvpilot.engine.core.clock import VirtualClock
from kvpilot.engine.config.engine import EngineConfig
from kvpilot.engine.config.args import engine_config_from_args
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.fleet.fleet import Fleet
from kvpilot.engine.sim.hardware import INTERCONNECTS, PRESETS as ACCELERATORS, resolve_accelerator
from kvpilot.engine.sim.parallel import SINGLE_GPU, TensorParallel, weight_bytes_per_gpu
from kvpilot.engine.fleet.published import POINTS, predict
from kvpilot.engine.fleet.report import print_sim_result, summarize
from kvpilot.engine.sim.shapes import resolve_model_shape
from kvpilot.engine.sim.timing import BatchShape, plan_memory, step_cost, step_time
from kvpilot.engine.fleet.trace import TraceRequest

H100 = ACCELERATORS["h100-80gb"]
LLAMA70B = resolve_model_shape("llama-3.1-70b")
GIB = 2**30


def tp(n: int, link: str = "nvlink4") -> TensorParallel:
    return TensorParallel(n, INTERCONNECTS[link]) if n > 1 else SINGLE_GPU


def sim_config(n: int = 4, **over) -> EngineConfig:
    simulate = {"accelerator": "h100-80gb", "model": "llama-3.1-70b", **over.pop("simulate", {})}
    return EngineConfig(model=None, simulate=simulate, tensor_parallel_size=n, max_model_len=8192,
                        max_num_batched_tokens=2048, max_num_seqs=256, **over)


# --- memory ----------------------------------------------------------------------------

def test_70b_does_not_fit_one_h100_and_the_refusal_names_the_memory_and_the_size_that_fits():
    assert LLAMA70B.num_params == 70_553_706_496  # Llama-3.1-70B's published 70.6B
    with pytest.raises(ValueError, match=r"weights take 131.4 GiB but the h100-80gb has 79.6 GiB: it does not "
                                         r"fit one accelerator; tensor_parallel_size 2 \(--tensor-parallel-size\)"):
        plan_memory(LLAMA70B, H100, 0.9, 2048, 256)
    with pytest.raises(ValueError, match="does not fit one accelerator; tensor_parallel_size 2"):
        LLMEngine(sim_config(1), VirtualClock())


def test_70b_on_4_h100s_splits_weights_and_keeps_four_gpus_of_kv_cache():
    plan = plan_memory(LLAMA70B, H100, 0.9, 2048, 256, tp(4))
    norms = (2 * 80 + 1) * 8192  # RMSNorm weights: whole on every GPU
    assert plan.weight_bytes == ((LLAMA70B.num_params - norms) // 4 + norms) * 2 == 35_278_831_616
    assert plan.weight_bytes == weight_bytes_per_gpu(LLAMA70B, 4)
    budget = int(81559 * 2**20 * 0.9)
    activations = 2048 * (3 * 28672 // 4 + 4 * 8192) * 2 + 256 * 128256 * 4  # MLP columns split 4 ways
    assert (plan.budget_bytes, plan.activation_bytes, plan.num_gpus) == (budget, activations, 4)
    each = budget - plan.weight_bytes - activations - GIB
    assert plan.kv_cache_bytes == 4 * each
    assert 149 * GIB < plan.kv_cache_bytes < 151 * GIB
    assert "on each of 4 GPUs: KV cache 150.0 GiB in all" in plan.describe()


def test_the_engine_counts_the_kv_cache_of_all_its_gpus():
    four, eight = (LLMEngine(sim_config(n), VirtualClock()) for n in (4, 8))
    assert four.kv_bytes_per_token == LLAMA70B.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2  # all KV heads
    plan = four.runner.memory
    assert four.kv_capacity_tokens == plan.kv_cache_bytes // (16 * four.kv_bytes_per_token) * 16
    assert four.kv_cache_bytes == four.kv_capacity_tokens * four.kv_bytes_per_token  # kvpilot:kv_cache_bytes
    assert four.runner.weight_bytes == LLAMA70B.weight_bytes  # kvpilot:model_weight_bytes: the whole model
    # Twice the GPUs: twice the memory, each holding half the weight share, so more than twice the cache.
    assert eight.kv_capacity_tokens > 2 * four.kv_capacity_tokens
    text = four.runner.describe()
    assert text.startswith("SIMULATED 4x h100-80gb") and "tensor_parallel_size 4 over nvlink4" in text


def test_kv_heads_that_do_not_split_evenly_and_pipeline_stages_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide llama-3.1-70b's "
                                         r"num_key_value_heads \(8\).*one of \[1, 2, 4, 8\]"):
        LLMEngine(sim_config(3), VirtualClock())
    qwen = EngineConfig(model=None, simulate={"accelerator": "h100-80gb", "model": "qwen2.5-7b"},
                        tensor_parallel_size=8, max_model_len=4096)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(8\) must divide qwen2.5-7b's num_key_value_heads \(4\)"):
        LLMEngine(qwen, VirtualClock())
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not modelled by --simulate"):
        LLMEngine(sim_config(2, pipeline_parallel_size=2), VirtualClock())


# --- time --------------------------------------------------------------------------------

def test_ring_all_reduce_and_all_gather_follow_the_formula():
    link = INTERCONNECTS["nvlink4"]
    assert (link.bus_bandwidth, link.step_latency_s) == (450e9, 0.6e-6)
    b = 8 * 8192 * 2
    assert tp(4).all_reduce_s(b) == pytest.approx(2 * 3 / 4 * b / 450e9 + 2 * 3 * 0.6e-6, rel=1e-12)
    assert tp(8).all_gather_s(b) == pytest.approx(7 / 8 * b / 450e9 + 7 * 0.6e-6, rel=1e-12)
    assert SINGLE_GPU.all_reduce_s(b) == SINGLE_GPU.communication_s(LLAMA70B, 8, 8) == 0.0


def test_a_tp4_decode_step_is_a_quarter_of_the_compute_plus_the_all_reduces():
    batch = BatchShape.of([(1, 1024)] * 8)
    one, four = step_cost(LLAMA70B, H100, batch), step_cost(LLAMA70B, H100, batch, tp(4))
    # Two all-reduces a layer and the embedding's of [8, 8192] bf16, and the 8 rows' logits gathered.
    comm = 161 * tp(4).all_reduce_s(8 * 8192 * 2) + tp(4).all_gather_s(8 * 128256 * 2)
    assert four.communication_s == pytest.approx(comm, rel=1e-12) and one.communication_s == 0.0
    assert four.gemm_s == pytest.approx(one.gemm_s / 4, rel=0.01)  # weight streaming, split 4 ways
    assert four.attention_s == pytest.approx(one.attention_s / 4, rel=0.01)  # 2 of the 8 KV heads each
    assert four.sampling_s == one.sampling_s and four.overhead_s == one.overhead_s  # on the driver
    compute_one = one.gemm_s + one.attention_s + one.lm_head_s
    assert four.total_s < compute_one
    assert four.total_s == pytest.approx(four.overhead_s + four.sampling_s + comm
                                         + four.gemm_s + four.attention_s + four.lm_head_s, rel=1e-12)
    assert step_time(LLAMA70B, H100, batch, tp(4)) == four.total_s


@pytest.mark.parametrize("batch", [[(1, 1024)] * 8, [(1, 2048)] * 128, [(2048, 2048)]])
def test_nvlink_is_faster_than_pcie_and_gen5_than_gen4(batch):
    shape = BatchShape.of(batch)
    times = [step_cost(LLAMA70B, H100, shape, tp(4, link)) for link in ("nvlink4", "nvlink3", "pcie5", "pcie4")]
    comm = [t.communication_s for t in times]
    assert comm == sorted(comm) and comm[0] < comm[-1] / 5
    assert [t.total_s for t in times] == sorted(t.total_s for t in times)
    assert all(t.gemm_s == times[0].gemm_s for t in times)  # the link changes only the collectives


def test_over_nvlink_more_gpus_speed_decode_up_but_over_pcie_the_all_reduces_eat_the_gain():
    decode, prefill = BatchShape.of([(1, 2048)] * 64), BatchShape.of([(2048, 2048)])
    nvlink = [step_time(LLAMA70B, H100, decode, tp(n)) for n in (2, 4, 8)]
    assert nvlink == sorted(nvlink, reverse=True)
    assert step_time(LLAMA70B, H100, prefill, tp(8, "pcie4")) > step_time(LLAMA70B, H100, prefill, tp(4, "pcie4"))


# --- configuration -----------------------------------------------------------------------

def test_interconnect_defaults_to_the_accelerators_and_the_flag_overrides_it(tmp_path):
    assert [ACCELERATORS[a].interconnect for a in ("h200", "h100-80gb", "a100-80gb", "l40s", "l4", "a10g")] == \
        ["nvlink4", "nvlink4", "nvlink3", "pcie4", "pcie4", "pcie4"]
    assert LLMEngine(sim_config(2), VirtualClock()).runner.parallel.interconnect.name == "nvlink4"
    args = build_parser().parse_args(["sim", "describe", "--simulate", "h100-80gb", "--simulate-model",
                                      "llama-3.1-70b", "--tensor-parallel-size", "4",
                                      "--simulate-interconnect", "pcie5"])
    config = engine_config_from_args(args)
    assert (config.tensor_parallel_size, config.simulate.interconnect) == (4, "pcie5")
    assert LLMEngine(config, VirtualClock()).runner.parallel.interconnect.name == "pcie5"
    with pytest.raises(ValueError, match="simulate_interconnect must be one of nvlink4, nvlink3, pcie5, pcie4"):
        sim_config(2, simulate={"interconnect": "nvlink"})
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"name": "x", "memory_bytes": 1, "bandwidth": 1, "flops": 1, "interconnect": "ib"}))
    with pytest.raises(ValueError, match="interconnect must be one of"):
        resolve_accelerator(str(acc))


def test_a_fleet_of_tp4_replicas_holds_four_gpus_each_and_says_so(capsys):
    fleet = Fleet(sim_config(4), replicas=2)
    fleet.run([TraceRequest(0.0, 32, 16) for _ in range(4)])
    assert fleet.gpu_timeline[0] == (0.0, 8)
    result = summarize(fleet)
    assert result["tensor_parallel_size"] == 4 and result["completed"] == 4
    print_sim_result(result)
    assert "SIMULATED accelerator: h100-80gb x2 (4 GPUs each, tensor_parallel_size 4)" in capsys.readouterr().out


def test_simulated_70b_on_4_and_8_h100s_beside_vllms_published_tp4_latency():
    """vLLM CI's latency_llama70B_tp4 (batch 8, 32 in / 128 out) on H100s took 2444 ms end to
    end; the uncalibrated preset predicts it fast, by about as much as it predicts the same
    CI's 8B test fast (17-26 %: the CI's vLLM spent more per step than the model's 1 ms)."""
    (h100,) = [p for p in POINTS if p.model == "llama-3.1-70b" and p.accelerator == "h100-80gb"
               and p.tensor_parallel_size == 4]
    (eight,) = [p for p in POINTS if p.tensor_parallel_size == 8]
    assert h100.published == 2444.47 and "builds/9555" in h100.source and eight.published is None
    four_ms, eight_ms = predict(h100), predict(eight)
    assert 0.6 * h100.published < four_ms < h100.published
    assert eight_ms < four_ms  # batch 8 decodes memory-bound: half the weights per GPU
    tokens_per_s = [8 * 128 / (ms / 1000) for ms in (four_ms, eight_ms)]
    assert 450 < tokens_per_s[0] < 700 and 700 < tokens_per_s[1] < 1100
