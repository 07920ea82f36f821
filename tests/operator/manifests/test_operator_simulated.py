"""Simulated pods (spec.engine.simulate): the spec's rules, the pod the builder renders,
and the status the reconcile writes. No cluster."""
from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml
from test_operator_builders import OWNER, container, pod, spec
from test_operator_reconcile import FakeKube, body

from kvpilot.engine.sim.hardware import PRESETS as ENGINE_ACCELERATORS
from kvpilot.engine.sim.shapes import PRESETS as ENGINE_MODELS
from kvpilot.engine.config.simulation import OutputLengths
from kvpilot.operator.api.crd import build_crd
from kvpilot.operator.manifests.deployment import HASH_ANNOTATION, build_deployment
from kvpilot.operator.reconcile import parse_spec, reconcile
from kvpilot.operator.api.fields import InvalidSpec, SimulatedAccelerator, SimulatedModel
from kvpilot.operator.api.spec import LLMDeploymentSpec

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "llmdeployment-simulated.yaml"
H100 = {"accelerator": "h100-80gb", "model": "llama-3.1-8b"}


def sim_spec(simulate: dict, model: dict | None = None, **over) -> LLMDeploymentSpec:
    engine = {"simulate": simulate, **over.pop("engine", {})}
    return LLMDeploymentSpec.model_validate({"model": model or {}, "engine": engine,
                                             "resources": {"gpus": 1}, **over})


def args_of(s: LLMDeploymentSpec) -> list[str]:
    return container(build_deployment(OWNER, s, 1))["args"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def crd_spec() -> dict:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


# --- the pod --------------------------------------------------------------------------------

def test_simulated_pods_run_the_torch_free_operator_image_unless_told_otherwise():
    from kvpilot.operator.api.defaults import OperatorDefaults, with_defaults
    assert container(build_deployment(OWNER, sim_spec(H100), 1))["image"] == "kvpilot/operator:0.1.0"
    assert container(build_deployment(OWNER, spec(), 1))["image"] == "kvpilot/engine:0.1.0"  # a real engine
    d = OperatorDefaults(engine_image="r.io/engine:2", simulated_image="r.io/operator:2")
    assert container(build_deployment(OWNER, with_defaults(sim_spec(H100), d), 1))["image"] == "r.io/operator:2"
    assert container(build_deployment(OWNER, with_defaults(spec(), d), 1))["image"] == "r.io/engine:2"
    pinned = sim_spec(H100, engine={"image": "mine/kvpilot:1"})
    assert container(build_deployment(OWNER, with_defaults(pinned, d), 1))["image"] == "mine/kvpilot:1"


def test_preset_model_args_gpu_request_label_and_no_dshm():
    d = build_deployment(OWNER, sim_spec(H100, engine={"gpuMemoryUtilization": 0.9}), 1)
    c, p = container(d), pod(d)
    args = c["args"]
    assert flag(args, "--simulate") == "h100-80gb" and flag(args, "--simulate-model") == "llama-3.1-8b"
    assert "--model" not in args and "--simulate-output-len" not in args  # no model.source, no outputLen
    assert flag(args, "--gpu-memory-utilization") == "0.9" and "--kv-cache-memory" not in args
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "1" == c["resources"]["limits"]["nvidia.com/gpu"]
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}  # placed like GPU pods
    assert not any(v["name"] == "dshm" for v in p["volumes"])
    assert not any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    assert d["spec"]["template"]["metadata"]["labels"]["serving.kvpilot.dev/simulated"] == "true"
    assert "serving.kvpilot.dev/simulated" not in d["spec"]["selector"]["matchLabels"]
    tuning = next(v for v in p["volumes"] if v["name"] == "tuning")
    assert tuning == {"name": "tuning", "configMap": {"name": "tiny-tuning"}}  # unchanged for preset models


def test_configmap_model_is_projected_beside_the_tuning_file():
    s = sim_spec({"accelerator": "a10g", "modelConfigMap": {"name": "shape", "key": "qwen.json"}})
    d = build_deployment(OWNER, s, 1)
    assert flag(container(d)["args"], "--simulate-model") == "/etc/kvpilot/sim-model/qwen.json"
    tuning = next(v for v in pod(d)["volumes"] if v["name"] == "tuning")
    assert tuning["projected"]["sources"] == [
        {"configMap": {"name": "tiny-tuning"}},
        {"configMap": {"name": "shape", "items": [{"key": "qwen.json", "path": "sim-model/qwen.json"}]}}]
    mount = next(m for m in container(d)["volumeMounts"] if m["name"] == "tuning")
    assert mount == {"name": "tuning", "mountPath": "/etc/kvpilot", "readOnly": True}  # no subPath: live updates
    default_key = sim_spec({"accelerator": "a10g", "modelConfigMap": {"name": "shape"}})
    assert flag(args_of(default_key), "--simulate-model") == "/etc/kvpilot/sim-model/config.json"


