"""The local Kubernetes itself: Deployments of containers (from kvpilot's
image) become Available on the kubelet node, Services get EndpointSlices and
route through their ClusterIP and DNS name, the Prometheus Operator's Prometheus scrapes
the pods a PodMonitor selects, scaling
and deletion start and stop containers, ConfigMap changes reach mounted files,
Pod Security and a read-only root are enforced, and `kubectl logs`, `exec`
and `port-forward` work."""
from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from localcluster import monitoring
from localcluster.build import KVPILOT_OPERATOR_IMAGE

pytestmark = pytest.mark.e2e

SERVER = (Path(__file__).parent / "testapps" / "echo_server.py").read_text()
# What Pod Security `restricted` asks of every pod and container.
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}}


def echo_manifests(ns: str, replicas: int = 2) -> list[dict]:
    labels = {"app": "echo"}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "echo-app", "namespace": ns},
         "data": {"echo_server.py": SERVER}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "echo-message", "namespace": ns},
         "data": {"message": "hello v1"}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "echo", "namespace": ns},
         "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": {
             "metadata": {"labels": labels},
             "spec": {"terminationGracePeriodSeconds": 5, "securityContext": POD_SECURITY, "containers": [{
                 "name": "echo", "image": KVPILOT_OPERATOR_IMAGE,  # it has a Python
                 "command": ["python", "/app/echo_server.py"],
                 "args": ["--host", "0.0.0.0", "--port", "8080"],
                 "env": [
                     {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                     {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                     {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                     {"name": "MESSAGE_FILE", "value": "/etc/echo/message"}],
                 "ports": [{"name": "http", "containerPort": 8080}],
                 "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"},
                                    "periodSeconds": 1, "failureThreshold": 1},
                 "securityContext": CONTAINER_SECURITY,
                 "volumeMounts": [{"name": "app", "mountPath": "/app", "readOnly": True},
                                  {"name": "message", "mountPath": "/etc/echo"},
                                  {"name": "scratch", "mountPath": "/scratch"}]}],
                 "volumes": [{"name": "app", "configMap": {"name": "echo-app"}},
                             {"name": "message", "configMap": {"name": "echo-message"}},
                             {"name": "scratch", "emptyDir": {}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo", "namespace": ns},
         "spec": {"selector": labels, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}},
        # Selected by the cluster's Prometheus through the label kube-prometheus-stack selects on.
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
         "metadata": {"name": "echo", "namespace": ns, "labels": monitoring.SELECT_LABELS},
         "spec": {"selector": {"matchLabels": labels},
                  "podMetricsEndpoints": [{"port": "http", "path": "/metrics",
                                           "relabelings": [{"action": "labelmap",
                                                            "regex": "__meta_kubernetes_pod_label_(.+)"}]}]}},
    ]


@pytest.fixture(scope="module")
def echo(cluster):
    """A namespace with the echo Deployment (2 replicas) and its Service."""
    ns = f"echo-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(ns)
    cluster.apply(echo_manifests(ns))
    yield ns
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def ready_pods(kube, ns: str) -> list[dict]:
    pods = kube.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": "app=echo"})["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))]


def deployment_available(kube, ns: str, replicas: int) -> bool:
    d = kube.get(f"/apis/apps/v1/namespaces/{ns}/deployments/echo")
    st = d.get("status", {})
    available = any(c["type"] == "Available" and c["status"] == "True" for c in st.get("conditions", []))
    return available and st.get("readyReplicas") == replicas and st.get("replicas") == replicas \
        and st.get("updatedReplicas") == replicas


def test_node_is_ready_and_reports_the_version(cluster):
    from kubernetes import client
    api = client.CoreV1Api(cluster.api_client())
    node = api.read_node("kvpilot-node")
    assert node.status.capacity["nvidia.com/gpu"] == "8"
    assert any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == cluster.state["version"]
    assert version["clientVersion"]["gitVersion"] == cluster.state["version"]


def test_an_image_containerd_lost_is_imported_again(cluster):
    """The kubelet removes unused images when the disk runs short; no registry here can give
    them back, so the cluster re-imports what it started with (CoreDNS's small image here)."""
    from localcluster.kubeletnode import COREDNS_IMAGE_REPO, Ctr
    ctr = Ctr(Path(cluster.state["containerd_bin"]), Path(cluster.state["containerd_socket"]))
    (ref,) = [r for r, _ in cluster.state["images"] if r.startswith(COREDNS_IMAGE_REPO + ":")]
    assert KVPILOT_OPERATOR_IMAGE in {r for r, _ in cluster.state["images"]}
    before = ctr.image_digests()[ref]
    assert cluster.restore_images() == []  # nothing lost, nothing imported
    ctr.run("images", "rm", ref)
    assert ref not in ctr.image_digests()
    assert cluster.restore_images() == [ref]
    assert ctr.image_digests()[ref] == before


