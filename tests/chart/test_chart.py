"""The Helm chart: `helm lint` and `helm template` with the helm built from its
Go module (e2e/build-helm.sh, cached outside the repository)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvpilot.operator.api.crd import build_crd

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvpilot"
KUBE_VERSION = "1.31.0"  # the chart's kubeVersion is >=1.30; helm template assumes 1.20 otherwise


@pytest.fixture(scope="module")
def helm() -> str:
    if shutil.which("go") is None:
        pytest.skip("Go is not installed: cannot build helm from its module")
    proc = subprocess.run([str(ROOT / "e2e" / "build-helm.sh")], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"building helm failed (outside the repository?):\n{proc.stderr[-2000:]}")
    return proc.stdout.strip().splitlines()[-1]


def render(helm: str, *args: str) -> list[dict]:
    out = subprocess.run([helm, "template", "kvpilot", str(CHART), "-n", "kvpilot-system", "--kube-version", KUBE_VERSION, *args],
                         capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def without_gateway(docs: list[dict]) -> list[dict]:
    """The operator's objects: the gateway's (tests/chart/test_chart_gateway.py) left out."""
    return [d for d in docs if (d["metadata"].get("labels") or {}).get("app.kubernetes.io/component") != "gateway"]


def test_helm_lint(helm):
    proc = subprocess.run([helm, "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_default_render(helm):
    kinds = by_kind(without_gateway(render(helm)))
    assert sorted(kinds) == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "PodDisruptionBudget",
                             "Role", "RoleBinding", "Service", "ServiceAccount"]  # Role: the leader-election Lease
    (dep,) = kinds["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"][0] == "kvpilot" and "operator" in c["command"]
    assert c["image"] == "kvpilot/operator:0.1.0"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    # ephemeral storage requested and bounded, the scratch volume too (kube-score); no CPU limit
    assert c["resources"]["requests"]["ephemeral-storage"] == "128Mi" and "cpu" not in c["resources"]["limits"]
    assert c["resources"]["limits"]["ephemeral-storage"] == "2Gi"
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"] and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["serviceAccountName"] == kinds["ServiceAccount"][0]["metadata"]["name"]
    assert dep["spec"]["replicas"] == 2  # leader + standby (tests/chart/test_chart_ha.py)


def test_rbac_is_least_privilege(helm):
    (role,) = by_kind(without_gateway(render(helm)))["ClusterRole"]
    for r in role["rules"]:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in r[field], r
        assert not {"escalate", "bind", "impersonate", "deletecollection", "update"} & set(r["verbs"]), r
    perms = {(g, res): set(r["verbs"]) for r in role["rules"] for g in r["apiGroups"] for res in r["resources"]}
    assert perms[("serving.kvpilot.dev", "llmdeployments/status")] == {"get", "patch"}
    assert perms[("", "secrets")] == {"get"}  # only to check the API key's Secret exists
    assert "delete" not in perms[("apps", "deployments")]  # owner references clean up
    # the autotuner: replicas only through the scale subresource; HPAs only looked at; Events
    assert perms[("serving.kvpilot.dev", "llmdeployments/scale")] == {"patch"}
    assert perms[("autoscaling", "horizontalpodautoscalers")] == {"list"}
    assert "create" in perms[("", "events")]


def test_namespaced_install_uses_roles(helm):
    kinds = by_kind(without_gateway(render(helm, "--set", "watchNamespaces={team-a,team-b}")))
    assert "ClusterRole" not in kinds
    watched = [r for r in kinds["Role"] if not r["metadata"]["name"].endswith("-leader-election")]
    assert sorted(r["metadata"]["namespace"] for r in watched) == ["team-a", "team-b"]
    args = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_monitoring_objects_only_with_prometheus_operator(helm):
    assert "ServiceMonitor" not in by_kind(render(helm))
    kinds = by_kind(render(helm, "--api-versions", "monitoring.coreos.com/v1"))
    assert "ServiceMonitor" in kinds and "PrometheusRule" in kinds


def test_kubeconfig_secret_mode(helm):
    dep = by_kind(render(helm, "--set", "kubeconfigSecret=kc"))["Deployment"][0]
    pod = dep["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert {"name": "KUBECONFIG", "value": "/etc/kvpilot-kubeconfig/kubeconfig"} in pod["containers"][0]["env"]


def test_values_schema_rejects_bad_values(helm):
    proc = subprocess.run([helm, "template", "x", str(CHART), "--kube-version", KUBE_VERSION, "--set", "metricsPort=notaport"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "metricsPort" in proc.stderr


def test_chart_installs_the_generated_crd(helm):
    docs = render(helm, "--include-crds")
    (crd,) = by_kind(docs)["CustomResourceDefinition"]
    assert crd == build_crd()


def test_max_concurrent_reconciles_value(helm):
    def args(*set_args: str) -> list[str]:
        (dep,) = by_kind(without_gateway(render(helm, *set_args)))["Deployment"]
        return dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--max-concurrent-reconciles=8" in args()
    assert "--max-concurrent-reconciles=16" in args("--set", "maxConcurrentReconciles=16")
    with pytest.raises(subprocess.CalledProcessError):
        render(helm, "--set", "maxConcurrentReconciles=0")  # the values schema refuses it


def test_kube_prometheus_stack_values_and_engine_defaults(helm):
    """Issue 39: every monitoring object carries the stack's release label, a PodMonitor
    selects the engine pods, `global` is accepted (as a parent chart passes it), and the
    engine values reach the operator as the flags it reads."""
    import json

    docs = render(helm, "--api-versions", "monitoring.coreos.com/v1", "--set", "global.imageRegistry=x",
                  "--set", "serviceMonitor.labels.release=kps", "--set", "podMonitor.labels.release=kps",
                  "--set", "prometheusRule.labels.release=kps", "--set", "grafanaDashboards.labels.release=kps",
                  "--set", "image.tag=0.2.0", "--set", "engine.serviceAccountName=llm",
                  "--set", "engine.gpuResourceName=amd.com/gpu", "--set", "engine.imagePullSecrets[0]=regcred")
    kinds = by_kind(docs)
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert kinds[kind] and all(d["metadata"]["labels"]["release"] == "kps" for d in kinds[kind]), kind
    (pm,) = kinds["PodMonitor"]
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kvpilot-engine"}
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    rules = [r for g in kinds["PrometheusRule"][0]["spec"]["groups"] for r in g["rules"]]
    assert all(r["annotations"]["runbook_url"].endswith("#" + r["alert"].lower()) for r in rules)
    op = next(d for d in without_gateway(docs) if d["kind"] == "Deployment")
    args = op["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--engine-image=kvpilot/engine:0.2.0" in args and "--gpu-resource-name=amd.com/gpu" in args
    defaults = json.loads(next(a for a in args if a.startswith("--engine-defaults="))[len("--engine-defaults="):])
    assert defaults["pod"]["serviceAccountName"] == "llm" and defaults["pod"]["imagePullSecrets"] == ["regcred"]
    from kvpilot.operator.api.defaults import OperatorDefaults
    OperatorDefaults.model_validate(defaults)  # what the operator reads, valid
