"""spec.engine.speculative and spec.autotune.numSpeculativeTokens: validation that names the
field (pydantic, validate_spec, and the CRD's CEL rules), the engine's --speculative-config,
the tuning ConfigMap's num_speculative_tokens, status.effective and the autotuner's bounds."""
from __future__ import annotations

import json

import pytest

from kvpilot.engine.config.speculative import SpeculativeConfig
from kvpilot.operator.autotune.hook import bounds_for
from kvpilot.operator.api.crd import build_crd
from kvpilot.operator.manifests.deployment import build_deployment
from kvpilot.operator.manifests.objects import Owner, build_configmap, effective_settings, tuning_json
from kvpilot.operator.reconcile import parse_spec
from kvpilot.operator.api.fields import InvalidSpec
from kvpilot.operator.api.spec import LLMDeploymentSpec
from kvpilot.operator.api.status import Effective

OWNER = Owner("tiny", "demo", "uid-1")
NGRAM = {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 4, "promptLookupMin": 1}
DRAFT = {"model": "builtin:tiny-draft", "numSpeculativeTokens": 3}


def body(speculative=None, mode="Auto", **autotune) -> dict:
    engine = {"speculative": speculative} if speculative is not None else {}
    return {"spec": {"model": {"source": "builtin:tiny"}, "engine": engine,
                     "autotune": {"mode": mode, **autotune}}}


def parsed(*a, **kw) -> LLMDeploymentSpec:
    return parse_spec(body(*a, **kw))


def args(spec: LLMDeploymentSpec) -> list[str]:
    return build_deployment(OWNER, spec, 1)["spec"]["template"]["spec"]["containers"][0]["args"]


def flag(spec: LLMDeploymentSpec, name: str) -> str | None:
    a = args(spec)
    return a[a.index(name) + 1] if name in a else None


# --- validation -------------------------------------------------------------------------

@pytest.mark.parametrize("speculative, autotune, message", [
    ({"numSpeculativeTokens": 4}, {}, "engine.speculative needs method ngram, or model"),
    ({"method": "draft_model", "numSpeculativeTokens": 4}, {}, "engine.speculative.model is required"),
    ({"method": "ngram", "model": "builtin:tiny-draft", "numSpeculativeTokens": 4}, {},
     "engine.speculative.model is for a draft model"),
    ({**DRAFT, "promptLookupMax": 3}, {}, "engine.speculative.promptLookupMax and promptLookupMin apply to "
                                          "method ngram only"),
    ({"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMin": 5}, {},
     "engine.speculative.promptLookupMin must be <= engine.speculative.promptLookupMax, got 5 > 4"),
    (NGRAM, {"numSpeculativeTokens": {"min": 3, "max": 2}}, "autotune.numSpeculativeTokens.min must be <="),
    (NGRAM, {"numSpeculativeTokens": {"max": 5}},
     "autotune.numSpeculativeTokens [min, max] may not exceed engine.speculative.numSpeculativeTokens (4)"),
    (None, {"numSpeculativeTokens": {"max": 2}}, "autotune.numSpeculativeTokens needs engine.speculative"),
])
def test_bad_combinations_name_the_field(speculative, autotune, message):
    with pytest.raises(InvalidSpec, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        parsed(speculative, **autotune)


@pytest.mark.parametrize("speculative, field", [
    ({"method": "ngram", "numSpeculativeTokens": 0}, "spec.engine.speculative.numSpeculativeTokens"),
    ({"method": "ngram", "numSpeculativeTokens": 17}, "spec.engine.speculative.numSpeculativeTokens"),
    ({"method": "ngram"}, "spec.engine.speculative.numSpeculativeTokens"),
    ({"method": "eagle", "numSpeculativeTokens": 2}, "spec.engine.speculative.method"),
    ({"model": "hf://org/draft", "numSpeculativeTokens": 2}, "spec.engine.speculative.model"),
    ({"method": "ngram", "numSpeculativeTokens": 2, "promptLookupMax": 0},
     "spec.engine.speculative.promptLookupMax"),
])
def test_bad_values_name_the_field(speculative, field):
    with pytest.raises(InvalidSpec, match=field.replace(".", r"\.")):
        parsed(speculative)


def test_bounds_out_of_range_name_the_field():
    with pytest.raises(InvalidSpec, match=r"spec\.autotune\.numSpeculativeTokens\.max"):
        parsed(NGRAM, numSpeculativeTokens={"max": 17})


def test_the_crd_carries_the_fields_and_the_cel_rules():
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    sp = spec["properties"]["engine"]["properties"]["speculative"]
    assert set(sp["properties"]) == {"method", "model", "numSpeculativeTokens", "promptLookupMax", "promptLookupMin"}
    assert sp["required"] == ["numSpeculativeTokens"]
    assert (sp["properties"]["numSpeculativeTokens"]["minimum"], sp["properties"]["numSpeculativeTokens"]["maximum"]) \
        == (1, 16)
    assert sp["properties"]["method"]["enum"] == ["ngram", "draft_model"]
    messages = {r["message"] for r in sp["x-kubernetes-validations"]}
    assert all(m.startswith("engine.speculative") for m in messages) and len(messages) == 5
    bounds = spec["properties"]["autotune"]["properties"]["numSpeculativeTokens"]
    assert bounds["properties"]["min"]["default"] == 0 and "default" not in bounds["properties"]["max"]
    assert "self.min <= self.max" in bounds["x-kubernetes-validations"][0]["rule"]
    top = {r["message"]: r for r in spec["x-kubernetes-validations"]}
    within = top["autotune.numSpeculativeTokens [min, max] may not exceed engine.speculative.numSpeculativeTokens"]
    assert "self.autotune.numSpeculativeTokens.max <= self.engine.speculative.numSpeculativeTokens" in within["rule"]
    assert within["fieldPath"] == ".autotune.numSpeculativeTokens"
    assert "autotune.numSpeculativeTokens needs engine.speculative" in top
    effective = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"][
        "properties"]["effective"]["properties"]
    assert effective["numSpeculativeTokens"]["type"] == "integer"