def test_output_len_and_model_source_when_given():
    s = sim_spec({**H100, "outputLen": "fixed:128"}, model={"source": "builtin:tiny", "servedName": "m"})
    args = args_of(s)
    assert flag(args, "--simulate-output-len") == "fixed:128"
    assert flag(args, "--model") == "builtin:tiny" and flag(args, "--served-model-name") == "m"


def test_load_seconds_becomes_the_flag_and_is_bounded():
    assert flag(args_of(sim_spec({**H100, "loadSeconds": 55})), "--simulate-load-seconds") == "55"
    assert "--simulate-load-seconds" not in args_of(sim_spec(H100))
    with pytest.raises(ValueError, match="load_seconds|loadSeconds"):
        sim_spec({**H100, "loadSeconds": -1})


def test_real_gpu_pods_keep_dshm_and_have_no_simulated_label():
    d = build_deployment(OWNER, spec(resources={"gpus": 1}), 1)
    assert any(v["name"] == "dshm" for v in pod(d)["volumes"])
    assert "serving.kvpilot.dev/simulated" not in d["spec"]["template"]["metadata"]["labels"]
    assert not any(a.startswith("--simulate") for a in container(d)["args"])


def test_simulate_settings_change_the_config_hash():
    def h(s):
        return build_deployment(OWNER, s, 1)["spec"]["template"]["metadata"]["annotations"][HASH_ANNOTATION]

    hashes = {h(sim_spec(H100)), h(sim_spec({**H100, "accelerator": "h200"})),
              h(sim_spec({**H100, "outputLen": "fixed:64"})),
              h(sim_spec({"accelerator": "h100-80gb", "modelConfigMap": {"name": "shape"}})),
              h(spec(resources={"gpus": 1}))}
    assert len(hashes) == 5


def test_simulated_example_parses_and_renders():
    doc = yaml.safe_load(EXAMPLE.read_text())
    s = parse_spec(doc)
    sim = s.engine.simulate
    assert (sim.accelerator, sim.model, s.model.source) == ("h100-80gb", "llama-3.1-8b", None)
    assert (s.resources.gpus, s.resources.cpu, s.resources.memory) == (1, "250m", "256Mi")
    assert s.autotune.mode == "Recommend" and s.engine.gpu_memory_utilization == 0.9
    assert flag(args_of(s), "--simulate") == "h100-80gb"


# --- the spec -------------------------------------------------------------------------------

def test_presets_are_the_engines():
    assert list(typing.get_args(SimulatedAccelerator)) == list(ENGINE_ACCELERATORS)
    assert list(typing.get_args(SimulatedModel)) == list(ENGINE_MODELS)


def test_crd_carries_the_simulate_schema_and_rules():
    s = crd_spec()
    assert "required" not in s["properties"]["model"]  # model.source: only a CEL rule requires it
    top = {r["rule"]: r for r in s["x-kubernetes-validations"]}
    rule = top["has(self.model.source) || has(self.engine.simulate)"]
    assert rule["message"] == "model.source is required unless engine.simulate is set"
    assert rule["fieldPath"] == ".model.source"
    sim = s["properties"]["engine"]["properties"]["simulate"]
    assert sim["required"] == ["accelerator"]
    assert sim["properties"]["accelerator"]["enum"] == list(ENGINE_ACCELERATORS)
    assert sim["properties"]["model"]["enum"] == list(ENGINE_MODELS)
    assert sim["properties"]["modelConfigMap"]["properties"]["key"]["default"] == "config.json"
    assert "pattern" in sim["properties"]["outputLen"] and sim["properties"]["outputLen"]["maxLength"] == 64
    rules = {r["rule"]: r["message"] for r in sim["x-kubernetes-validations"]}
    assert "mutually exclusive" in rules["!(has(self.model) && has(self.modelConfigMap))"]
    assert "engine.simulate needs model" in rules["has(self.model) || has(self.modelConfigMap)"]
    status = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["properties"]["simulated"]["type"] == "string"


