"""Multi-GPU LLMDeployments: resources.gpus becomes the engine's --tensor-parallel-size
(overridable in spec.engine), the rules that keep the split equal to the GPUs, and the
capacity plan of an engine over N GPUs. No cluster."""
from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml
from test_operator_builders import OWNER, container, pod, spec
from test_operator_reconcile import FakeKube, body

from kvpilot.engine.cli import build_parser
from kvpilot.engine.core.clock import VirtualClock
from kvpilot.engine.config.args import engine_config_from_args
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.fleet.fleet import Fleet
from kvpilot.engine.config.simulation import INTERCONNECT_NAMES
from kvpilot.engine.sim.hardware import INTERCONNECTS
from kvpilot.engine.fleet.trace import TraceRequest
from kvpilot.operator.autotune.capacity import ModelShape, kv_cache_bytes, plan_capacity
from kvpilot.operator.api.crd import build_crd
from kvpilot.operator.manifests.deployment import HASH_ANNOTATION, build_deployment
from kvpilot.operator.api.parallel import parallel_sizes
from kvpilot.operator.reconcile import parse_spec, reconcile
from kvpilot.operator.api.engine import PARALLEL_USES_ALL_GPUS, PIPELINE_NOT_SIMULATED
from kvpilot.operator.api.fields import InvalidSpec, SimulatedInterconnect

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "llmdeployment-simulated-70b.yaml"
SIM_70B = {"accelerator": "h100-80gb", "model": "llama-3.1-70b"}
GiB = 2**30


def args_of(**over) -> list[str]:
    return container(build_deployment(OWNER, spec(**over), 1))["args"]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def sizes(args: list[str]) -> tuple[str | None, str | None]:
    return flag(args, "--tensor-parallel-size"), flag(args, "--pipeline-parallel-size")


def crd_spec() -> dict:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


# --- the pod -------------------------------------------------------------------------------

def test_gpus_give_the_pod_n_gpus_and_the_engine_tensor_parallel_size_n():
    d = build_deployment(OWNER, spec(resources={"gpus": 4}), 1)
    c = container(d)
    assert sizes(c["args"]) == ("4", None)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4" == c["resources"]["requests"]["nvidia.com/gpu"]
    assert any(v["name"] == "dshm" for v in pod(d)["volumes"])  # NCCL's shared memory between the ranks


def test_a_cpu_engine_over_several_ranks_gets_shared_memory_and_a_single_rank_none():
    def volumes(**over):
        return {v["name"] for v in pod(build_deployment(OWNER, spec(**over), 1))["volumes"]}
    assert "dshm" in volumes(engine={"tensorParallelSize": 2})  # the ranks' collectives (shm_channel.py)
    assert "dshm" not in volumes()  # one CPU process: the runtime's default /dev/shm is plenty


def test_one_gpu_and_cpu_pods_render_no_parallel_flags_so_they_do_not_roll():
    for over in ({}, {"resources": {"gpus": 1}}, {"resources": {"gpus": 2}, "engine": {"tensorParallelSize": 1,
                                                                                         "pipelineParallelSize": 2}}):
        args = args_of(**over)
        assert "--tensor-parallel-size" not in args
    assert sizes(args_of(resources={"gpus": 2}, engine={"tensorParallelSize": 1, "pipelineParallelSize": 2})) == \
        (None, "2")


@pytest.mark.parametrize("engine,gpus,expected", [
    ({"tensorParallelSize": 2, "pipelineParallelSize": 2}, 4, ("2", "2")),
    ({"pipelineParallelSize": 2}, 8, ("4", "2")),  # tensorParallelSize defaults to gpus / pipelineParallelSize
    ({"tensorParallelSize": 8}, 8, ("8", None)),
    ({"tensorParallelSize": 2}, 0, ("2", None)),  # a CPU engine's worker processes
])
def test_the_spec_overrides_the_split(engine, gpus, expected):
    assert sizes(args_of(engine=engine, resources={"gpus": gpus})) == expected


def test_changing_the_split_rolls_the_pods():
    def h(**over) -> str:
        return build_deployment(OWNER, spec(**over), 1)["spec"]["template"]["metadata"]["annotations"][HASH_ANNOTATION]

    four = {"resources": {"gpus": 4}}
    assert len({h(**four), h(**four, engine={"pipelineParallelSize": 2}),
                h(**four, engine={"pipelineParallelSize": 4})}) == 3


