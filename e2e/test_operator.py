"""The operator end to end on the local control plane: the CRD and the Helm
chart (rendered by helm built from its Go module) installed into the cluster,
the operator running from the chart's Deployment as a container of kvpilot's
image on the kubelet node (in-cluster config from its projected ServiceAccount
token, so with exactly the chart's RBAC), in namespaces that enforce Pod
Security `restricted`, and examples/llmdeployment-tiny.yaml served by real
`kvpilot serve` containers."""
from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.e2e
ENGINE_IMAGE = True  # real engine pods (builtin:tiny): conftest builds the engine image

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvpilot"
EXAMPLE = ROOT / "examples" / "llmdeployment-tiny.yaml"
OPERATOR_NS = "kvpilot-system"
RELEASE = "kvpilot"
LLMD = "/apis/serving.kvpilot.dev/v1alpha1/namespaces/{ns}/llmdeployments"
READY_TIMEOUT = 420


# --- helpers -------------------------------------------------------------------
def helm_binary() -> str:
    proc = subprocess.run([str(ROOT / "e2e" / "build-helm.sh")], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"building helm failed:\n{proc.stderr[-2000:]}")
    return proc.stdout.strip().splitlines()[-1]


def llmd(kube, ns: str, name: str = "tiny") -> dict | None:
    return kube.get(LLMD.format(ns=ns) + f"/{name}", ok404=True)


def condition(obj: dict | None, type_: str) -> dict:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


def is_ready(kube, ns: str) -> dict | None:
    obj = llmd(kube, ns)
    c = condition(obj, "Ready")
    if c.get("status") == "True" and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]:
        return obj
    return None


def engine_pods(kube, ns: str, ready_only: bool = True) -> list[dict]:
    pods = kube.get(f"/api/v1/namespaces/{ns}/pods",
                    params={"labelSelector": "serving.kvpilot.dev/llmdeployment=tiny"})["items"]
    pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    if ready_only:
        pods = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                       for c in p.get("status", {}).get("conditions", []))]
    return pods


def pod_identity(p: dict) -> tuple:
    cs = p["status"]["containerStatuses"][0]
    return p["metadata"]["uid"], p["status"]["startTime"], cs["restartCount"]


def gauge(pod: dict, name: str) -> float | None:
    text = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else None


def tuning(kube, ns: str) -> str:
    cm = kube.get(f"/api/v1/namespaces/{ns}/configmaps/tiny-tuning", ok404=True)
    return (cm or {}).get("data", {}).get("tuning.json", "")