def test_deployment_becomes_available(cluster, echo, wait_for):
    kube = cluster.kube()
    wait_for(lambda: deployment_available(kube, echo, 2), timeout=90, what="Deployment echo Available")
    pods = ready_pods(kube, echo)
    assert len(pods) == 2
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 2, "each pod has its own address"
    for p in pods:
        cs = p["status"]["containerStatuses"][0]
        assert cs["ready"] and cs["started"] and "running" in cs["state"]
        assert {c["type"] for c in p["status"]["conditions"]} >= {"Ready", "ContainersReady",
                                                                   "Initialized", "PodScheduled"}
    rs = kube.get(f"/apis/apps/v1/namespaces/{echo}/replicasets")["items"]
    assert len(rs) == 1 and rs[0]["metadata"]["ownerReferences"][0]["name"] == "echo"


def test_service_endpointslice_lists_the_pods_and_each_answers(cluster, echo, wait_for):
    kube = cluster.kube()
    wait_for(lambda: deployment_available(kube, echo, 2), timeout=90, what="Deployment echo Available")
    pod_ips = {p["status"]["podIP"]: p["metadata"]["name"] for p in ready_pods(kube, echo)}

    def slice_ips():
        slices = kube.get(f"/apis/discovery.k8s.io/v1/namespaces/{echo}/endpointslices",
                          params={"labelSelector": "kubernetes.io/service-name=echo"})["items"]
        ready = {a for s in slices for e in s.get("endpoints") or []
                 if e.get("conditions", {}).get("ready") for a in e["addresses"]}
        return ready == set(pod_ips) and ready

    wait_for(slice_ips, timeout=60, what="EndpointSlice with both pod addresses")
    for ip, name in pod_ips.items():
        r = httpx.get(f"http://{ip}:8080/", timeout=5)
        assert r.status_code == 200
        assert r.json() == {"pod": name, "namespace": echo, "ip": ip}


def test_prometheus_scrapes_each_pod(cluster, echo, wait_for):
    kube = cluster.kube()
    wait_for(lambda: deployment_available(kube, echo, 2), timeout=90, what="Deployment echo Available")
    names = {p["metadata"]["name"] for p in ready_pods(kube, echo)}

    def series():
        r = httpx.get(f"{cluster.prometheus_url}/api/v1/query",
                      params={"query": f'e2e_echo_requests_total{{namespace="{echo}"}}'}, timeout=5)
        result = r.json()["data"]["result"]
        pods = {s["metric"]["pod"] for s in result}
        return pods == names and result

    result = wait_for(series, timeout=60, interval=0.5, what="one series per echo pod in Prometheus")
    assert len(result) == 2
    for s in result:
        assert s["metric"]["app"] == "echo"  # pod labels are carried over
        assert s["metric"]["namespace"] == echo


def test_configmap_change_reaches_the_mounted_file(cluster, echo, wait_for):
    kube = cluster.kube()
    wait_for(lambda: deployment_available(kube, echo, 2), timeout=90, what="Deployment echo Available")
    ip = ready_pods(kube, echo)[0]["status"]["podIP"]
    assert httpx.get(f"http://{ip}:8080/message", timeout=5).text == "hello v1"
    kube.merge_patch(f"/api/v1/namespaces/{echo}/configmaps/echo-message", {"data": {"message": "hello v2"}})
    wait_for(lambda: httpx.get(f"http://{ip}:8080/message", timeout=5).text == "hello v2",
             timeout=30, what="the new ConfigMap content at /etc/echo/message")


def test_scaling_starts_and_stops_processes(cluster, echo, wait_for):
    kube = cluster.kube()
    wait_for(lambda: deployment_available(kube, echo, 2), timeout=90, what="Deployment echo Available")
    cluster.kubectl("scale", "deployment/echo", "-n", echo, "--replicas=3")
    wait_for(lambda: deployment_available(kube, echo, 3), timeout=60, what="3 ready replicas")
    wait_for(lambda: len(cluster.pod_processes(echo)) == 3, timeout=30, what="3 pod processes")
    cluster.kubectl("scale", "deployment/echo", "-n", echo, "--replicas=1")
    wait_for(lambda: deployment_available(kube, echo, 1), timeout=60, what="1 ready replica")
    wait_for(lambda: len(cluster.pod_processes(echo)) == 1, timeout=30, what="1 pod process")
    wait_for(lambda: len(kube.get(f"/api/v1/namespaces/{echo}/pods")["items"]) == 1, timeout=30,
             what="the removed pods to be deleted")