def test_a_simulated_deployment_without_gpus_hands_the_simulator_the_sizes():
    s = parse_spec({"spec": {"model": {}, "engine": {"simulate": {**SIM_70B, "interconnect": "pcie5"},
                                                     "tensorParallelSize": 4}}})
    args = container(build_deployment(OWNER, s, 1))["args"]
    assert sizes(args) == ("4", None) and flag(args, "--simulate-interconnect") == "pcie5"
    assert "nvidia.com/gpu" not in container(build_deployment(OWNER, s, 1))["resources"]["limits"]


def test_the_70b_example_renders_a_pod_whose_engine_spans_four_simulated_gpus():
    s = parse_spec(yaml.safe_load(EXAMPLE.read_text()))
    assert parallel_sizes(s) == (4, 1) and s.resources.gpus == 4
    args = container(build_deployment(OWNER, s, 1))["args"]
    config = engine_config_from_args(build_parser().parse_args(["serve", *args]))
    assert (config.tensor_parallel_size, config.simulate.model) == (4, "llama-3.1-70b")
    engine = LLMEngine(config, VirtualClock())
    assert engine.runner.describe().startswith("SIMULATED 4x h100-80gb")
    assert 140 * GiB < engine.kv_cache_bytes < 160 * GiB  # four GPUs' worth

    result = reconcile(FakeKube(), body(yaml.safe_load(EXAMPLE.read_text())["spec"]))
    assert result.ready and result.status.simulated == "4xh100-80gb/llama-3.1-70b"
    assert "simulated 4xh100-80gb" in result.status.condition("Ready").message


# --- the rules -----------------------------------------------------------------------------

@pytest.mark.parametrize("spec_body,match", [
    ({"model": {"source": "builtin:tiny"}, "resources": {"gpus": 4}, "engine": {"tensorParallelSize": 2}},
     r"engine.tensorParallelSize x engine.pipelineParallelSize must equal resources.gpus .*got 2 x 1 for 4 GPUs"),
    ({"model": {"source": "builtin:tiny"}, "resources": {"gpus": 4}, "engine": {"pipelineParallelSize": 3}},
     r"must equal resources.gpus .*got 1 x 3 for 4 GPUs"),
    ({"model": {"source": "builtin:tiny"}, "resources": {"gpus": 2},
      "engine": {"tensorParallelSize": 2, "pipelineParallelSize": 2}}, r"got 2 x 2 for 2 GPUs"),
    ({"model": {}, "engine": {"simulate": SIM_70B, "tensorParallelSize": 2, "pipelineParallelSize": 2}},
     PIPELINE_NOT_SIMULATED),
    ({"model": {}, "resources": {"gpus": 8}, "engine": {"simulate": {"accelerator": "h100-80gb",
                                                                     "model": "qwen2.5-7b"}}},
     r"tensor parallel size 8 .* must divide qwen2.5-7b's num_key_value_heads \(4\)"),
    ({"model": {"source": "builtin:tiny"}, "resources": {"gpus": 2},
      "engine": {"extraArgs": ["--tensor-parallel-size=1"]}}, "extraArgs may set only flags the spec does not own"),
    ({"model": {"source": "builtin:tiny"}, "engine": {"extraArgs": ["--pipeline-parallel-size", "2"]}},
     "extraArgs may set only flags the spec does not own"),
    ({"model": {"source": "builtin:tiny"}, "engine": {"tensorParallelSize": 17}}, "spec.engine.tensorParallelSize"),
    ({"model": {"source": "builtin:tiny"}, "engine": {"pipelineParallelSize": 0}},
     "spec.engine.pipelineParallelSize"),
    ({"model": {}, "engine": {"simulate": {**SIM_70B, "interconnect": "nvlink"}}},
     "spec.engine.simulate.interconnect"),
])
def test_invalid_splits_are_refused_naming_the_fields(spec_body, match):
    with pytest.raises(InvalidSpec, match=match):
        parse_spec({"spec": spec_body})


def test_valid_splits_pass():
    for engine, gpus in (({}, 4), ({"tensorParallelSize": 2, "pipelineParallelSize": 2}, 4),
                         ({"pipelineParallelSize": 2}, 4), ({"tensorParallelSize": 4}, 0)):
        parse_spec({"spec": {"model": {"source": "builtin:tiny"}, "engine": engine, "resources": {"gpus": gpus}}})