def operator_ready(kube) -> list[dict]:
    pods = kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/pods",
                    params={"labelSelector": "app.kubernetes.io/name=kvpilot-operator"})["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))]


def earlier_install_gone(kube) -> bool:
    """No pod of an earlier install is left in OPERATOR_NS, or the namespace is gone: a
    reinstall deletes the chart's objects and keeps the namespace (installed_operator)."""
    ns = f"/api/v1/namespaces/{OPERATOR_NS}"
    return kube.get(ns, ok404=True) is None or not kube.get(f"{ns}/pods")["items"]


def operator_leader(kube) -> dict:
    """The Ready operator pod that holds the leader-election Lease (the chart runs two)."""
    lease = kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{OPERATOR_NS}/leases/{RELEASE}", ok404=True)
    holder = ((lease or {}).get("spec") or {}).get("holderIdentity")
    (op,) = [p for p in operator_ready(kube) if p["metadata"]["name"] == holder]
    return op


def diagnose(cluster, ns: str) -> str:
    r = cluster.kubectl("get", "llmd,deploy,pods,events", "-n", ns, "-o", "wide", check=False)
    o = cluster.kubectl("logs", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=kvpilot-operator", "--prefix",
                        "--tail=40", check=False)
    # Disk or memory pressure on the node explains pods that cannot start or vanish.
    n = cluster.kubectl("get", "nodes", "-o", "jsonpath={range .items[*].status.conditions[*]}"
                        '{.type}={.status} {.message}{"\\n"}{end}', check=False)
    free = shutil.disk_usage(cluster.workdir).free / 2**30
    return (f"{r.stdout}{r.stderr}\n--- operator ---\n{o.stdout}{o.stderr}"
            f"\n--- node conditions ({free:.1f} GiB free on the test disk) ---\n{n.stdout}{n.stderr}")


# --- fixtures --------------------------------------------------------------------
@contextlib.contextmanager
def installed_operator(cluster, wait_for, resync_interval: float = 10, values: dict | None = None):
    """The chart installed (CRD, RBAC, ServiceAccount, operator Deployment); the operator pod
    Ready; yields the cluster's Kube. Shared with e2e/test_autotune.py. `values`: more
    chart values (--set NAME=VALUE)."""
    helm = helm_binary()
    # The gateway only where a test or benchmark asks for it: elsewhere its per-second listing
    # and scraping would be one more load on this small host's timing-sensitive tests.
    values = {"gateway.enabled": "false", **(values or {})}
    extra = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
    out = subprocess.run([helm, "template", RELEASE, str(CHART), "-n", OPERATOR_NS, "--include-crds",
                          "--kube-version", "1.31.0", *cluster.helm_args(),
                          "--set", f"resyncInterval={resync_interval}", "--set", "logLevel=INFO", *extra],
                         capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    rest = [d for d in docs if d["kind"] != "CustomResourceDefinition"]
    cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(crds))
    kube = cluster.kube()
    # Polled rather than `kubectl wait`, which fails outright on a CRD created a moment ago
    # whose status has no conditions yet.
    wait_for(lambda: condition(kube.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                                        "llmdeployments.serving.kvpilot.dev", ok404=True),
                               "Established").get("status") == "True",
             timeout=60, what="the CRD to be Established")
    # An earlier module's install may still be going away. helm's (test_upgrade) deletes the
    # namespace, which must finish terminating. This function's deletes only its objects: a
    # namespace takes the namespace controller 5 s at least, then its pods' grace, about
    # 12 s of every install here against 2-3 s for the pods alone.
    wait_for(lambda: kube.get(f"/api/v1/namespaces/{OPERATOR_NS}", ok404=True) is None
             or kube.get(f"/api/v1/namespaces/{OPERATOR_NS}")["status"].get("phase") != "Terminating",
             timeout=120, what=f"namespace {OPERATOR_NS} to finish terminating")
    cluster.create_namespace(OPERATOR_NS)
    wait_for(lambda: earlier_install_gone(kube), timeout=120, what="the last install's operator pods to be gone")
    # A leader killed without releasing its Lease would hold the new pods back until it expires.
    cluster.kubectl("delete", "lease", "--all", "-n", OPERATOR_NS, check=False)
    cluster.restore_images()
    cluster.apply(rest)
    try:
        wait_for(lambda: operator_ready(kube), timeout=180, what="the operator pod to be Ready")
    except TimeoutError:
        raise AssertionError(diagnose(cluster, OPERATOR_NS)) from None
    try:
        yield kube
    finally:
        cluster.kubectl("delete", "--wait=false", "--ignore-not-found", "-f", "-", input=yaml.safe_dump_all(rest),
                        check=False)


@pytest.fixture(scope="module")
def operator(shared_operator):
    return shared_operator.get(resync_interval=1)  # conftest's tuned_operator, without Prometheus


@pytest.fixture(scope="module")
def demo(cluster, operator, wait_for):
    ns = f"demo-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(ns)
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["namespace"] = ns
    cluster.apply(doc)
    try:
        wait_for(lambda: is_ready(operator, ns) and engine_pods(operator, ns), timeout=READY_TIMEOUT,
                 interval=1, what="the tiny LLMDeployment to be Ready")
    except TimeoutError:
        raise AssertionError(diagnose(cluster, ns)) from None
    yield ns
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def patch_spec(cluster, ns: str, patch: dict) -> None:
    cluster.kubectl("patch", "llmd", "tiny", "-n", ns, "--type=merge", "-p", yaml.safe_dump({"spec": patch}))


