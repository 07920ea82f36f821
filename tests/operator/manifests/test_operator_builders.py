"""The operator's pure builders, without a cluster."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvpilot.operator.manifests.deployment import HASH_ANNOTATION, build_deployment, model_source
from kvpilot.operator.manifests.objects import (INSTANCE_LABEL, Owner, build_configmap, build_pdb, build_service,
                                      effective_settings, endpoint_url, selector_labels, selector_string)
from kvpilot.operator.api.fields import DEFAULT_IMAGE
from kvpilot.operator.api.spec import LLMDeploymentSpec
from kvpilot.operator.api.status import Effective

OWNER = Owner("tiny", "demo", "uid-1")
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "llmdeployment-tiny.yaml"


def spec(**over) -> LLMDeploymentSpec:
    body = {"model": {"source": "builtin:tiny"}}
    for k, v in over.items():
        body[k] = v
    return LLMDeploymentSpec.model_validate(body)


def pod(d: dict) -> dict:
    return d["spec"]["template"]["spec"]


def container(d: dict) -> dict:
    return pod(d)["containers"][0]


def test_defaults_for_everything_but_the_model():
    s = spec()
    # No image in the stored object: the operator's own, filled in at each reconcile.
    assert s.engine.image is None and container(build_deployment(OWNER, s, 1))["image"] == DEFAULT_IMAGE
    assert (s.engine.max_num_seqs, s.engine.max_model_len, s.replicas) == (64, 2048, 1)
    assert s.autotune.mode == "Off" and s.service.port == 8000


def test_example_parses():
    doc = yaml.safe_load(EXAMPLE.read_text())
    s = LLMDeploymentSpec.model_validate(doc["spec"])
    assert s.model.source == "builtin:tiny" and s.resources.gpus == 0 and s.engine.kv_cache_memory == "16Mi"


def test_labels_and_owner_reference_on_every_object():
    s = spec(replicas=2)
    objs = [build_configmap(OWNER, effective_settings(s)), build_deployment(OWNER, s, 2),
            build_service(OWNER, s), build_pdb(OWNER, 2)]
    for o in objs:
        meta = o["metadata"]
        assert meta["namespace"] == "demo"
        assert meta["labels"][INSTANCE_LABEL] == "tiny"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvpilot-operator"
        (ref,) = meta["ownerReferences"]
        assert ref == {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment", "name": "tiny",
                       "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}
    d = objs[1]
    assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    assert selector_string(OWNER) == "app.kubernetes.io/name=kvpilot-engine,serving.kvpilot.dev/llmdeployment=tiny"


def test_configmap_holds_the_tuning_file():
    cm = build_configmap(OWNER, Effective(max_num_seqs=24, max_model_len=1024, replicas=1))
    assert cm["metadata"]["name"] == "tiny-tuning"
    assert json.loads(cm["data"]["tuning.json"]) == {"max_num_seqs": 24, "max_model_len": 1024}


def test_effective_uses_tuned_values_only_in_auto_mode_and_clamps_to_bounds():
    bounds = {"maxNumSeqs": {"min": 4, "max": 32}, "maxModelLen": {"min": 256, "max": 1024}}
    tuned = Effective(max_num_seqs=100, max_model_len=100, replicas=9)
    auto = spec(engine={"maxNumSeqs": 16, "maxModelLen": 512}, autotune={"mode": "Auto", **bounds},
                autoscaling={"minReplicas": 1, "maxReplicas": 3})
    assert effective_settings(auto, tuned) == Effective(max_num_seqs=32, max_model_len=256, replicas=3)
    rec = auto.model_copy(update={"autotune": auto.autotune.model_copy(update={"mode": "Recommend"})})
    assert effective_settings(rec, tuned) == Effective(max_num_seqs=16, max_model_len=512, replicas=1)


def test_deployment_runs_kvpilot_serve_with_the_tuning_file():
    s = spec(engine={"kvCacheMemory": "64Mi", "maxNumBatchedTokens": 1024, "enablePrefixCaching": False})
    c = container(build_deployment(OWNER, s, 1))
    assert c["command"] == ["kvpilot", "serve"]
    args = c["args"]
    flag = lambda f: args[args.index(f) + 1]  # noqa: E731
    assert flag("--model") == "builtin:tiny" and flag("--served-model-name") == "tiny"
    # every address, loopback included: kubectl port-forward connects to localhost in the pod
    assert flag("--host") == "0.0.0.0" and flag("--port") == "8000"
    assert flag("--tuning-file") == "/etc/kvpilot/tuning.json"
    assert flag("--kv-cache-memory") == "64Mi" and flag("--max-num-batched-tokens") == "1024"
    assert "--no-enable-prefix-caching" in args and "--max-num-seqs" not in args
    assert "$(" not in " ".join(args)  # no reference to expand: the key's is the only one there is
    mount = next(m for m in c["volumeMounts"] if m["name"] == "tuning")
    assert mount == {"name": "tuning", "mountPath": "/etc/kvpilot", "readOnly": True}  # no subPath: live updates
    vol = next(v for v in pod(build_deployment(OWNER, s, 1))["volumes"] if v["name"] == "tuning")
    assert vol["configMap"]["name"] == "tiny-tuning"


def test_a_cpu_engine_without_a_kv_size_gets_one_that_fits_its_pod():
    def kv(**over):
        args = container(build_deployment(OWNER, spec(**over), 1))["args"]
        return args[args.index("--kv-cache-memory") + 1] if "--kv-cache-memory" in args else None
    mib = 2**20
    assert kv() == str(1024 * mib)  # 2Gi pod: the engine's own 1Gi cap
    assert kv(resources={"memory": "1Gi"}) == str(256 * mib)  # 1Gi less 768Mi for the process
    assert kv(resources={"memory": "512Mi"}) == str(64 * mib)  # never below 64Mi
    assert kv(resources={"memory": "1Gi"}, engine={"kvCacheMemory": "8Mi"}) == "8Mi"  # the spec's own wins
    assert kv(resources={"memory": "2T"}) == str(2**30)  # never above 1Gi
    gpu = {"gpus": 1, "memory": "1Gi"}
    assert kv(resources=gpu) is None  # a GPU engine sizes its cache from the device
    assert kv(engine={"gpuMemoryUtilization": 0.5}, resources=gpu) is None


def test_security_context_is_restricted():
    d = build_deployment(OWNER, spec(), 1)
    p, c = pod(d), container(d)
    assert p["automountServiceAccountToken"] is False
    assert p["securityContext"]["runAsNonRoot"] is True
    assert p["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] is True
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    assert {"/scratch", "/var/cache/kvpilot"} <= writable
    # Every writable volume is bounded (no writer fills the node's disk) and requested.
    assert {v["name"]: v["emptyDir"] for v in p["volumes"] if v["name"] in ("tmp", "cache")} == {
        "tmp": {"sizeLimit": "4Gi"}, "cache": {"sizeLimit": "2Gi"}}
    assert c["resources"]["requests"]["ephemeral-storage"] == str(2**30)


def test_pods_keep_serving_until_endpoints_drop_them():
    d = build_deployment(OWNER, spec(), 1)
    hook = container(d)["lifecycle"]["preStop"]
    assert hook == {"sleep": {"seconds": 5}}  # the sleep action: no shell needed in the image
    # The grace period covers preStop, the whole drain and the exit, whatever the drain.
    for drain in (0, 30, 120):
        d = build_deployment(OWNER, spec(engine={"drainTimeoutSeconds": drain}), 1)
        args = container(d)["args"]
        assert args[args.index("--drain-timeout") + 1] == str(drain)
        assert pod(d)["terminationGracePeriodSeconds"] == 5 + drain + 5


def test_probes_startup_is_generous():
    c = container(build_deployment(OWNER, spec(), 1))
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # Liveness differs from readiness (kube-score pod-probes-identical): a draining pod, or
    # one whose engine failed (it exits by itself), is taken out of endpoints, not killed.
    assert c["livenessProbe"]["httpGet"] == {"path": "/version", "port": "http"}
    s = c["startupProbe"]
    assert s["periodSeconds"] * s["failureThreshold"] >= 600


def test_resources_cpu_and_gpu():
    c = container(build_deployment(OWNER, spec(resources={"cpu": "500m", "memory": "1Gi"}), 1))
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi", "ephemeral-storage": str(2**30)},
                              "limits": {"memory": "1Gi"}}
    g = build_deployment(OWNER, spec(resources={"gpus": 2, "cpu": 4, "memory": "32Gi"},
                                     engine={"gpuMemoryUtilization": 0.85}), 1)
    c = container(g)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" == c["resources"]["requests"]["nvidia.com/gpu"]
    assert c["resources"]["requests"]["cpu"] == "4"
    assert c["args"][c["args"].index("--gpu-memory-utilization") + 1] == "0.85"
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod(g)["volumes"])


def test_rollout_strategy_never_surges_gpu_pods():
    gpu = build_deployment(OWNER, spec(resources={"gpus": 1}), 3)["spec"]["strategy"]
    assert gpu == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    cpu = build_deployment(OWNER, spec(), 3)["spec"]["strategy"]
    assert cpu == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def test_prometheus_scrape_annotations():
    ann = build_deployment(OWNER, spec(), 1)["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8000"
    assert ann["prometheus.io/path"] == "/metrics"


def test_live_settings_do_not_change_the_pod_template_others_do():
    base = build_deployment(OWNER, spec(engine={"maxNumSeqs": 16, "maxModelLen": 512}), 1)
    live = build_deployment(OWNER, spec(engine={"maxNumSeqs": 48, "maxModelLen": 1024}), 1)
    assert base["spec"]["template"] == live["spec"]["template"]
    other = build_deployment(OWNER, spec(engine={"maxNumSeqs": 16, "maxModelLen": 512, "blockSize": 32}), 1)
    h = lambda d: d["spec"]["template"]["metadata"]["annotations"][HASH_ANNOTATION]  # noqa: E731
    assert h(base) != h(other)
    assert build_deployment(OWNER, spec(), 3)["spec"]["template"] == build_deployment(OWNER, spec(), 1)["spec"]["template"]


@pytest.mark.parametrize("source,arg,claim", [
    ("builtin:tiny", "builtin:tiny", None),
    ("pvc://weights/llama/8b", "/models/llama/8b", "weights"),
    ("pvc://weights", "/models", "weights"),
    ("file:///opt/models/m", "/opt/models/m", None),
    ("/opt/models/m", "/opt/models/m", None),
])
def test_model_sources(source, arg, claim):
    model_arg, volume, mount = model_source(source)
    assert model_arg == arg
    if claim is None:
        assert volume is None and mount is None
    else:
        assert volume == {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
        c = container(build_deployment(OWNER, spec(model={"source": source}), 1))
        assert mount in c["volumeMounts"]


def test_api_key_from_secret():
    s = spec(engine={"apiKeySecretRef": {"name": "llm-key", "key": "token"}})
    c = container(build_deployment(OWNER, s, 1))
    assert c["args"][c["args"].index("--api-key") + 1] == "$(KVPILOT_API_KEY)"
    env = next(e for e in c["env"] if e["name"] == "KVPILOT_API_KEY")
    assert env["valueFrom"] == {"secretKeyRef": {"name": "llm-key", "key": "token"}}


def test_scheduling_passes_through():
    s = spec(scheduling={"nodeSelector": {"gpu": "h100"}, "affinity": {"nodeAffinity": {"x": 1}},
                         "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]})
    p = pod(build_deployment(OWNER, s, 1))
    assert p["nodeSelector"] == {"gpu": "h100"} and p["affinity"] == {"nodeAffinity": {"x": 1}}
    assert p["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    # Without one, a soft anti-affinity spreads the replicas over nodes.
    (term,) = pod(build_deployment(OWNER, spec(), 3))["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {"topologyKey": "kubernetes.io/hostname",
                                       "labelSelector": {"matchLabels": selector_labels(OWNER)}}


def test_service_and_endpoint():
    s = spec(service={"port": 9000})
    svc = build_service(OWNER, s)
    assert svc["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
    assert svc["spec"]["selector"] == build_deployment(OWNER, s, 1)["spec"]["selector"]["matchLabels"]
    assert endpoint_url(OWNER, s) == "http://tiny.demo.svc:9000"


def test_pdb_only_for_more_than_one_replica():
    assert build_pdb(OWNER, 1) is None and build_pdb(OWNER, 0) is None
    pdb = build_pdb(OWNER, 2)
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1


def test_a_new_operator_image_rolls_pods_that_name_none_and_not_those_that_do():
    """helm upgrade changes --engine-image: the pod template (and its hash) follow for every
    LLMDeployment without spec.engine.image; one that names its own stays as it was."""
    from kvpilot.operator.reconcile import parse_spec
    from kvpilot.operator.api.defaults import OperatorDefaults

    def template(spec: dict, image: str) -> dict:
        s = parse_spec({"spec": spec}, OperatorDefaults(engine_image=image))
        return build_deployment(OWNER, s, 1)["spec"]["template"]

    plain, pinned = {"model": {"source": "builtin:tiny"}}, {"model": {"source": "builtin:tiny"},
                                                            "engine": {"image": "mine:1"}}
    old, new = template(plain, "kvpilot/engine:0.1.0"), template(plain, "kvpilot/engine:0.2.0")
    assert new["spec"]["containers"][0]["image"] == "kvpilot/engine:0.2.0"
    assert old["metadata"]["annotations"][HASH_ANNOTATION] != new["metadata"]["annotations"][HASH_ANNOTATION]
    assert template(pinned, "kvpilot/engine:0.1.0") == template(pinned, "kvpilot/engine:0.2.0")