@pytest.mark.parametrize("spec_body,match", [
    ({"model": {"servedName": "m"}},
     "model.source is required unless engine.simulate is set"),
    ({"model": {}, "engine": {"simulate": {"accelerator": "h100-80gb"}}},
     "engine.simulate needs model .* or modelConfigMap"),
    ({"model": {}, "engine": {"simulate": {**H100, "modelConfigMap": {"name": "shape"}}}},
     "engine.simulate.model and engine.simulate.modelConfigMap are mutually exclusive"),
    ({"model": {}, "engine": {"simulate": {"accelerator": "h100", "model": "llama-3.1-8b"}}},
     "spec.engine.simulate.accelerator"),
    ({"model": {}, "engine": {"simulate": {"accelerator": "h100-80gb", "model": "llama-3-8b"}}},
     "spec.engine.simulate.model"),
    ({"model": {}, "engine": {"simulate": {**H100, "outputLen": "normal:10"}}},
     "spec.engine.simulate.outputLen"),
    ({"model": {}, "engine": {"simulate": {**H100, "outputLen": "uniform:512:16"}}},
     "engine.simulate.outputLen: uniform:LO:HI needs LO <= HI"),
    ({"model": {}, "engine": {"simulate": {"accelerator": "l4", "modelConfigMap": {"name": "Bad_Name"}}}},
     "spec.engine.simulate.modelConfigMap.name"),
])
def test_invalid_simulate_specs_name_the_field(spec_body, match):
    with pytest.raises(InvalidSpec, match=match):
        parse_spec({"spec": spec_body})


@pytest.mark.parametrize("value", ["fixed:128", "fixed:.5", "uniform:16:512", "exponential:200",
                                   "lognormal:256:1.0", "lognormal:256:1"])
def test_output_len_pattern_accepts_what_the_engine_accepts(value):
    assert sim_spec({**H100, "outputLen": value}).engine.simulate.output_len == value
    OutputLengths.parse(value)


@pytest.mark.parametrize("value", ["fixed:0", "fixed:0.0", "fixed:-1", "fixed:1:2", "uniform:16",
                                   "lognormal:256", "exponential:", "normal:10", "fixed:1e3", ""])
def test_output_len_pattern_rejects_malformed_distributions(value):
    with pytest.raises(InvalidSpec, match="outputLen"):
        parse_spec({"spec": {"model": {}, "engine": {"simulate": {**H100, "outputLen": value}}}})


# --- the status -----------------------------------------------------------------------------

def test_reconcile_reports_simulated_in_status_and_ready_message():
    kube = FakeKube()
    result = reconcile(kube, body({"model": {}, "engine": {"simulate": H100}, "resources": {"gpus": 1}}))
    assert result.ready and result.status.simulated == "h100-80gb/llama-3.1-8b"
    assert "simulated h100-80gb" in result.status.condition("Ready").message
    status_manifest, sub = kube.applied[-1]
    assert sub == "status" and status_manifest["status"]["simulated"] == "h100-80gb/llama-3.1-8b"

    # The spec stops simulating: the field goes (and so leaves the server-side-applied status).
    real = reconcile(FakeKube(), body({"model": {"source": "builtin:tiny"}}, result.status.dump()))
    assert real.status.simulated is None and "simulated" not in real.status.dump()
    assert "simulated" not in real.status.condition("Ready").message


def test_reconcile_with_a_configmap_model_checks_the_configmap():
    sim = {"model": {}, "engine": {"simulate": {"accelerator": "a10g", "modelConfigMap": {"name": "shape"}}}}
    ok = reconcile(FakeKube({("ConfigMap", "shape"): {"data": {"config.json": "{}"}}}), body(sim))
    assert ok.status.simulated == "a10g/configmap:shape" and not ok.problems
    missing = reconcile(FakeKube(), body(sim))
    assert [p.reason for p in missing.problems] == ["ConfigMapNotFound"]
    assert "spec.engine.simulate.modelConfigMap" in missing.problems[0].message
    no_key = reconcile(FakeKube({("ConfigMap", "shape"): {"data": {"other.json": "{}"}}}), body(sim))
    assert [p.reason for p in no_key.problems] == ["ConfigMapKeyNotFound"]
    assert no_key.status.condition("Degraded").status == "True" and not no_key.ready