# --- tests (in order, on one deployment) -------------------------------------------
def test_example_serves_completions(cluster, operator, demo):
    obj = llmd(operator, demo)
    assert obj["status"]["endpoint"] == f"http://tiny.{demo}.svc:8000"
    assert obj["status"]["effective"]["maxNumSeqs"] == 16
    (pod,) = engine_pods(operator, demo)
    r = httpx.post(f"http://{pod['status']['podIP']}:8000/v1/completions",
                   json={"model": "tiny", "prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] is not None
    svc = operator.get(f"/api/v1/namespaces/{demo}/services/tiny")
    assert svc["spec"]["selector"]["serving.kvpilot.dev/llmdeployment"] == "tiny"


def test_operator_and_engine_run_from_the_image_under_restricted(cluster, operator, demo):
    """Both namespaces enforce `restricted` (admission let these pods in); each container is
    kvpilot's image (the operator's without torch, the real engine's with it), and `kvpilot
    serve` is the engine container's PID 1, so the kubelet's SIGTERM reaches it (no shell in
    between)."""
    op = operator_leader(operator)
    (pod,) = engine_pods(operator, demo)
    for p, image in ((op, "kvpilot/operator:0.1.0"), (pod, "kvpilot/engine:0.1.0")):
        labels = operator.get(f"/api/v1/namespaces/{p['metadata']['namespace']}")["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
        assert p["spec"]["containers"][0]["image"] == image
    name, ns = pod["metadata"]["name"], pod["metadata"]["namespace"]
    version = cluster.kubectl("exec", name, "-n", ns, "--", "kvpilot", "--version").stdout
    assert version.strip() == "kvpilot 0.1.0"
    pid1 = cluster.kubectl("exec", name, "-n", ns, "--", "python", "-c",
                           "print(open('/proc/1/cmdline').read().split(chr(0)))").stdout
    assert "'serve'" in pid1 and "kvpilot" in pid1, pid1


def test_a_deleted_engine_pod_drains_and_is_replaced(cluster, operator, demo, wait_for):
    """`kubectl delete pod`: the preStop sleep, then SIGTERM to `kvpilot serve`, which drains
    and exits; the whole stop takes the hook's seconds plus the drain, far less than the
    grace period after which the kubelet would SIGKILL a process that ignored SIGTERM."""
    (old,) = engine_pods(operator, demo)
    name = old["metadata"]["name"]
    t0 = time.monotonic()
    cluster.kubectl("delete", "pod", name, "-n", demo, "--wait=true", "--timeout=60s")
    stop_s = time.monotonic() - t0
    grace = old["spec"]["terminationGracePeriodSeconds"]
    assert stop_s < grace, f"the pod took {stop_s:.1f}s to stop (grace {grace}s): SIGTERM was not handled"
    (new,) = wait_for(lambda: engine_pods(operator, demo), timeout=READY_TIMEOUT, interval=1,
                      what="a replacement engine pod to be Ready")
    assert new["metadata"]["name"] != name
    r = httpx.post(f"http://{new['status']['podIP']}:8000/v1/completions",
                   json={"model": "tiny", "prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_operator_metrics(operator, demo):
    op = operator_leader(operator)
    text = httpx.get(f"http://{op['status']['podIP']}:8080/metrics", timeout=10).text
    assert "kvpilot_operator_reconciles_total{" in text
    assert "kvpilot_operator_reconcile_duration_seconds_bucket" in text


def test_prometheus_scrapes_the_engine_pods(cluster, operator, demo, wait_for):
    """The pod template's scrape annotations are what Prometheus (and the autotuner) discover."""
    if not cluster.prometheus_url:
        pytest.skip("the local cluster runs without Prometheus")
    query = f'kvpilot:max_num_seqs{{namespace="{demo}"}}'

    def scraped():
        r = httpx.get(f"{cluster.prometheus_url}/api/v1/query", params={"query": query}, timeout=10).json()
        return r["data"]["result"]
    # The pod the previous test deleted may still have a series inside Prometheus's lookback.
    found = wait_for(scraped, timeout=60, interval=1, what="Prometheus to scrape the engine pod")
    (pod,) = engine_pods(operator, demo)
    series = [x for x in found if x["metric"]["pod"] == pod["metadata"]["name"]] or wait_for(
        lambda: [x for x in scraped() if x["metric"]["pod"] == pod["metadata"]["name"]], timeout=60, interval=1,
        what="Prometheus to scrape the running engine pod")
    assert float(series[0]["value"][1]) == 16 and all(float(x["value"][1]) == 16 for x in found)


def test_kubectl_get_llmd_columns(cluster, operator, demo):
    out = cluster.kubectl("get", "llmd", "-n", demo).stdout.splitlines()
    assert out[0].split() == ["NAME", "READY", "REPLICAS", "MAXNUMSEQS", "MAXMODELLEN", "KV%", "MODE", "SIMULATED",
                              "MODEL", "AGE"]
    row = out[1].split()
    assert row[:5] == ["tiny", "True", "1", "16", "512"] and "Recommend" in row[5:7]  # KV% empty: no Prometheus data


def test_live_change_keeps_pods(cluster, operator, demo, wait_for):
    (pod,) = engine_pods(operator, demo)
    before = pod_identity(pod)
    template = operator.get(f"/apis/apps/v1/namespaces/{demo}/deployments/tiny")["spec"]["template"]
    patch_spec(cluster, demo, {"engine": {"maxNumSeqs": 24, "maxModelLen": 1024}})
    wait_for(lambda: '"max_num_seqs": 24' in tuning(operator, demo), timeout=60, what="the ConfigMap")
    wait_for(lambda: gauge(pod, "kvpilot:max_num_seqs") == 24, timeout=90, what="the pod's gauge")
    wait_for(lambda: gauge(pod, "kvpilot:max_model_len") == 1024, timeout=30, what="max_model_len gauge")
    wait_for(lambda: is_ready(operator, demo), timeout=60, what="Ready again")
    (after,) = engine_pods(operator, demo)
    assert pod_identity(after) == before
    assert operator.get(f"/apis/apps/v1/namespaces/{demo}/deployments/tiny")["spec"]["template"] == template
    assert llmd(operator, demo)["spec"]["engine"]["maxNumSeqs"] == 24


def test_non_live_change_rolls_pods(cluster, operator, demo, wait_for):
    (old,) = engine_pods(operator, demo)
    patch_spec(cluster, demo, {"engine": {"blockSize": 32}})

    def rolled():
        pods = engine_pods(operator, demo)
        return is_ready(operator, demo) and len(pods) == 1 and pods[0]["metadata"]["uid"] != old["metadata"]["uid"]
    try:
        wait_for(rolled, timeout=READY_TIMEOUT, interval=1, what="the pods to roll")
    except TimeoutError:
        raise AssertionError(diagnose(cluster, demo)) from None
    (new,) = engine_pods(operator, demo)
    args = new["spec"]["containers"][0]["args"]
    assert args[args.index("--block-size") + 1] == "32"
    assert gauge(new, "kvpilot:max_num_seqs") == 24  # the tuned values survive the roll


def test_speculative_decoding_from_the_spec(cluster, operator, demo, wait_for):
    """spec.engine.speculative rolls the pods with --speculative-config; the tuning
    ConfigMap and the pod carry K; the pod drafts (vllm:spec_decode_* counts) on a
    repetitive prompt; a K in the ConfigMap reaches the engine without a roll."""
    patch_spec(cluster, demo, {"engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 3}}})

    def rolled():
        pods = engine_pods(operator, demo)
        return is_ready(operator, demo) and len(pods) == 1 and \
            "--speculative-config" in pods[0]["spec"]["containers"][0]["args"] and pods[0]
    try:
        pod = wait_for(rolled, timeout=READY_TIMEOUT, interval=1, what="the pods to roll with speculation")
    except TimeoutError:
        raise AssertionError(diagnose(cluster, demo)) from None
    args = pod["spec"]["containers"][0]["args"]
    assert json.loads(args[args.index("--speculative-config") + 1]) == {
        "method": "ngram", "num_speculative_tokens": 3}
    assert '"num_speculative_tokens": 3' in tuning(operator, demo)
    wait_for(lambda: gauge(pod, "kvpilot:num_speculative_tokens") == 3, timeout=60, what="K on the pod")
    url = f"http://{pod['status']['podIP']}:8000"
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "a b c a b c a b c a b c",
                                                  "max_tokens": 32, "temperature": 0, "ignore_eos": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert gauge(pod, "vllm:spec_decode_num_drafts_total") > 0
    assert llmd(operator, demo)["status"]["effective"]["numSpeculativeTokens"] == 3


def test_deleted_deployment_is_recreated(cluster, operator, demo, wait_for):
    uid = operator.get(f"/apis/apps/v1/namespaces/{demo}/deployments/tiny")["metadata"]["uid"]
    cluster.kubectl("delete", "deployment", "tiny", "-n", demo, "--wait=false")

    def recreated():
        d = operator.get(f"/apis/apps/v1/namespaces/{demo}/deployments/tiny", ok404=True)
        return d is not None and d["metadata"]["uid"] != uid and is_ready(operator, demo) \
            and engine_pods(operator, demo)
    wait_for(recreated, timeout=READY_TIMEOUT, interval=1, what="the Deployment to come back")


SIMULATED = {"accelerator": "h100-80gb", "model": "llama-3.1-8b"}


def test_invalid_specs_are_refused_with_field_messages(cluster, operator, demo):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"].update(name="bad", namespace=demo)
    cases = [({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas"),
             ({"engine": {"maxNumSeqs": 1000}}, "maxNumSeqs"),
             ({"autotune": {"mode": "Sometimes"}}, "spec.autotune.mode"),
             ({"engine": {"maxNumSeqs": 0}}, "spec.engine.maxNumSeqs"),
             # speculation's CEL rules, as the real API server evaluates them
             ({"engine": {"speculative": {"numSpeculativeTokens": 2}}},
              "engine.speculative needs method ngram, or model"),
             ({"engine": {"speculative": {"method": "ngram", "model": "builtin:tiny-draft",
                                          "numSpeculativeTokens": 2}}}, "method ngram takes none"),
             ({"engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 17}}},
              "spec.engine.speculative.numSpeculativeTokens"),
             ({"autotune": {"numSpeculativeTokens": {"min": 0, "max": 2}}},
              "autotune.numSpeculativeTokens needs engine.speculative"),
             # the simulated accelerator models float weights and 16-bit caches only
             ({"engine": {"quantization": "int4", "simulate": SIMULATED}},
              "engine.quantization is not modelled by engine.simulate"),
             ({"engine": {"kvCacheDtype": "fp8", "simulate": SIMULATED}},
              "engine.kvCacheDtype fp8 is not modelled by engine.simulate"),
             ({"engine": {"kvCacheDtype": "fp16"}}, "spec.engine.kvCacheDtype")]
    for change, field in cases:
        bad = yaml.safe_load(yaml.safe_dump(doc))
        for k, v in change.items():
            bad["spec"][k] = {**bad["spec"].get(k, {}), **v}
        r = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(bad), check=False)
        assert r.returncode != 0 and field in r.stderr, (change, r.stderr)
    assert llmd(operator, demo, "bad") is None


def test_operator_restart_converges(cluster, operator, demo, wait_for):
    op = operator_leader(operator)  # deleted: the standby takes the released Lease over
    cluster.kubectl("delete", "pod", op["metadata"]["name"], "-n", OPERATOR_NS, "--wait=false")
    patch_spec(cluster, demo, {"engine": {"maxNumSeqs": 20}})  # while the operator is away
    wait_for(lambda: [p for p in operator_ready(operator) if p["metadata"]["uid"] != op["metadata"]["uid"]],
             timeout=180, what="a new operator pod")
    wait_for(lambda: '"max_num_seqs": 20' in tuning(operator, demo), timeout=90, what="the ConfigMap")
    obj = wait_for(lambda: is_ready(operator, demo), timeout=120, what="Ready after the restart")
    assert obj["status"]["effective"]["maxNumSeqs"] == 20
    (pod,) = engine_pods(operator, demo)
    wait_for(lambda: gauge(pod, "kvpilot:max_num_seqs") == 20, timeout=90, what="the pod's gauge")


def test_deletion_cleans_up(cluster, operator, demo, wait_for):
    cluster.kubectl("delete", "llmd", "tiny", "-n", demo, "--wait=false")

    def gone():
        paths = [f"/apis/apps/v1/namespaces/{demo}/deployments/tiny", f"/api/v1/namespaces/{demo}/services/tiny",
                 f"/api/v1/namespaces/{demo}/configmaps/tiny-tuning"]
        return all(operator.get(p, ok404=True) is None for p in paths) and llmd(operator, demo) is None \
            and not engine_pods(operator, demo, ready_only=False)
    wait_for(gone, timeout=180, interval=1, what="owned objects to be garbage-collected")
