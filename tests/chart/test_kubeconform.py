"""Issue 39's target: `kubeconform -strict` on every rendered object: the chart with every
option on, the engine pods (and their Service, ConfigMap, PDB) the operator builds, and
the examples. kubeconform is built from its Go module (e2e/build-kubeconform.sh); its
schemas are generated here from the Kubernetes OpenAPI spec in the cached k8s.io module and
from kvpilot's CRD (tests/k8s_schemas.py). The Prometheus Operator's and Gateway API's
kinds have no local schema: they are skipped, and named below."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from go_tools import built_tool
from k8s_schemas import swagger_path, write_crd_schema, write_k8s_schemas
from kvpilot.operator.manifests.deployment import build_deployment
from kvpilot.operator.manifests.objects import Owner, build_configmap, build_pdb, build_service, effective_settings
from kvpilot.operator.reconcile import parse_spec
from kvpilot.operator.api.defaults import OperatorDefaults
from test_chart import CHART, KUBE_VERSION, ROOT, helm  # noqa: F401  (helm: the fixture)

NO_LOCAL_SCHEMA = ["ServiceMonitor", "PodMonitor", "PrometheusRule", "HTTPRoute"]
EVERY_OPTION = ["--include-crds", "--api-versions", "monitoring.coreos.com/v1",
                "--set", "networkPolicy.enabled=true", "--set-json", 'watchNamespaces=["demo"]',
                "--set", "kubeconfigSecret=kc", "--set-json", 'imagePullSecrets=[{"name":"regcred"}]',
                "--set", "serviceMonitor.labels.release=kps", "--set", "podMonitor.labels.release=kps",
                "--set", "prometheusRule.labels.release=kps", "--set", "grafanaDashboards.labels.release=kps",
                "--set", "gateway.ingress.enabled=true", "--set", "gateway.ingress.hosts={llm.example.com}",
                "--set", "gateway.httpRoute.enabled=true", "--set-json", 'gateway.httpRoute.parentRefs=[{"name":"gw"}]',
                "--set", "gateway.replicaCount=2", "--set", "gateway.service.type=LoadBalancer",
                "--set-json", 'gateway.tenants=[{"name":"a","apiKeySecret":{"name":"s"},"tokensPerWindow":100}]',
                "--set", "engine.serviceAccountName=llm", "--set", "engine.securityContext.runAsNonRoot=true"]
SPECS = [
    {"model": {"source": "builtin:tiny"}, "engine": {"kvCacheMemory": "64Mi", "apiKeySecretRef": {"name": "k", "key": "k"}}},
    {"model": {"source": "hf://Qwen/Qwen2.5-0.5B", "hf": {"tokenSecretRef": {"name": "hf"}}}, "resources": {"gpus": 2},
     "pod": {"imagePullSecrets": ["regcred"], "labels": {"team": "a"}, "annotations": {"x.io/y": "z"}},
     "scheduling": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}], "priorityClassName": "high",
                    "nodeSelector": {"pool": "gpu"}}},
    {"model": {"source": "s3://bucket/m", "s3": {"credentialsSecretRef": {"name": "s3"}}, "cache": {"sizeLimit": "40Gi"}}},
    {"model": {"source": "pvc://models/llama"}, "replicas": 3, "resources": {"gpus": 1, "gpuResourceName": "amd.com/gpu"}},
    {"model": {}, "engine": {"simulate": {"accelerator": "h100-80gb", "model": "llama-3.1-8b"}}, "resources": {"gpus": 4}},
]


@pytest.fixture(scope="module")
def kubeconform(tmp_path_factory, helm):  # noqa: F811
    swagger = swagger_path()
    if swagger is None:
        pytest.skip("the k8s.io/kubernetes module source (the e2e build's) is not in Go's module cache")
    binary = built_tool("build-kubeconform.sh", "kubeconform")
    schemas = tmp_path_factory.mktemp("schemas")
    return binary, schemas, swagger


def engine_objects() -> list[dict]:
    out = []
    for i, body in enumerate(SPECS):
        owner = Owner(f"m{i}", "demo", f"uid-{i}")
        spec = parse_spec({"spec": body}, OperatorDefaults())
        eff = effective_settings(spec, None)
        out += [build_deployment(owner, spec, eff.replicas, "a" * 40, 3 * 10**9), build_service(owner, spec),
                build_configmap(owner, eff)]
        pdb = build_pdb(owner, eff.replicas)
        if pdb is not None:
            out.append(pdb)
    return out


def test_every_rendered_object_passes_kubeconform_strict(kubeconform, helm, tmp_path):  # noqa: F811
    binary, schemas, swagger = kubeconform
    chart = subprocess.run([helm, "template", "kvpilot", str(CHART), "-n", "kvpilot-system",
                            "--kube-version", KUBE_VERSION, *EVERY_OPTION],
                           capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(chart) if d] + engine_objects()
    docs += [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples").glob("*.yaml"))]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Ingress", "NetworkPolicy", "CustomResourceDefinition", "LLMDeployment"} <= kinds
    write_k8s_schemas(swagger, schemas, kinds)
    write_crd_schema(schemas)
    manifests = tmp_path / "all.yaml"
    manifests.write_text(yaml.safe_dump_all(docs))
    proc = subprocess.run([binary, "-strict", "-summary", "-output", "text", "-skip", ",".join(NO_LOCAL_SCHEMA),
                           "-schema-location", str(schemas) + "/{{ .ResourceKind }}{{ .KindSuffix }}.json",
                           str(manifests)], capture_output=True, text=True)
    print(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"Valid: {len(docs) - sum(d['kind'] in NO_LOCAL_SCHEMA for d in docs)}" in proc.stdout, proc.stdout


def test_kubeconform_strict_can_fail(kubeconform, tmp_path):
    """The same schemas refuse an unknown field and a wrong type (so the test above can fail)."""
    binary, schemas, swagger = kubeconform
    write_k8s_schemas(swagger, schemas, {"Deployment"})
    write_crd_schema(schemas)
    bad = build_deployment(Owner("m", "demo", "u"), parse_spec({"spec": SPECS[0]}, OperatorDefaults()), 1)
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    llmd = {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "x", "namespace": "demo"}, "spec": {"model": {"source": "builtin:tiny"}, "replicas": "3"}}
    for doc in (bad, llmd):
        f = tmp_path / "bad.yaml"
        f.write_text(yaml.safe_dump(doc))
        proc = subprocess.run([binary, "-strict", "-schema-location",
                               str(schemas) + "/{{ .ResourceKind }}{{ .KindSuffix }}.json", str(f)],
                              capture_output=True, text=True)
        assert proc.returncode != 0, doc["kind"]
