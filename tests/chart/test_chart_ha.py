"""The chart's HA and security parts, rendered by helm (built from its Go module, as in
tests/chart/test_chart.py): two replicas with leader election, a PodDisruptionBudget, the
Lease RBAC limited by name, the downward-API identity, soft anti-affinity, RBAC with
no wildcards anywhere, and the optional engine NetworkPolicy (rendering only: the
local cluster's CNI does not enforce NetworkPolicy)."""
from __future__ import annotations

import subprocess

import pytest
from test_chart import CHART, by_kind, helm, render  # noqa: F401  (helm: the fixture)

from kvpilot.operator.manifests.objects import HTTP_PORT, Owner, selector_labels

NS = "kvpilot-system"


def pod_spec(kinds) -> dict:
    return kinds["Deployment"][0]["spec"]["template"]["spec"]


def test_two_replicas_with_leader_election_by_default(helm):  # noqa: F811
    kinds = by_kind(render(helm))
    dep = kinds["Deployment"][0]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    c = pod_spec(kinds)["containers"][0]
    assert "--leader-elect" in c["args"]
    assert "--leader-election-id=kvpilot" in c["args"]
    assert "--leader-election-namespace=$(POD_NAMESPACE)" in c["args"]
    assert {"--leader-elect-lease-duration=8", "--leader-elect-renew-deadline=6",
            "--leader-elect-retry-period=1"} <= set(c["args"])
    env = {e["name"]: e.get("valueFrom") for e in c["env"]}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    (pdb,) = kinds["PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    (term,) = pod_spec(kinds)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_lease_rbac_is_limited_to_the_named_lease(helm):  # noqa: F811
    kinds = by_kind(render(helm))
    (role,) = [r for r in kinds["Role"] if r["metadata"]["name"] == "kvpilot-leader-election"]
    assert role["metadata"]["namespace"] == NS
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["kvpilot"],
         "verbs": ["get", "update", "patch"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]}]
    (binding,) = [b for b in kinds["RoleBinding"] if b["metadata"]["name"] == "kvpilot-leader-election"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvpilot", "namespace": NS}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_one_replica_without_election_is_recreate_and_has_no_pdb(helm):  # noqa: F811
    kinds = by_kind(render(helm, "--set", "replicaCount=1", "--set", "leaderElection.enabled=false"))
    assert "PodDisruptionBudget" not in kinds and "Role" not in kinds
    dep = kinds["Deployment"][0]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    assert "--leader-elect" not in pod_spec(kinds)["containers"][0]["args"]
    assert "affinity" not in pod_spec(kinds)


def test_several_replicas_without_election_are_refused(helm):  # noqa: F811
    proc = subprocess.run([helm, "template", "x", str(CHART), "--kube-version", "1.31.0", "--set", "leaderElection.enabled=false"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "leaderElection.enabled" in proc.stderr


@pytest.mark.parametrize("args", [[], ["--set", "watchNamespaces={team-a}"],
                                  ["--set", "networkPolicy.enabled=true", "--set", "networkPolicy.namespaces={a}"]])
def test_no_wildcards_in_any_rbac_rule(helm, args):  # noqa: F811
    docs = render(helm, *args)
    rules = [r for d in docs if d["kind"] in ("Role", "ClusterRole") for r in d["rules"]]
    assert rules
    for r in rules:
        for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
            assert not any("*" in v for v in r.get(key, [])), r
        assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(r["verbs"]), r


def test_network_policy_is_off_by_default(helm):  # noqa: F811
    assert "NetworkPolicy" not in by_kind(render(helm))


def test_network_policy_admits_only_clients_and_prometheus_to_engine_pods(helm):  # noqa: F811
    kinds = by_kind(render(helm, "--set", "networkPolicy.enabled=true", "--set", "networkPolicy.namespaces={a,b}"))
    pols = engine_policies(kinds["NetworkPolicy"])
    assert sorted(p["metadata"]["namespace"] for p in pols) == ["a", "b"]
    spec = pols[0]["spec"]
    # selects the pods the operator makes, whatever the LLMDeployment's name
    engine = selector_labels(Owner("any", "a", "u"))
    assert spec["podSelector"]["matchLabels"].items() <= engine.items()
    assert spec["policyTypes"] == ["Ingress"]
    clients, prometheus, _gateway = spec["ingress"]  # the chart's gateway: tests/chart/test_chart_gateway.py
    assert clients["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvpilot-gateway"}}}]
    assert prometheus["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    for rule in spec["ingress"]:
        assert rule["ports"] == [{"protocol": "TCP", "port": "http"}]  # the engine's one port, named http
    assert HTTP_PORT == 8000


def test_network_policy_takes_the_watched_namespaces_and_custom_peers(helm):  # noqa: F811
    kinds = by_kind(render(helm, "--set", "networkPolicy.enabled=true", "--set", "watchNamespaces={team-a}",
                           "--set-json", 'networkPolicy.clients=[{"namespaceSelector":{"matchLabels":{"team":"x"}}}]',
                           "--set-json", "networkPolicy.prometheus=[]", "--set", "gateway.enabled=false"))
    (pol,) = engine_policies(kinds["NetworkPolicy"])
    assert pol["metadata"]["namespace"] == "team-a"
    assert pol["spec"]["ingress"] == [{"from": [{"namespaceSelector": {"matchLabels": {"team": "x"}}}],
                                       "ports": [{"protocol": "TCP", "port": "http"}]}]


def engine_policies(pols: list[dict]) -> list[dict]:
    return [p for p in pols if p["metadata"]["name"].endswith("-engine")]


def test_network_policy_admits_only_prometheus_to_the_operator_and_only_its_port_to_the_gateway(helm):  # noqa: F811
    """kube-score pod-networkpolicy and checkov CKV2_K8S_6: the operator's and the gateway's
    pods have a policy too (issue 39)."""
    docs = render(helm, "--set", "networkPolicy.enabled=true", "--set", "networkPolicy.namespaces={a}")
    pols = {p["metadata"]["name"]: p for p in by_kind(docs)["NetworkPolicy"]}
    assert set(pols) == {"kvpilot-engine", "kvpilot-operator", "kvpilot-gateway"}
    deployments = {d["metadata"]["name"]: d for d in by_kind(docs)["Deployment"]}
    for name in ("kvpilot", "kvpilot-gateway"):  # each policy selects its Deployment's pods
        pol = pols["kvpilot-operator" if name == "kvpilot" else name]
        assert pol["metadata"]["namespace"] == "kvpilot-system" and pol["spec"]["policyTypes"] == ["Ingress"]
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert pol["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    (scrape,) = pols["kvpilot-operator"]["spec"]["ingress"]
    assert scrape["ports"] == [{"protocol": "TCP", "port": "metrics"}] and scrape["from"][0]["podSelector"]
    assert pols["kvpilot-gateway"]["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": "http"}]}]
    docs = render(helm, "--set", "networkPolicy.enabled=true", "--set", "networkPolicy.namespaces={a}",
                  "--set-json", "networkPolicy.prometheus=[]",
                  "--set-json", 'networkPolicy.gatewayClients=[{"namespaceSelector":{}}]')
    pols = {p["metadata"]["name"]: p for p in by_kind(docs)["NetworkPolicy"]}
    assert pols["kvpilot-operator"]["spec"]["ingress"] == []  # nothing at all
    assert pols["kvpilot-gateway"]["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": "http"}],
                                                          "from": [{"namespaceSelector": {}}]}]


def test_network_policy_without_namespaces_is_refused(helm):  # noqa: F811
    proc = subprocess.run([helm, "template", "x", str(CHART), "--kube-version", "1.31.0", "--set", "networkPolicy.enabled=true"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "networkPolicy.namespaces" in proc.stderr
