"""hf:// and s3:// models on the local cluster, against real servers on the host: olah (a
Hugging Face mirror, tests/hub_server.py) and an S3 server (gofakes3, tests/s3_server.py),
each throttled so the download takes seconds.

- an LLMDeployment from hf:// (token, mirror endpoint, a cache PVC) shows its download in
  status.model and ModelReady while it runs, becomes Ready and answers; a second replica
  on the same PVC downloads nothing (bytes served by the mirror, and its init container's
  own count);
- one from s3:// (credentials Secret, endpoint, path style, an emptyDir cache) the same;
- a wrong token, a missing revision and a bucket without config.json each end in Degraded
  with the cause in the reason and message, and a Warning Event."""
from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from test_operator import READY_TIMEOUT, condition, diagnose, llmd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hub_server import HubServer  # noqa: E402
from s3_server import S3Server  # noqa: E402

pytestmark = pytest.mark.e2e
ENGINE_IMAGE = True  # real engine pods (builtin:tiny): conftest builds the engine image
TOKEN = "hf_kvpilot_e2e_token"
REPO = "acme/tiny"
THROTTLE = 2 * 1024 * 1024  # bytes/s: the ~21 MB model downloads in about 10 s


@pytest.fixture(scope="module")
def operator(shared_operator):
    return shared_operator.get(resync_interval=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvpilot.engine.tiny.model import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("e2e-model") / "tiny")


@pytest.fixture(scope="module")
def hub(cluster, model_dir):
    gateway = cluster.state["gateway"]  # where pods reach the host
    with HubServer({REPO: model_dir}, token=TOKEN, host="0.0.0.0", advertise_host=gateway,
                   hub_compat=False) as server:  # olah's own answers, as a site runs it
        yield server


@pytest.fixture(scope="module")
def s3(cluster, model_dir, tmp_path_factory):
    with S3Server(host="0.0.0.0", advertise_host=cluster.state["gateway"]) as server:
        server.upload_dir("models", "tiny", model_dir)
        (config_less := tmp_path_factory.mktemp("no-config")).joinpath("tokenizer.json").write_text("{}")
        server.upload_dir("models", "no-config", config_less)
        yield server


@pytest.fixture
def ns(cluster):
    name = f"m-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def deployment(name: str, ns: str, model: dict, replicas: int = 1) -> dict:
    return {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"servedName": name, **model},
                     "engine": {"maxNumSeqs": 8, "maxModelLen": 256, "maxNumBatchedTokens": 256,
                                "kvCacheMemory": "8Mi"},
                     "resources": {"cpu": "500m", "memory": "1Gi"}, "replicas": replicas}}


def secret(name: str, ns: str, data: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns}, "stringData": data}


def ready_pods(kube, ns: str, name: str) -> list[dict]:
    pods = kube.get(f"/api/v1/namespaces/{ns}/pods",
                    params={"labelSelector": f"serving.kvpilot.dev/llmdeployment={name}"})["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]


def watch_download(kube, ns: str, name: str, wait_for) -> tuple[list[str], dict]:
    """The progress values status.model showed until Ready, and the object then."""
    seen: list[str] = []

    def ready():
        obj = llmd(kube, ns, name)
        progress = ((obj or {}).get("status") or {}).get("model", {}).get("progress")
        if progress and (not seen or seen[-1] != progress):
            seen.append(progress)
        return obj if condition(obj, "Ready").get("status") == "True" else None
    obj = wait_for(ready, timeout=READY_TIMEOUT, interval=0.5, what=f"{name} to be Ready")
    return seen, obj


def completes(pod: dict, model: str) -> None:
    r = httpx.post(f"http://{pod['status']['podIP']}:8000/v1/completions",
                   json={"model": model, "prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text


def init_outcome(pod: dict) -> dict:
    (cs,) = [c for c in pod["status"]["initContainerStatuses"] if c["name"] == "model-fetch"]
    return json.loads(cs["state"]["terminated"]["message"])


def hostpath_claim(cluster, ns: str, tmp_path: Path) -> str:
    """A PVC bound to a hostPath PersistentVolume (the local cluster has no provisioner)."""
    folder = tmp_path / "model-cache"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)  # the pods run as 65532
    pv = f"cache-{ns}"
    cluster.apply([
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "manual",
                  "hostPath": {"path": str(folder), "type": "Directory"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models", "namespace": ns},
         "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "manual", "volumeName": pv,
                  "resources": {"requests": {"storage": "1Gi"}}}}])
    return pv


def test_hf_model_downloads_with_progress_and_a_second_replica_on_the_pvc_downloads_nothing(
        cluster, operator, hub, ns, wait_for, tmp_path):
    pv = hostpath_claim(cluster, ns, tmp_path)
    try:
        cluster.apply(secret("hf", ns, {"HF_TOKEN": TOKEN}))
        hub.set_throttle(THROTTLE)
        before = hub.bytes_served()
        t0 = time.monotonic()
        cluster.apply(deployment("hf-tiny", ns, {"source": f"hf://{REPO}", "hf": {
            "endpoint": hub.endpoint, "tokenSecretRef": {"name": "hf"}}, "cache": {"claimName": "models"}}))
        try:
            seen, obj = watch_download(operator, ns, "hf-tiny", wait_for)
        except TimeoutError:
            raise AssertionError(diagnose(cluster, ns)) from None
        ready_s = time.monotonic() - t0
        model = obj["status"]["model"]
        total = hub.bytes_served() - before
        print(f"\n[hf] Ready {ready_s:.1f}s after apply; status.model.progress went {seen}; "
              f"revision {model['revision']}; served {total} bytes; ModelReady: "
              f"{condition(obj, 'ModelReady')['message']}")
        assert model["revision"] == hub.commit(REPO, "main") and model["phase"] == "Ready"
        assert any(p.startswith("Downloading ") and p not in ("Downloading 0%", "Downloading 100%") for p in seen), seen
        assert condition(obj, "ModelReady")["status"] == "True"
        assert total == model["bytesTotal"]
        (pod,) = ready_pods(operator, ns, "hf-tiny")
        completes(pod, "hf-tiny")
        row = cluster.kubectl("get", "llmd", "hf-tiny", "-n", ns).stdout.splitlines()
        assert row[0].split()[-2:] == ["MODEL", "AGE"] and row[1].split()[-2] == "Ready", row

        served = hub.bytes_served()
        cluster.kubectl("scale", "llmd", "hf-tiny", "-n", ns, "--replicas=2")
        pods = wait_for(lambda: len(ready_pods(operator, ns, "hf-tiny")) == 2 and ready_pods(operator, ns, "hf-tiny"),
                        timeout=READY_TIMEOUT, interval=1, what="the second replica")
        second = next(p for p in pods if p["metadata"]["name"] != pod["metadata"]["name"])
        outcome = init_outcome(second)
        print(f"[hf] second replica on the PVC: mirror served {hub.bytes_served() - served} bytes; "
              f"its init container: {outcome}")
        assert hub.bytes_served() == served and outcome["downloaded"] == 0
        completes(second, "hf-tiny")
    finally:
        hub.set_throttle(0)
        # Not waited for: the PV's protection finalizer holds it until the claim is gone.
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)


