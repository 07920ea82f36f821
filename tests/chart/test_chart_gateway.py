"""The chart's `kvpilot gateway`, rendered by helm (built from its Go module, as in
tests/chart/test_chart.py): its Deployment (flags from values, probes, security context),
Service, read-only RBAC (cluster-wide or per watched namespace), the tenants file and the
Secrets its API keys come from, the NetworkPolicy rule that lets it reach engine pods,
monitoring, and the values schema's checks."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml
from test_chart import CHART, helm, render  # noqa: F401  (helm: the fixture)

NS = "kvpilot-system"
GW = "kvpilot-gateway"  # <fullname>-gateway for the release "kvpilot"
KEYS = "/etc/kvpilot/gateway/keys"
GATEWAY_RULES = [  # reads what it routes to (LLMDeployments, their pods); writes only a scale from zero
    {"apiGroups": ["serving.kvpilot.dev"], "resources": ["llmdeployments"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["serving.kvpilot.dev"], "resources": ["llmdeployments/scale"], "verbs": ["get", "patch"]}]

TWO_TENANTS = [
    {"name": "search", "apiKeySecret": {"name": "search-key"}, "models": ["llama-*"],
     "requestsPerWindow": 600, "tokensPerWindow": 200000, "priority": 10},
    {"name": "batch", "apiKeySecret": {"name": "batch-creds", "key": "token"}},
]


def named(docs: list[dict], kind: str, name: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]


def gateway(docs: list[dict]) -> dict:
    (dep,) = named(docs, "Deployment", GW)
    return dep


def container(docs: list[dict]) -> dict:
    (c,) = gateway(docs)["spec"]["template"]["spec"]["containers"]
    return c


def with_tenants(helm: str, tenants: list[dict], *args: str) -> list[dict]:  # noqa: F811
    return render(helm, "--set-json", "gateway.tenants=" + json.dumps(tenants), *args)


def template_fails(helm: str, *args: str) -> str:  # noqa: F811
    proc = subprocess.run([helm, "template", "x", str(CHART), "--kube-version", "1.31.0", *args], capture_output=True, text=True)
    assert proc.returncode != 0, proc.stdout
    return proc.stderr


def test_default_gateway_deployment(helm):  # noqa: F811
    docs = render(helm)
    dep = gateway(docs)
    assert dep["metadata"]["namespace"] == NS
    assert dep["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
    assert dep["spec"]["replicas"] == 1
    sel = dep["spec"]["selector"]["matchLabels"]
    assert sel == {"app.kubernetes.io/name": "kvpilot-gateway", "app.kubernetes.io/instance": "kvpilot",
                   "app.kubernetes.io/component": "gateway"}
    template = dep["spec"]["template"]
    assert sel.items() <= template["metadata"]["labels"].items()
    assert not any(k.startswith("checksum/") for k in template["metadata"].get("annotations", {}))  # no tenants
    c = container(docs)
    (operator,) = named(docs, "Deployment", "kvpilot")
    assert c["image"] == operator["spec"]["template"]["spec"]["containers"][0]["image"] == "kvpilot/operator:0.1.0"
    assert c["command"] == ["kvpilot", "--log-level", "INFO", "gateway"]
    assert c["args"] == ["--port=8000", "--routing=prefix", "--load-factor=1.25", "--per-replica-concurrency=256",
                         "--queue-timeout=60", "--scale-from-zero-timeout=300", "--retries=2", "--refresh-interval=1", "--scrape-interval=1",
                         "--no-log-prompts", "--first-byte-timeout=30", "--response-timeout=600",
                         "--stream-idle-timeout=120", "--write-timeout=30", "--metrics-access=auto"]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"] and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    pod = template["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 65532
    # ephemeral storage requested and bounded, the scratch volume too (kube-score); no CPU limit
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi", "ephemeral-storage": "128Mi"},
                              "limits": {"memory": "512Mi", "ephemeral-storage": "2Gi"}}
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]
    assert "KUBECONFIG" not in {e["name"] for e in c["env"]} and pod["automountServiceAccountToken"] is True
    # its own service account, not the operator's
    (sa,) = named(docs, "ServiceAccount", GW)
    assert pod["serviceAccountName"] == sa["metadata"]["name"] != operator["spec"]["template"]["spec"][
        "serviceAccountName"]
    assert "affinity" not in pod and not named(docs, "PodDisruptionBudget", GW)  # one replica
    assert not named(docs, "ConfigMap", f"{GW}-tenants")


def test_metrics_key_and_engine_key_come_from_secrets(helm):  # noqa: F811
    docs = render(helm, "--api-versions", "monitoring.coreos.com/v1", "--set-json",
                  'gateway.metricsKeySecret={"name": "gw-metrics", "key": "token"}', "--set-json",
                  'gateway.engineApiKeySecret={"name": "engine-key"}')
    c = container(docs)
    assert "--metrics-key-file=/etc/kvpilot/gateway/metrics-key/token" in c["args"]
    assert "--engine-api-key-file=/etc/kvpilot/gateway/engine-key/api-key" in c["args"]
    volumes = {v["name"]: v for v in gateway(docs)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["metrics-key"]["secret"] == {"secretName": "gw-metrics", "items": [
        {"key": "token", "path": "token"}], "defaultMode": 288}
    assert volumes["engine-key"]["secret"]["secretName"] == "engine-key"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["metrics-key"] == "/etc/kvpilot/gateway/metrics-key"
    (sm,) = named(docs, "ServiceMonitor", GW)
    assert sm["spec"]["endpoints"][0]["bearerTokenSecret"] == {"name": "gw-metrics", "key": "token"}
    assert "metricsAccess" in template_fails(helm, "--set", "gateway.metricsAccess=everyone")


def test_gateway_service(helm):  # noqa: F811
    docs = render(helm)
    (svc,) = named(docs, "Service", GW)
    assert svc["metadata"]["namespace"] == NS
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert svc["spec"]["selector"] == gateway(docs)["spec"]["selector"]["matchLabels"]
    (svc,) = named(render(helm, "--set", "gateway.service.type=LoadBalancer", "--set", "gateway.service.port=443",
                          "--set", "gateway.port=9000"), "Service", GW)
    assert svc["spec"]["type"] == "LoadBalancer" and svc["spec"]["ports"][0]["port"] == 443


def test_flags_follow_values(helm):  # noqa: F811
    docs = render(helm, "--set", "gateway.routing=least-loaded", "--set-json", "gateway.loadFactor=1.5",
                  "--set", "gateway.perReplicaConcurrency=64", "--set", "gateway.queueTimeout=5",
                  "--set", "gateway.retries=0", "--set", "gateway.logPrompts=true", "--set", "gateway.port=9000",
                  "--set", "logLevel=DEBUG")
    c = container(docs)
    assert c["command"] == ["kvpilot", "--log-level", "DEBUG", "gateway"]
    assert c["args"] == ["--port=9000", "--routing=least-loaded", "--load-factor=1.5",
                         "--per-replica-concurrency=64", "--queue-timeout=5", "--scale-from-zero-timeout=300", "--retries=0", "--refresh-interval=1",
                         "--scrape-interval=1", "--log-prompts", "--first-byte-timeout=30", "--response-timeout=600",
                         "--stream-idle-timeout=120", "--write-timeout=30", "--metrics-access=auto"]
    assert c["ports"][0]["containerPort"] == 9000


def test_cluster_wide_rbac_reads_and_scales_from_zero(helm):  # noqa: F811
    docs = render(helm)
    (role,) = named(docs, "ClusterRole", GW)
    assert role["rules"] == GATEWAY_RULES
    (binding,) = named(docs, "ClusterRoleBinding", GW)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": GW}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": GW, "namespace": NS}]
    assert not named(docs, "Role", GW)


def test_watch_namespaces_give_roles_and_namespace_flags(helm):  # noqa: F811
    docs = render(helm, "--set", "watchNamespaces={team-a,team-b}")
    assert not named(docs, "ClusterRole", GW) and not named(docs, "ClusterRoleBinding", GW)
    roles, bindings = named(docs, "Role", GW), named(docs, "RoleBinding", GW)
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert all(r["rules"] == GATEWAY_RULES for r in roles)
    for b in bindings:
        assert b["roleRef"]["kind"] == "Role" and b["roleRef"]["name"] == GW
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": GW, "namespace": NS}]
    args = container(docs)["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]


def test_kubeconfig_secret_mode(helm):  # noqa: F811
    docs = render(helm, "--set", "kubeconfigSecret=kc")
    pod = gateway(docs)["spec"]["template"]["spec"]
    c = container(docs)
    assert pod["automountServiceAccountToken"] is False
    assert {"name": "KUBECONFIG", "value": "/etc/kvpilot-kubeconfig/kubeconfig"} in c["env"]
    assert {"name": "kubeconfig", "mountPath": "/etc/kvpilot-kubeconfig", "readOnly": True} in c["volumeMounts"]
    assert {"name": "kubeconfig", "secret": {"secretName": "kc"}} in pod["volumes"]


def test_two_tenants_file_and_key_mounts(helm):  # noqa: F811
    docs = with_tenants(helm, TWO_TENANTS, "--set", "gateway.rateLimitWindow=30")
    (cm,) = named(docs, "ConfigMap", f"{GW}-tenants")
    assert cm["metadata"]["namespace"] == NS
    tenants_file = yaml.safe_load(cm["data"]["tenants.yaml"])
    assert tenants_file == {"window": 30, "tenants": [
        {"name": "search", "apiKeyFiles": [f"{KEYS}/search/api-key"], "models": ["llama-*"],
         "requestsPerWindow": 600, "tokensPerWindow": 200000, "priority": 10},
        {"name": "batch", "apiKeyFiles": [f"{KEYS}/batch/token"]}]}
    # the gateway's own reader accepts it
    from kvpilot.operator.gateway.tenants import TenantsFile
    TenantsFile.model_validate(tenants_file)

    c = container(docs)
    assert "--tenants-file=/etc/kvpilot/gateway/tenants.yaml" in c["args"]
    pod = gateway(docs)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    tenants_mount = mounts["/etc/kvpilot/gateway/tenants.yaml"]
    assert tenants_mount["readOnly"] and tenants_mount["subPath"] == "tenants.yaml"
    assert volumes[tenants_mount["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    for tenant, secret, key in (("search", "search-key", "api-key"), ("batch", "batch-creds", "token")):
        m = mounts[f"{KEYS}/{tenant}"]
        assert m["readOnly"] is True
        src = volumes[m["name"]]["secret"]
        assert src["secretName"] == secret and src["items"] == [{"key": key, "path": key}]
        # the file the tenants file names is the one this mount makes
        (spec,) = [t for t in tenants_file["tenants"] if t["name"] == tenant]
        assert spec["apiKeyFiles"] == [f"{m['mountPath']}/{src['items'][0]['path']}"]
        assert src["defaultMode"] == 0o440
    assert pod["securityContext"]["fsGroup"] == 65532  # the group may read the 0440 key files


def test_tenants_checksum_rolls_the_pods(helm):  # noqa: F811
    def checksum(tenants: list[dict]) -> str:
        return gateway(with_tenants(helm, tenants))["spec"]["template"]["metadata"]["annotations"]["checksum/tenants"]
    first = checksum(TWO_TENANTS)
    assert first == checksum(TWO_TENANTS)  # stable
    assert first != checksum([dict(TWO_TENANTS[0], priority=11), TWO_TENANTS[1]])
    assert first != checksum(TWO_TENANTS[:1])
    assert first != checksum([TWO_TENANTS[0], dict(TWO_TENANTS[1], apiKeySecret={"name": "batch-creds"})])


def test_network_policy_admits_the_gateway_from_its_namespace(helm):  # noqa: F811
    docs = render(helm, "--set", "networkPolicy.enabled=true", "--set", "networkPolicy.namespaces={a}")
    (pol,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-engine")]
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NS}},
            "podSelector": {"matchLabels": gateway(docs)["spec"]["selector"]["matchLabels"]}}
    (rule,) = [r for r in pol["spec"]["ingress"] if peer in r["from"]]
    assert rule["ports"] == [{"protocol": "TCP", "port": "http"}]  # the engine's port 8000
    # the peer selects the gateway's pods in the namespace they run in
    assert peer["podSelector"]["matchLabels"].items() <= gateway(docs)["spec"]["template"]["metadata"][
        "labels"].items()
    assert gateway(docs)["metadata"]["namespace"] == NS


def test_monitoring_and_pdb(helm):  # noqa: F811
    assert not named(render(helm), "ServiceMonitor", GW)
    docs = render(helm, "--api-versions", "monitoring.coreos.com/v1")
    (sm,) = named(docs, "ServiceMonitor", GW)
    (svc,) = named(docs, "Service", GW)
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    off = render(helm, "--api-versions", "monitoring.coreos.com/v1", "--set", "serviceMonitor.enabled=false")
    assert not named(off, "ServiceMonitor", GW)
    docs = render(helm, "--set", "gateway.replicaCount=3")
    (pdb,) = named(docs, "PodDisruptionBudget", GW)
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == gateway(docs)["spec"]["selector"]["matchLabels"]
    (term,) = gateway(docs)["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == pdb["spec"]["selector"]["matchLabels"]


def test_disabled_gateway_renders_nothing(helm):  # noqa: F811
    args = ("--set", "gateway.enabled=false", "--api-versions", "monitoring.coreos.com/v1",
            "--set", "gateway.replicaCount=3", "--set", "networkPolicy.enabled=true",
            "--set", "networkPolicy.namespaces={a}")
    docs = render(helm, *args) + with_tenants(helm, TWO_TENANTS, *args)
    assert docs
    for d in docs:
        assert "gateway" not in d["metadata"]["name"], d["kind"]
        assert (d["metadata"].get("labels") or {}).get("app.kubernetes.io/name") != "kvpilot-gateway", d["kind"]
    (pol,) = [d for d in render(helm, *args) if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-engine")]
    assert len(pol["spec"]["ingress"]) == 2  # clients and Prometheus only


def test_helm_lint_with_tenants(helm, tmp_path):  # noqa: F811
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"gateway": {"tenants": TWO_TENANTS, "replicaCount": 2},
                                      "watchNamespaces": ["team-a"]}))
    proc = subprocess.run([helm, "lint", "--strict", str(CHART), "-f", str(values)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("args, field", [
    (("--set", "gateway.routing=random"), "/gateway/routing"),
    (("--set-json", 'gateway.tenants=[{"name":"Bad_Name","apiKeySecret":{"name":"s"}}]'), "/gateway/tenants/0/name"),
    (("--set-json", 'gateway.tenants=[{"name":"-x","apiKeySecret":{"name":"s"}}]'), "/gateway/tenants/0/name"),
    (("--set-json", 'gateway.tenants=[{"name":"a"}]'), "apiKeySecret"),
    (("--set-json", 'gateway.tenants=[{"name":"a","apiKeySecret":{"name":"s"},"priority":"high"}]'),
     "/gateway/tenants/0/priority"),
    (("--set-json", "gateway.loadFactor=0.5"), "/gateway/loadFactor"),
    (("--set", "gateway.perReplicaConcurrency=0"), "/gateway/perReplicaConcurrency"),
    (("--set", "gateway.queueTimeout=0"), "/gateway/queueTimeout"),
    (("--set", "gateway.retries=-1"), "/gateway/retries"),
    (("--set", "gateway.port=70000"), "/gateway/port"),
    (("--set", "gateway.unknown=1"), "unknown"),
])
def test_values_schema_rejects_bad_gateway_values(helm, args, field):  # noqa: F811
    assert field in template_fails(helm, *args)


def test_duplicate_tenant_names_are_refused(helm):  # noqa: F811
    err = template_fails(helm, "--set-json",
                         "gateway.tenants=" + json.dumps([TWO_TENANTS[0], dict(TWO_TENANTS[1], name="search")]))
    assert "search" in err and "twice" in err


def test_notes_say_how_to_reach_the_gateway(helm, tmp_path):  # noqa: F811
    # NOTES.txt is rendered only by install/upgrade (which need a cluster): a copy of the chart
    # includes it in a ConfigMap that `helm template` shows.
    chart = tmp_path / "kvpilot"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "notes-probe.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data:\n  notes: {{ include (print $.Template.BasePath "/NOTES.txt") . | quote }}\n')

    def notes(*args: str) -> str:
        out = subprocess.run([helm, "template", "kvpilot", str(chart), "-n", NS, "--kube-version", "1.31.0", "--show-only",
                              "templates/notes-probe.yaml", *args], capture_output=True, text=True, check=True)
        return yaml.safe_load(out.stdout)["data"]["notes"]
    text = notes()
    assert f"kubectl port-forward -n {NS} svc/{GW} 8000:80" in text
    assert "curl http://localhost:8000/v1/models" in text and "Authorization" not in text
    text = notes("--set-json", 'gateway.tenants=[{"name":"a","apiKeySecret":{"name":"s"}}]')
    assert 'curl http://localhost:8000/v1/models -H "Authorization: Bearer $API_KEY"' in text
    assert "gateway" not in notes("--set", "gateway.enabled=false")


def test_the_gateway_is_exposable_through_an_ingress_or_an_httproute(helm):  # noqa: F811
    docs = render(helm, "--set", "gateway.ingress.enabled=true", "--set", "gateway.ingress.className=nginx",
                  "--set", "gateway.ingress.hosts={llm.example.com}", "--set", "gateway.httpRoute.enabled=true",
                  "--set-json", 'gateway.httpRoute.parentRefs=[{"name":"public","namespace":"gw"}]',
                  "--set", "gateway.httpRoute.timeout=600s", "--set", "gateway.service.type=LoadBalancer")
    (ing,) = [d for d in docs if d["kind"] == "Ingress"]
    (route,) = [d for d in docs if d["kind"] == "HTTPRoute"]
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == GW]
    assert svc["spec"]["type"] == "LoadBalancer" and ing["spec"]["ingressClassName"] == "nginx"
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    assert rule["http"]["paths"][0]["backend"]["service"] == {"name": GW, "port": {"name": "http"}}
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gw"}]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": GW, "port": 80}]
    assert route["spec"]["rules"][0]["timeouts"] == {"request": "600s"}
    assert not [d for d in render(helm) if d["kind"] in ("Ingress", "HTTPRoute")]  # off by default
    proc = subprocess.run([helm, "template", "x", str(CHART), "--kube-version", "1.31.0",
                           "--set", "gateway.httpRoute.enabled=true"], capture_output=True, text=True)
    assert proc.returncode != 0 and "gateway.httpRoute.parentRefs" in proc.stderr