def test_env_args_and_kubectl_logs(cluster, namespace, wait_for):
    """valueFrom (fieldRef, secretKeyRef, configMapKeyRef), $(VAR) expansion,
    emptyDir, crash restarts with back-off, and `kubectl logs`."""
    cluster.apply([
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "api"}, "stringData": {"key": "s3cret"}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"mode": "fast"}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "printer"}, "spec": {
            "securityContext": POD_SECURITY, "containers": [{
                "name": "main", "image": KVPILOT_OPERATOR_IMAGE,
                "command": ["sh", "-c"],
                "args": ["echo key=$API_KEY mode=$MODE greeting='$(GREETING)' ns=$(NS) "
                         "path=$(which python) && touch /scratch/mark && ls /scratch && exit 3"],
                "env": [{"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}},
                        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
                        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                        {"name": "GREETING", "value": "hi-$(NS)"}],
                "securityContext": CONTAINER_SECURITY,
                "volumeMounts": [{"name": "work", "mountPath": "/scratch"}]}],
            "volumes": [{"name": "work", "emptyDir": {}}]}},
    ], namespace=namespace)
    kube = cluster.kube()

    def restarted_twice():
        p = kube.get(f"/api/v1/namespaces/{namespace}/pods/printer")
        cs = (p.get("status", {}).get("containerStatuses") or [{}])[0]
        last = cs.get("lastState", {}).get("terminated")
        return cs.get("restartCount", 0) >= 2 and last and last["exitCode"] == 3 and cs

    wait_for(restarted_twice, timeout=60, what="the crashing container to be restarted twice")
    out = cluster.kubectl("logs", "printer", "-n", namespace).stdout
    assert f"key=s3cret mode=fast greeting=hi-{namespace} ns={namespace} path=/opt/kvpilot/bin/python" in out
    assert "mark" in out


def test_a_prestop_sleep_keeps_a_deleted_pod_serving(cluster, namespace, wait_for):
    """The kubelet runs a preStop sleep before SIGTERM, within the grace period: the pod
    answers for those seconds after its deletion, then stops."""
    echo_pod = echo_manifests(namespace)[2]["spec"]["template"]
    spec = json.loads(json.dumps(echo_pod["spec"]))
    spec["containers"][0]["lifecycle"] = {"preStop": {"sleep": {"seconds": 3}}}
    cluster.apply([{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "echo-app"},
                    "data": {"echo_server.py": SERVER}},
                   {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "echo-message"},
                    "data": {"message": "hello"}},
                   {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "slow-stop", "labels": {"app": "x"}},
                    "spec": spec}], namespace=namespace)
    kube = cluster.kube()

    def ready_ip():
        p = kube.get(f"/api/v1/namespaces/{namespace}/pods/slow-stop")
        ok = any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
        return ok and p["status"]["podIP"]

    ip = wait_for(ready_ip, timeout=60, what="pod slow-stop Ready")
    cluster.kubectl("delete", "pod", "slow-stop", "-n", namespace, "--wait=false")
    deleted = time.monotonic()

    def answers() -> bool:
        try:
            return httpx.get(f"http://{ip}:8080/", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    last_answer = deleted

    def stopped() -> bool:
        nonlocal last_answer
        if answers():
            last_answer = time.monotonic()
            return False
        return True

    wait_for(stopped, timeout=30, what="the pod to stop after its preStop sleep")
    # Without the hook the server stops within a moment of SIGTERM.
    assert last_answer - deleted >= 2.0


def one_shot_pod(name: str, script: str, **container) -> dict:
    """A restricted-compliant pod that runs a Python snippet once."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "restartPolicy": "Never", "securityContext": POD_SECURITY,
        "containers": [{"name": "main", "image": KVPILOT_OPERATOR_IMAGE, "command": ["python", "-c", script],
                        "securityContext": CONTAINER_SECURITY, **container}]}}


def finished(kube, namespace: str, name: str):
    p = kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
    phase = p.get("status", {}).get("phase")
    return phase if phase in ("Succeeded", "Failed") else None


def test_the_root_filesystem_is_read_only(cluster, namespace, wait_for):
    """A write outside the pod's volumes fails as on any cluster; the volume takes it."""
    script = ("import pathlib, sys\n"
              "pathlib.Path('/scratch/ok').write_text('x')\n"
              "try:\n    pathlib.Path('/opt/kvpilot/x').write_text('x')\n"
              "except OSError as e:\n    print('refused:', e.strerror); sys.exit(7)\n")
    pod = one_shot_pod("writer", script, volumeMounts=[{"name": "s", "mountPath": "/scratch"}])
    pod["spec"]["volumes"] = [{"name": "s", "emptyDir": {}}]
    cluster.apply(pod, namespace=namespace)
    kube = cluster.kube()
    assert wait_for(lambda: finished(kube, namespace, "writer"), timeout=60,
                    what="the writer pod to finish") == "Failed"
    cs = kube.get(f"/api/v1/namespaces/{namespace}/pods/writer")["status"]["containerStatuses"][0]
    assert cs["state"]["terminated"]["exitCode"] == 7
    assert "refused: Read-only file system" in cluster.kubectl("logs", "writer", "-n", namespace).stdout


def test_restricted_pod_security_is_enforced(cluster, namespace):
    """The namespaces tests use enforce `restricted`: a pod asking for root is refused."""
    pod = one_shot_pod("root", "print(1)")
    pod["spec"]["securityContext"] = {"runAsUser": 0}
    r = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod), check=False)
    assert r.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in r.stderr
    labels = cluster.kube().get(f"/api/v1/namespaces/{namespace}")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