# --- the engine's flag ------------------------------------------------------------------

def test_ngram_renders_vllm_s_json_which_the_engine_parses():
    text = flag(parsed(NGRAM), "--speculative-config")
    assert json.loads(text) == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                "prompt_lookup_min": 1}
    cfg = SpeculativeConfig.parse(text)
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == ("ngram", 4, 4)


def test_a_draft_model_renders_without_a_method_as_in_vllm():
    text = flag(parsed(DRAFT), "--speculative-config")
    assert json.loads(text) == {"model": "builtin:tiny-draft", "num_speculative_tokens": 3}
    assert SpeculativeConfig.parse(text).method == "draft_model"
    path = flag(parsed({"model": "file:///opt/draft", "numSpeculativeTokens": 2}), "--speculative-config")
    assert json.loads(path)["model"] == "/opt/draft"


def test_no_speculation_no_flag_and_changing_k_rolls_the_pods():
    assert flag(parsed(), "--speculative-config") is None
    hashes = {build_deployment(OWNER, s, 1)["spec"]["template"]["metadata"]["annotations"][
        "serving.kvpilot.dev/config-hash"] for s in (parsed(), parsed(NGRAM), parsed({**NGRAM, "numSpeculativeTokens": 2}))}
    assert len(hashes) == 3


# --- the live setting -------------------------------------------------------------------

def test_the_tuning_configmap_carries_k_only_when_configured():
    plain = json.loads(build_configmap(OWNER, effective_settings(parsed()))["data"]["tuning.json"])
    assert "num_speculative_tokens" not in plain
    spec = json.loads(build_configmap(OWNER, effective_settings(parsed(NGRAM)))["data"]["tuning.json"])
    assert spec["num_speculative_tokens"] == 4
    assert json.loads(tuning_json(Effective(max_num_seqs=8, max_model_len=512, num_speculative_tokens=0))) == \
        {"max_num_seqs": 8, "max_model_len": 512, "num_speculative_tokens": 0}  # 0 is off, not absent


def test_the_engine_reads_the_tuning_file_the_operator_writes():
    from kvpilot.engine.server.tuning import parse_tuning

    text = tuning_json(Effective(max_num_seqs=8, max_model_len=512, num_speculative_tokens=0))
    assert parse_tuning(text.encode()) == {"max_num_seqs": 8, "max_model_len": 512, "num_speculative_tokens": 0}


def test_effective_k_is_tuned_within_the_bounds_in_auto_only():
    s = parsed(NGRAM, numSpeculativeTokens={"min": 1, "max": 3})
    assert effective_settings(s).num_speculative_tokens == 3  # starts at the configured 4, within [1, 3]
    assert effective_settings(s, Effective(num_speculative_tokens=2)).num_speculative_tokens == 2
    assert effective_settings(s, Effective(num_speculative_tokens=0)).num_speculative_tokens == 1
    recommend = parsed(NGRAM, mode="Recommend")
    assert effective_settings(recommend, Effective(num_speculative_tokens=1)).num_speculative_tokens == 4
    assert effective_settings(parsed()).num_speculative_tokens is None
    assert effective_settings(parsed(NGRAM)).dump()["numSpeculativeTokens"] == 4  # status.effective


def test_the_autotuner_bounds_default_to_off_through_the_configured_k():
    assert bounds_for(parsed(NGRAM)).num_speculative_tokens.min == 0
    assert bounds_for(parsed(NGRAM)).num_speculative_tokens.max == 4
    r = bounds_for(parsed(NGRAM, numSpeculativeTokens={"min": 1, "max": 2})).num_speculative_tokens
    assert (r.min, r.max) == (1, 2)
    assert bounds_for(parsed()).num_speculative_tokens is None