def test_s3_model_downloads_with_progress_and_serves(cluster, operator, s3, ns, wait_for):
    cluster.apply(secret("s3", ns, {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}))
    s3.set_throttle(THROTTLE)
    try:
        before = s3.bytes_served()
        t0 = time.monotonic()
        cluster.apply(deployment("s3-tiny", ns, {"source": "s3://models/tiny", "s3": {
            "endpoint": s3.endpoint, "pathStyle": True, "credentialsSecretRef": {"name": "s3"}}}))
        try:
            seen, obj = watch_download(operator, ns, "s3-tiny", wait_for)
        except TimeoutError:
            raise AssertionError(diagnose(cluster, ns)) from None
    finally:
        s3.set_throttle(0)
    print(f"\n[s3] Ready {time.monotonic() - t0:.1f}s after apply; status.model.progress went {seen}; "
          f"served {s3.bytes_served() - before} bytes; ModelReady: {condition(obj, 'ModelReady')['message']}")
    assert any(p.startswith("Downloading ") and p not in ("Downloading 0%", "Downloading 100%") for p in seen), seen
    assert obj["status"]["model"]["phase"] == "Ready" and s3.bytes_served() - before == obj["status"]["model"]["bytesTotal"]
    (pod,) = ready_pods(operator, ns, "s3-tiny")
    completes(pod, "s3-tiny")


def test_source_failures_are_degraded_with_the_cause(cluster, operator, hub, s3, ns, wait_for):
    cluster.apply([secret("wrong", ns, {"HF_TOKEN": "hf_not_the_token"}), secret("hf", ns, {"HF_TOKEN": TOKEN}),
                   secret("s3", ns, {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key})])
    cases = {
        "bad-token": ({"source": f"hf://{REPO}", "hf": {"endpoint": hub.endpoint, "tokenSecretRef": {"name": "wrong"}}},
                      "ModelUnauthorized", "refused the request with the token given (HTTP 401)"),
        "bad-revision": ({"source": f"hf://{REPO}@no-such-branch", "hf": {
            "endpoint": hub.endpoint, "tokenSecretRef": {"name": "hf"}}},
                         "ModelRevisionNotFound", "revision 'no-such-branch' does not exist"),
        "no-config": ({"source": "s3://models/no-config", "s3": {
            "endpoint": s3.endpoint, "pathStyle": True, "credentialsSecretRef": {"name": "s3"}}},
            "ModelFilesMissing", "no config.json (found: tokenizer.json)"),
    }
    t0 = time.monotonic()
    for name, (model, _, _) in cases.items():
        cluster.apply(deployment(name, ns, model))
    for name, (_, reason, words) in cases.items():
        def degraded(name=name, reason=reason):
            obj = llmd(operator, ns, name)
            c = condition(obj, "Degraded")
            return obj if c.get("status") == "True" and c.get("reason") == reason else None
        try:
            obj = wait_for(degraded, timeout=180, interval=1, what=f"{name}: Degraded {reason}")
        except TimeoutError:
            raise AssertionError(diagnose(cluster, ns)) from None
        message = condition(obj, "Degraded")["message"]
        print(f"\n[{name}] Degraded {reason} {time.monotonic() - t0:.1f}s after apply: {message}")
        assert words in message and "Traceback" not in message
        assert condition(obj, "ModelReady")["reason"] == reason and obj["status"]["model"]["progress"] == "Failed"
        def warned(name=name, reason=reason):  # the Event is posted after the status patch, not with it
            events = yaml.safe_load(cluster.kubectl("get", "events", "-n", ns, "-o", "yaml",
                                                    f"--field-selector=involvedObject.name={name}").stdout)["items"]
            return [e for e in events if e["reason"] == reason and e["type"] == "Warning"] or None
        assert wait_for(warned, timeout=30, interval=1, what=f"{name}: a Warning Event {reason}")
    # Resolved by the operator: no pod was ever made for the two hf:// failures.
    for name in ("bad-token", "bad-revision"):
        assert operator.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}", ok404=True) is None