def test_crd_carries_the_fields_and_the_rules():
    s = crd_spec()
    engine = s["properties"]["engine"]
    for name in ("tensorParallelSize", "pipelineParallelSize"):
        assert (engine["properties"][name]["minimum"], engine["properties"][name]["maximum"]) == (1, 16)
        assert "default" not in engine["properties"][name]  # unset: derived from resources.gpus
    top = {r["message"]: r for r in s["x-kubernetes-validations"]}
    rule = top[PARALLEL_USES_ALL_GPUS]
    assert rule["fieldPath"] == ".engine.tensorParallelSize"
    assert rule["rule"].startswith("self.resources.gpus == 0 || ")
    engine_rules = {r["message"]: r for r in engine["x-kubernetes-validations"]}
    assert engine_rules[PIPELINE_NOT_SIMULATED]["fieldPath"] == ".pipelineParallelSize"
    sim = engine["properties"]["simulate"]["properties"]
    assert (sim["interconnect"]["enum"] == list(INTERCONNECTS) == list(INTERCONNECT_NAMES)
            == list(typing.get_args(SimulatedInterconnect)))


# --- the capacity plan ---------------------------------------------------------------------

def test_the_gpu_formula_counts_every_gpus_memory_and_splits_the_weights():
    shape = ModelShape(num_layers=80, num_kv_heads=8, head_dim=128, dtype_bytes=2, weight_bytes=132 * GiB)
    assert kv_cache_bytes(shape, gpu_memory_bytes=80 * GiB, gpu_memory_utilization=0.9,
                          activation_reserve_bytes=2 * GiB) == 0  # one GPU: the weights do not fit
    four = kv_cache_bytes(shape, gpu_memory_bytes=80 * GiB, gpu_memory_utilization=0.9,
                          activation_reserve_bytes=2 * GiB, num_gpus=4)
    assert four == int(4 * (80 * GiB * 0.9 - 2 * GiB) - 132 * GiB)  # 148 GiB: 4 x 70 GiB less the weights
    plan = plan_capacity(shape, seq_len=8192, max_num_seqs=64, gpu_memory_bytes=80 * GiB,
                         gpu_memory_utilization=0.9, activation_reserve_bytes=2 * GiB, num_gpus=4)
    assert plan.max_concurrent_seqs == four // (8192 * shape.kv_bytes_per_token) == 59
    with pytest.raises(ValueError, match="num_gpus must be a positive integer"):
        kv_cache_bytes(shape, gpu_memory_bytes=80 * GiB, gpu_memory_utilization=0.9, num_gpus=0)


def test_the_autotuners_plan_from_a_tp4_pods_metrics_counts_all_four_gpus():
    """The hook plans from kvpilot:kv_cache_bytes and kvpilot:kv_cache_bytes_per_token as
    scraped; an engine over four GPUs exports all four's cache, so the plan holds four GPUs'
    sequences, as the formula with num_gpus=4 says."""
    fleet = Fleet(engine_config_from_args(build_parser().parse_args(
        ["sim", "run", "--simulate", "h100-80gb", "--simulate-model", "llama-3.1-70b", "--tensor-parallel-size", "4",
         "--max-model-len", "8192", "--max-num-batched-tokens", "2048", "--gpu-memory-utilization", "0.9",
         "--phase", "duration=1 rate=1"])), scrape_interval=1.0)
    fleet.run([TraceRequest(0.0, 32, 4)])
    samples = {s.name: s.value for sc in fleet.scrapes for s in sc.samples}
    plan = plan_capacity(seq_len=8192, max_num_seqs=256, kv_cache_memory=int(samples["kvpilot:kv_cache_bytes"]),
                         bytes_per_token=int(samples["kvpilot:kv_cache_bytes_per_token"]))
    assert plan.max_concurrent_seqs == fleet.replicas[0].engine.kv_capacity_tokens // 8192 == 59
    shape = ModelShape(num_layers=80, num_kv_heads=8, head_dim=128, dtype_bytes=2,
                       weight_bytes=fleet.replicas[0].engine.weight_bytes)
    reserve = GiB + fleet.replicas[0].engine.runner.memory.activation_bytes  # the simulator's, each GPU
    formula = plan_capacity(shape, seq_len=8192, max_num_seqs=256, gpu_memory_bytes=81559 * 2**20,
                            gpu_memory_utilization=0.9, activation_reserve_bytes=reserve, num_gpus=4)
    assert abs(formula.max_concurrent_seqs - plan.max_concurrent_seqs) <= 1  # norms kept whole on every GPU
