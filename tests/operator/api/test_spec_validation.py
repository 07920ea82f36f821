"""Issue 40 parts 6-7: one validation of the LLMDeployment spec, at the API server (the
generated CRD's schema and CEL rules, checked here by tests/crd_validator.py) and in the
operator (pydantic and validate_spec) alike; and a spec that cannot smuggle a Secret
through Kubernetes' $(VAR) expansion or restate a flag the operator owns."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from crd_validator import api_server_errors, crd_schema
from kvpilot.operator.manifests.deployment import build_deployment
from kvpilot.operator.manifests.objects import Owner
from kvpilot.operator.reconcile import parse_spec
from kvpilot.operator.api.engine import EXTRA_FLAGS, OWNED_FLAGS
from kvpilot.operator.api.fields import InvalidSpec
from kvpilot.operator.api.spec import LLMDeploymentSpec

ROOT = Path(__file__).resolve().parents[3]
OWNER = Owner("m", "demo", "uid-1")
TINY = {"source": "builtin:tiny"}


def body(**over) -> dict:
    out = {"model": dict(TINY)}
    out.update(over)
    return out


# Each was admitted by the CRD, by pydantic or by both before (issue 40), and would reach a pod
# that crash-loops, leaks a Secret or steps out of a cache.
HOSTILE = {
    "served name expands the API key": body(model={**TINY, "servedName": "$(KVPILOT_API_KEY)"}),
    "extraArgs item expands the API key": body(engine={"extraArgs": ["--seed", "$(KVPILOT_API_KEY)"]}),
    "extraArgs --api-key with a value": body(engine={"extraArgs": ["--api-key", ""]}),
    "extraArgs --api-key=": body(engine={"extraArgs": ["--api-key="]}),
    "extraArgs abbreviation of --api-key": body(engine={"extraArgs": ["--api-k=x"]}),
    "extraArgs --host": body(engine={"extraArgs": ["--host", "127.0.0.1"]}),
    "extraArgs --port=": body(engine={"extraArgs": ["--port=9"]}),
    "extraArgs --model": body(engine={"extraArgs": ["--model", "/etc"]}),
    "extraArgs --served-model-name": body(engine={"extraArgs": ["--served-model-name=x"]}),
    "extraArgs --tuning-file": body(engine={"extraArgs": ["--tuning-file", "/tmp/t"]}),
    "extraArgs --drain-timeout": body(engine={"extraArgs": ["--drain-timeout=0"]}),
    "extraArgs --max-num-seqs": body(engine={"extraArgs": ["--max-num-seqs", "9"]}),
    "extraArgs -h": body(engine={"extraArgs": ["-h"]}),
    "extraArgs unknown flag": body(engine={"extraArgs": ["--no-such-flag"]}),
    "extraArgs item too long": body(engine={"extraArgs": ["--seed=" + "1" * 2000]}),
    "extraArgs too many": body(engine={"extraArgs": ["--enforce-eager"] * 33}),
    "kvCacheMemory -1Gi": body(engine={"kvCacheMemory": "-1Gi"}),
    "kvCacheMemory 1e309": body(engine={"kvCacheMemory": "1e309"}),
    "kvCacheMemory .5Ki": body(engine={"kvCacheMemory": ".5Ki"}),
    "kvCacheMemory -5": body(engine={"kvCacheMemory": -5}),
    "kvCacheMemory 2**70": body(engine={"kvCacheMemory": 2**70}),
    "kvCacheMemory 0": body(engine={"kvCacheMemory": "0Gi"}),
    "kvCacheMemory a float": body(engine={"kvCacheMemory": 1.5}),
    "resources.cpu -2": body(resources={"cpu": "-2"}),
    "resources.cpu 0": body(resources={"cpu": "0"}),
    "resources.memory -1Gi": body(resources={"memory": "-1Gi"}),
    "resources.memory 1e309": body(resources={"memory": "1e309"}),
    "hf revision steps up": body(model={"source": "hf://o/n@../../etc"}),
    "hf revision absolute": body(model={"source": "hf://o/n@/etc/passwd"}),
    "hf org with --": body(model={"source": "hf://org--x/n"}),
    "hf name with ..": body(model={"source": "hf://o/a..b"}),
    "hf name too long": body(model={"source": "hf://o/" + "n" * 97}),
    "hf revision with a space": body(model={"source": "hf://o/n@a b"}),
    "s3 key steps up": body(model={"source": "s3://bucket/../../x"}),
    "s3 key with a . part": body(model={"source": "s3://bucket/a/./b"}),
    "s3 bucket with ..": body(model={"source": "s3://a..b/x"}),
    "s3 bucket too short": body(model={"source": "s3://ab/x"}),
    "s3 bucket too long": body(model={"source": "s3://" + "b" * 64 + "/x"}),
    "s3 key expands": body(model={"source": "s3://bucket/$(HOME)"}),
    "pvc path steps out of /models": body(model={"source": "pvc://claim/../../etc"}),
    "pvc path with //": body(model={"source": "pvc://claim//x"}),
    "file path with a newline": body(model={"source": "/models/x\ny"}),
    "hub endpoint expands": body(model={"source": "hf://o/n", "hf": {"endpoint": "http://h/$(HF_TOKEN)"}}),
    "s3 endpoint expands": body(model={"source": "s3://bucket/x", "s3": {"endpoint": "http://h/$(X)"}}),
    "draft model steps up": body(engine={"speculative": {"model": "/models/../../etc", "numSpeculativeTokens": 2}}),
    "duration with 40 digits": body(autotune={"interval": "9" * 40 + "s"}),
    "priorityClassName too long": body(scheduling={"priorityClassName": "p" * 254}),
    "priorityClassName not a name": body(scheduling={"priorityClassName": "High Priority"}),
    "nodeSelector too large": body(scheduling={"nodeSelector": {f"k{i}": "v" for i in range(33)}}),
    "nodeSelector key too long": body(scheduling={"nodeSelector": {"k" * 317: "v"}}),
    "nodeSelector value too long": body(scheduling={"nodeSelector": {"k": "v" * 64}}),
    "toleration seconds negative": body(scheduling={"tolerations": [{"key": "k", "tolerationSeconds": -1}]}),
    "pod label value not a label value": body(pod={"labels": {"team": "a b"}}),
    "image with a space": body(engine={"image": "repo/x:1 --privileged"}),
    "gpu resource name without a domain": body(resources={"gpuResourceName": "gpu"}),
    "secret name not a name": body(engine={"apiKeySecretRef": {"name": "Key!", "key": "k"}}),
    "prometheus url expands": body(autotune={"prometheus": {"url": "http://p/$(KVPILOT_API_KEY)"}}),
    "runAsUser root": body(pod={"securityContext": {"runAsUser": 0}}),
    "attainment 0": body(autotune={"objectives": {"attainment": 0}}),
    "attainment above 1": body(autotune={"objectives": {"attainment": 1.01}}),
    "attainment as a percentage": body(autotune={"objectives": {"attainment": "95%"}}),
}

VALID = {
    "tiny": body(),
    "hf with a branch": body(model={"source": "hf://meta-llama/Llama-3.1-8B-Instruct@refs/pr/1"}),
    "hf with a commit": body(model={"source": "hf://Qwen/Qwen2.5-0.5B@" + "a" * 40}),
    "hf with a tag": body(model={"source": "hf://org_x/name.v2@v1.0"}),
    "s3 with a key": body(model={"source": "s3://my.bucket-1/models/llama/"}),
    "s3 bucket only": body(model={"source": "s3://bucket"}),
    "pvc with a path": body(model={"source": "pvc://models-rwx/llama/8b"}),
    "pvc root": body(model={"source": "pvc://models"}),
    "file path": body(model={"source": "file:///opt/models/tiny"}),
    "image path with ...": body(model={"source": "/opt/.../m"}),
    "quantities": body(engine={"kvCacheMemory": "1.5Gi"}, resources={"cpu": "500m", "memory": "4Gi"}),
    "integer quantities": body(engine={"kvCacheMemory": 67108864}, resources={"cpu": 2, "memory": 4294967296}),
    "fractional cpu": body(resources={"cpu": "0.25"}),
    "extraArgs the spec does not own": body(engine={"extraArgs": ["--seed", "-1", "--max-queued-requests=64",
                                                                 "--enforce-eager", "--cpu-threads", "2"]}),
    "a $ that is not a reference": body(engine={"extraArgs": ["--record-steps", "/scratch/$steps"]}),
    "served name with a slash": body(model={**TINY, "servedName": "meta-llama/Llama-3.1-8B"}),
    "pod settings": body(pod={"imagePullSecrets": ["regcred"], "serviceAccountName": "llm",
                              "labels": {"team": "search"}, "annotations": {"example.com/owner": "a b"},
                              "securityContext": {"runAsNonRoot": True}}),
    "scheduling": body(scheduling={"nodeSelector": {"nvidia.com/gpu.product": "H100"},
                                   "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                                   "affinity": {"nodeAffinity": {}}, "priorityClassName": "llm-high"}),
    "gpu resource": body(resources={"gpus": 1, "gpuResourceName": "amd.com/gpu"}),
    "cache size": body(model={"source": "s3://bucket/x", "cache": {"sizeLimit": "40Gi"}}),
    "long duration": body(autotune={"interval": "1h30m", "window": "500ms"}),
    "objectives with an attainment": body(autotune={"objectives": {"ttft": "2s", "tpot": "50ms", "attainment": 0.95}}),
    "attainment 1": body(autotune={"objectives": {"attainment": 1}}),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_api_server_and_the_operator_both_refuse(name):
    spec = HOSTILE[name]
    assert api_server_errors(spec), f"the CRD admits {name}: {json.dumps(spec)[:200]}"
    with pytest.raises(InvalidSpec):
        parse_spec({"spec": spec})


@pytest.mark.parametrize("name", sorted(VALID))
def test_the_api_server_and_the_operator_both_admit(name):
    spec = VALID[name]
    assert api_server_errors(spec) == []
    build_deployment(OWNER, parse_spec({"spec": spec}), 1, "a" * 40, 10**9)


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("llmdeployment-*.yaml")))
def test_the_examples_pass_both(example):
    spec = yaml.safe_load((ROOT / "examples" / example).read_text())["spec"]
    assert api_server_errors(spec) == []
    parse_spec({"spec": spec})


def test_the_flag_lists_cover_the_engines_parser_exactly():
    """A new `kvpilot serve` flag must be sorted into OWNED_FLAGS or EXTRA_FLAGS (spec.py)."""
    from kvpilot.engine.server.cli import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    engine = {o for a in add_parser(sub)._actions for o in a.option_strings}
    assert not set(OWNED_FLAGS) & set(EXTRA_FLAGS)
    assert set(OWNED_FLAGS) | set(EXTRA_FLAGS) == engine


def test_every_flag_the_operator_sets_is_owned():
    spec = parse_spec({"spec": {
        "model": {"source": "hf://o/n", "servedName": "n"},
        "engine": {"kvCacheMemory": "1Gi", "speculative": {"method": "ngram", "numSpeculativeTokens": 2},
                   "quantization": "int8", "kvCacheDtype": "fp8", "apiKeySecretRef": {"name": "k", "key": "k"},
                   "pipelineParallelSize": 2, "enablePrefixCaching": False},
        "resources": {"gpus": 4}}})
    sim = parse_spec({"spec": {"model": {}, "engine": {"simulate": {
        "accelerator": "h100-80gb", "model": "llama-3.1-8b", "outputLen": "fixed:8", "loadSeconds": 1,
        "interconnect": "nvlink4"}, "gpuMemoryUtilization": 0.9}, "resources": {"gpus": 2}}})
    for s in (spec, sim):
        args = build_deployment(OWNER, s, 1, "a" * 40)["spec"]["template"]["spec"]["containers"][0]["args"]
        flags = {a for a in args if a.startswith("--")}
        assert flags <= set(OWNED_FLAGS), flags - set(OWNED_FLAGS)


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion (third_party/forked/golang/expansion): $$ is a literal $,
    $(NAME) of a defined variable its value, anything else as written."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(" and (end := text.find(")", i + 2)) != -1:
                name = text[i + 2:end]
                out.append(env.get(name, f"$({name})"))
                i = end + 1
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def test_a_stored_spec_with_a_reference_reaches_the_pod_as_text():
    """An object the API server stored before the rules (bypassing them here with model_copy):
    the builder's $$ escape keeps every user string literal; the key's own reference alone
    expands."""
    spec = parse_spec({"spec": {"model": {"source": "s3://bucket/m", "s3": {"endpoint": "http://minio:9000"}},
                                "engine": {"apiKeySecretRef": {"name": "k", "key": "k"}}}})
    sneaky = "$(KVPILOT_API_KEY)"
    spec = spec.model_copy(update={
        "model": spec.model.model_copy(update={
            "served_name": sneaky, "files": [sneaky],
            "s3": spec.model.s3.model_copy(update={"endpoint": f"http://x/{sneaky}", "region": sneaky})}),
        "engine": spec.engine.model_copy(update={"extra_args": ["--seed", sneaky, "$$(X)"]})})
    pod = build_deployment(OWNER, spec, 1)["spec"]["template"]["spec"]
    env = {"KVPILOT_API_KEY": "SECRET", "X": "x", "AWS_SECRET_ACCESS_KEY": "SECRET"}
    for c in pod["containers"] + pod["initContainers"]:
        values = [k8s_expand(a, env) for a in c["args"]]
        values += [k8s_expand(e["value"], env) for e in c["env"] if "value" in e]
        expanded = [v for v in values if "SECRET" in v]
        assert expanded == (["SECRET"] if c["name"] == "engine" else []), c["name"]  # --api-key's value alone
    args = [k8s_expand(a, env) for a in pod["containers"][0]["args"]]
    assert args[args.index("--served-model-name") + 1] == sneaky and args[-4:-2] == [sneaky, "$$(X)"]


def test_every_string_list_and_map_of_the_spec_is_bounded():
    loose = []

    def walk(node: dict, path: str) -> None:
        t = node.get("type")
        if node.get("x-kubernetes-int-or-string"):
            if not {"maxLength", "maximum", "minimum", "pattern"} <= set(node):
                loose.append(path)
            return
        if t == "string" and "enum" not in node and "maxLength" not in node:
            loose.append(path)
        if t == "array":
            if "maxItems" not in node:
                loose.append(path)
            walk(node["items"], f"{path}[]")
        if t == "object":
            if "properties" not in node and "maxProperties" not in node:
                loose.append(path)
            for k, v in (node.get("properties") or {}).items():
                walk(v, f"{path}.{k}")
            if isinstance(node.get("additionalProperties"), dict):
                walk(node["additionalProperties"], f"{path}{{}}")

    walk(crd_schema()["properties"]["spec"], "spec")
    assert loose == []


def test_the_cel_rules_are_where_they_should_be():
    spec = crd_schema()["properties"]["spec"]
    rules = json.dumps(spec)
    engine = spec["properties"]["engine"]["x-kubernetes-validations"]
    assert any("extraArgs.all(" in r["rule"] and "'--seed'" in r["rule"] and "'--api-key'" not in r["rule"]
               for r in engine)
    model = spec["properties"]["model"]["x-kubernetes-validations"]
    assert any("{3,63}" in r["rule"] for r in model) and any("{1,96}" in r["rule"] for r in model)
    labels = spec["properties"]["pod"]["properties"]["labels"]["x-kubernetes-validations"]
    # Map keys: their length only (the CEL cost estimator takes map keys as unbounded, so a
    # regex over them would exceed the CRD's budget); their form is pydantic's (next test).
    assert labels[0]["rule"] == "self.all(k, k.size() <= 316)" and "k.matches" not in rules
    affinity = spec["properties"]["scheduling"]["properties"]["affinity"]
    assert sorted(affinity["properties"]) == ["nodeAffinity", "podAffinity", "podAntiAffinity"]
    assert "x-kubernetes-preserve-unknown-fields" not in affinity  # anything else is pruned


@pytest.mark.parametrize("spec", [body(scheduling={"nodeSelector": {"a b": "v"}}),
                                  body(pod={"labels": {"-bad": "v"}}),
                                  body(scheduling={"affinity": {"nodeSelector": {}}})])
def test_what_the_api_server_leaves_to_the_operator_the_operator_refuses(spec):
    """Map keys' form and affinity's unknown parts (the API server prunes those)."""
    with pytest.raises(InvalidSpec):
        parse_spec({"spec": spec})


def test_a_pydantic_model_refuses_a_float_or_bool_quantity():
    for value in (True, 1.5, float("inf")):
        with pytest.raises(ValueError):
            LLMDeploymentSpec.model_validate(body(engine={"kvCacheMemory": value}))


@pytest.mark.parametrize("extra", [["--seed", "abc"], ["--seed"], ["stray"], ["--max-queued-requests=x"],
                                   ["--cpu-threads", "2", "--cpu-threads"]])
def test_the_operator_refuses_extra_args_the_engine_would_exit_on(extra):
    """Values the CRD cannot type-check: the operator reads them with `kvpilot serve`'s own
    parser, so the pod never crash-loops on them (Degraded, InvalidSpec)."""
    spec = body(engine={"extraArgs": extra})
    with pytest.raises(InvalidSpec, match="kvpilot serve would refuse them"):
        parse_spec({"spec": spec})
