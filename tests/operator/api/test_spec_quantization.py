"""spec.engine.quantization and spec.engine.kvCacheDtype: the engine's --quantization and
--kv-cache-dtype on the pods, refused by name when bad or when the spec is simulated (the
simulated accelerator models float weights and caches only), in the CRD with their CEL
rules; and the engine's own refusal of --simulate with either."""
from __future__ import annotations

import argparse

import pytest

from kvpilot.engine.config.engine import EngineConfig
from kvpilot.engine.config.args import add_engine_args, engine_config_from_args
from kvpilot.operator.api.crd import build_crd
from kvpilot.operator.manifests.deployment import build_deployment
from kvpilot.operator.manifests.objects import Owner
from kvpilot.operator.reconcile import parse_spec
from kvpilot.operator.api.fields import InvalidSpec

OWNER = Owner("tiny", "demo", "uid-1")
H100 = {"accelerator": "h100-80gb", "model": "llama-3.1-8b"}


def spec(engine: dict):
    source = {} if "simulate" in engine else {"source": "builtin:tiny-trained"}
    return parse_spec({"spec": {"model": source, "engine": engine}})


def args(engine: dict) -> list[str]:
    return build_deployment(OWNER, spec(engine), 1)["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_pods_get_the_engine_s_flag_which_the_engine_parses(method):
    a = args({"quantization": method})
    assert a[a.index("--quantization") + 1] == method
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    served = [x for x in a if not x.startswith("$(")]  # the pod's env references aside
    parsed = parser.parse_known_args(served)[0]
    assert parsed.quantization == method and engine_config_from_args(parsed).quantization == method


def test_float_weights_by_default():
    assert "--quantization" not in args({})


def test_a_bad_method_names_the_field():
    with pytest.raises(InvalidSpec, match=r"spec\.engine\.quantization"):
        spec({"quantization": "int3"})


def test_a_simulated_spec_refuses_quantization():
    with pytest.raises(InvalidSpec, match="engine.quantization is not modelled by engine.simulate"):
        spec({"simulate": H100, "quantization": "int8"})


def test_the_crd_carries_the_field_and_the_cel_rule():
    engine = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["engine"]
    assert engine["properties"]["quantization"]["enum"] == ["int8", "int4"]
    (rule,) = [r for r in engine["x-kubernetes-validations"] if r.get("fieldPath") == ".quantization"]
    assert rule["rule"] == "!has(self.quantization) || !has(self.simulate)"


def test_the_engine_refuses_simulate_with_quantization():
    with pytest.raises(ValueError, match="quantization='int4' is not modelled by --simulate"):
        EngineConfig(simulate={"accelerator": "h100-80gb", "model": "llama-3.1-8b"}, quantization="int4")


@pytest.mark.parametrize("dtype", ["auto", "fp8", "fp8_e4m3"])
def test_the_pods_get_the_kv_cache_dtype_which_the_engine_parses(dtype):
    a = args({"kvCacheDtype": dtype})
    assert a[a.index("--kv-cache-dtype") + 1] == dtype
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    parsed = parser.parse_known_args([x for x in a if not x.startswith("$(")])[0]
    assert engine_config_from_args(parsed).kv_cache_dtype == dtype
    assert "--kv-cache-dtype" not in args({})


def test_kv_cache_dtype_is_checked_by_name_and_against_simulate():
    with pytest.raises(InvalidSpec, match=r"spec\.engine\.kvCacheDtype"):
        spec({"kvCacheDtype": "int8"})
    with pytest.raises(InvalidSpec, match="engine.kvCacheDtype fp8 is not modelled by engine.simulate"):
        spec({"simulate": H100, "kvCacheDtype": "fp8"})
    assert spec({"simulate": H100, "kvCacheDtype": "auto"}).engine.kv_cache_dtype == "auto"
    engine = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["engine"]
    assert engine["properties"]["kvCacheDtype"]["enum"] == ["auto", "fp8", "fp8_e4m3"]
    (rule,) = [r for r in engine["x-kubernetes-validations"] if r.get("fieldPath") == ".kvCacheDtype"]
    assert rule["rule"] == "!has(self.kvCacheDtype) || self.kvCacheDtype == 'auto' || !has(self.simulate)"