def test_a_service_answers_on_its_cluster_ip_and_dns_name_from_another_pod(cluster, echo, wait_for):
    kube = cluster.kube()
    wait_for(lambda: ready_pods(kube, echo), timeout=90, what="a ready echo pod")
    ip = kube.get(f"/api/v1/namespaces/{echo}/services/echo")["spec"]["clusterIP"]
    script = ("import json, urllib.request\n"
              f"for url in ('http://{ip}/', 'http://echo/', 'http://echo.{echo}.svc.cluster.local/'):\n"
              "    print(url, json.load(urllib.request.urlopen(url, timeout=5))['namespace'])\n")
    cluster.apply(one_shot_pod("client", script), namespace=echo)
    assert wait_for(lambda: finished(kube, echo, "client"), timeout=60,
                    what="the client pod to finish") == "Succeeded"
    out = cluster.kubectl("logs", "client", "-n", echo).stdout
    for url in (f"http://{ip}/", "http://echo/", f"http://echo.{echo}.svc.cluster.local/"):
        assert f"{url} {echo}" in out


def test_kubectl_exec_and_port_forward(cluster, echo, wait_for):
    kube = cluster.kube()
    wait_for(lambda: ready_pods(kube, echo), timeout=90, what="a ready echo pod")
    pod = ready_pods(kube, echo)[0]["metadata"]["name"]
    out = cluster.kubectl("exec", pod, "-n", echo, "--", "kvpilot", "--version").stdout
    assert out.strip().startswith("kvpilot ")
    who = cluster.kubectl("exec", pod, "-n", echo, "--", "python", "-c",
                          "import os; print(os.getuid(), os.getpid())").stdout.split()
    assert who[0] == "65532"
    pf = subprocess.Popen([str(cluster.bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}",
                           "port-forward", "-n", echo, f"pod/{pod}", ":8080"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = pf.stdout.readline()  # "Forwarding from 127.0.0.1:PORT -> 8080"
        port = int(line.split("127.0.0.1:")[1].split()[0])
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).json()["pod"] == pod
    finally:
        pf.terminate()
        pf.wait(timeout=10)


def test_deleting_the_deployment_cascades(cluster, echo, wait_for):
    kube = cluster.kube()
    wait_for(lambda: deployment_available(kube, echo, 1), timeout=90, what="Deployment echo Available")
    assert cluster.pod_processes(echo)
    cluster.kubectl("delete", "deployment", "echo", "-n", echo, "--wait=false")
    wait_for(lambda: not kube.get(f"/apis/apps/v1/namespaces/{echo}/replicasets")["items"], timeout=60,
             what="the ReplicaSet to be garbage-collected")
    wait_for(lambda: not kube.get(f"/api/v1/namespaces/{echo}/pods",
                                  params={"labelSelector": "app=echo"})["items"], timeout=60,
             what="the pods to be deleted")
    wait_for(lambda: not cluster.pod_processes(echo), timeout=30, what="the pod processes to end")
