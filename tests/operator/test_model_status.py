"""hf:// and s3:// in the operator, without a cluster: the spec's rules, the init container
and cache volume, the revision pinned before any pod exists, progress and failures read
from the pods' init containers, and a reconcile that creates no pods for a source it
cannot resolve."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from kvpilot.engine.fetch.base import REVISION_NOT_FOUND, Listing, ModelFetchError, RemoteFile
from kvpilot.operator.manifests.deployment import build_deployment
from kvpilot.operator.manifests.model_download import INIT_CONTAINER
from kvpilot.operator.model_status import (MODEL_READY, RETRY_FAILED_S, model_progress, observe_pods,
                                           resolve_revision)
from kvpilot.operator.manifests.objects import Owner
from kvpilot.operator.pod_health import pod_problems
from kvpilot.operator.reconcile import parse_spec, reconcile
from kvpilot.operator.api.fields import InvalidSpec
from kvpilot.operator.api.status import ModelDownloadStatus
from test_operator_reconcile import FakeKube, body, kinds

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OWNER = Owner("tiny", "demo", "u")


def spec(model: dict):
    return parse_spec({"spec": {"model": model}})


def test_sources_and_their_options_are_checked_at_the_edge():
    for good in ("hf://meta-llama/Llama-3.1-8B@main", "hf://org/name", f"hf://org/n.a_m-e@{COMMIT}",
                 "s3://models/llama/8b", "s3://my-bucket"):
        spec({"source": good})
    for bad, field in (("hf://org", "model.source"), ("hf://org/a--b", "model.source"),
                       ("s3://A_B/x", "model.source"), ("s3://models/a/../b", "model.source")):
        with pytest.raises(InvalidSpec, match=field):
            spec({"source": bad})
    with pytest.raises(InvalidSpec, match="model.hf applies to hf://"):
        spec({"source": "s3://models/x", "hf": {"endpoint": "http://mirror"}})
    with pytest.raises(InvalidSpec, match="model.s3 applies to s3://"):
        spec({"source": "hf://org/x", "s3": {"pathStyle": True}})
    with pytest.raises(InvalidSpec, match="model.cache and model.files"):
        spec({"source": "builtin:tiny", "cache": {"claimName": "models"}})
    with pytest.raises(InvalidSpec, match="endpoint"):
        spec({"source": "hf://org/x", "hf": {"endpoint": "ftp://mirror"}})


def test_the_pod_fetches_in_an_init_container_and_the_engine_reads_the_cache_offline():
    s = spec({"source": "hf://org/tiny@main", "hf": {"endpoint": "http://mirror:8090", "tokenSecretRef": {"name": "hf"}},
              "cache": {"claimName": "models"}, "files": ["original/*"]})
    pod = build_deployment(OWNER, s, 2, COMMIT)["spec"]["template"]["spec"]
    init, engine = pod["initContainers"][0], pod["containers"][0]
    assert init["name"] == INIT_CONTAINER and init["command"] == ["kvpilot", "fetch-model"]
    assert init["args"][:2] == [f"hf://org/tiny@{COMMIT}", "--cache-dir"] and "original/*" in init["args"]
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_ENDPOINT"]["value"] == "http://mirror:8090"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}
    assert "nvidia.com/gpu" not in json.dumps(init["resources"])
    assert engine["args"][engine["args"].index("--model") + 1] == f"hf://org/tiny@{COMMIT}"
    engine_env = {e["name"]: e.get("value") for e in engine["env"]}
    assert engine_env["KVPILOT_MODEL_OFFLINE"] == "1" and "HF_TOKEN" not in engine_env
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}}
    assert {"name": "model-cache", "mountPath": "/var/cache/kvpilot/models", "readOnly": True} in engine["volumeMounts"]
    s3 = spec({"source": "s3://models/tiny", "s3": {"endpoint": "http://minio:9000", "pathStyle": True,
                                                    "credentialsSecretRef": {"name": "s3"}}})
    pod = build_deployment(OWNER, s3, 1)["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["initContainers"][0]["env"]}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio:9000" and env["KVPILOT_S3_PATH_STYLE"]["value"] == "1"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "s3", "key": "AWS_SECRET_ACCESS_KEY"}
    # an s3:// model whose size was not listed (test_model_size.py): the default cache, requested
    assert next(v for v in pod["volumes"] if v["name"] == "model-cache") == {
        "name": "model-cache", "emptyDir": {"sizeLimit": str(20 * 2**30)}}
    assert pod["initContainers"][0]["resources"]["requests"]["ephemeral-storage"] == str(20 * 2**30)
    with pytest.raises(ValueError, match="resolved commit"):
        build_deployment(OWNER, s, 1)


@pytest.fixture
def hub(monkeypatch):
    """The Hub's answers for resolve_revision (the client itself is tested against a real
    Hub server in test_model_fetch_hub.py)."""
    calls = []

    def listing(source, selection, endpoint, token):
        calls.append((source.repo, source.revision, endpoint, token))
        if source.revision == "nope":
            raise ModelFetchError(REVISION_NOT_FOUND, f"hf://{source.repo}: revision 'nope' does not exist at {endpoint}")
        return Listing(COMMIT, (RemoteFile("config.json", 10), RemoteFile("model.safetensors", 1000)), ("main",))

    monkeypatch.setattr("kvpilot.engine.fetch.hub.hub_listing", listing)
    return calls


def test_the_revision_is_resolved_once_per_source_and_failures_are_retried_slowly(hub):
    s = spec({"source": "hf://org/tiny"})
    first = resolve_revision(s, None, lambda: "tok")
    assert (first.revision, first.bytes_total, first.files) == (COMMIT, 1010, 2)
    assert hub == [("org/tiny", "main", None, "tok")]
    assert resolve_revision(s, first, lambda: "tok") is first and len(hub) == 1  # pinned: never asked again
    bad = spec({"source": "hf://org/tiny@nope"})
    now = datetime.now(timezone.utc)
    failed = resolve_revision(bad, first, lambda: None, now)
    assert (failed.phase, failed.reason, failed.revision) == ("Failed", "ModelRevisionNotFound", None)
    assert resolve_revision(bad, failed, lambda: None, now + timedelta(seconds=5)) is failed and len(hub) == 2
    resolve_revision(bad, failed, lambda: None, now + timedelta(seconds=RETRY_FAILED_S + 1))
    assert len(hub) == 3


def init_pod(name: str, state: dict, last: dict | None = None, restarts: int = 0) -> dict:
    cs = {"name": INIT_CONTAINER, "state": state, "restartCount": restarts}
    if last:
        cs["lastState"] = last
    return {"metadata": {"name": name}, "status": {"initContainerStatuses": [cs]}}


def progress_line(done, total, phase="Downloading"):
    return json.dumps({"phase": phase, "done": done, "total": total, "percent": 100.0 * done / total,
                       "bytesPerSecond": 2 * 2**20})


def test_progress_failure_and_readiness_come_from_the_init_containers():
    status = ModelDownloadStatus(source="hf://org/tiny", revision=COMMIT, phase="Pending", bytes_total=2**30)
    logs = {"a": progress_line(2**29, 2**30), "b": progress_line(2**28, 2**30)}
    pods = [init_pod("a", {"running": {}}), init_pod("b", {"running": {}})]
    new, cond, problems = model_progress(status, pods, lambda pod, c: logs[pod])
    assert (new.phase, new.progress, new.bytes_done) == ("Downloading", "Downloading 25%", 2**28)  # the slowest pod
    assert cond.type == MODEL_READY and cond.status == "False" and cond.reason == "Downloading"
    assert "25% (256.0 MiB of 1.00 GiB) at 2.0 MiB/s in pod b" in cond.message and not problems

    waiting = model_progress(status, [init_pod("c", {"running": {}})],
                             lambda pod, c: progress_line(5, 10, "Waiting"))[0]
    assert waiting.progress == "Waiting 50%" and "another pod is downloading" in waiting.message

    outcome = json.dumps({"reason": "Unauthorized", "message": "hf://org/tiny: http://m refused the request (HTTP 401)"})
    crashed = init_pod("d", {"waiting": {"reason": "CrashLoopBackOff"}},
                       {"terminated": {"exitCode": 2, "message": outcome}}, restarts=3)
    new, cond, problems = model_progress(status, [crashed], lambda pod, c: None)
    assert (new.phase, new.reason, cond.reason) == ("Failed", "ModelUnauthorized", "ModelUnauthorized")
    assert problems[0].reason == "ModelUnauthorized" and "HTTP 401" in problems[0].message
    assert "3 restart(s)" in problems[0].message
    assert pod_problems([crashed]) == []  # named once, by its cause, not also as a CrashLoopBackOff

    done = json.dumps({"reason": "Ready", "revision": COMMIT, "files": 4, "total": 3 * 2**20, "downloaded": 0})
    new, cond, _ = model_progress(status, [init_pod("e", {"terminated": {"exitCode": 0, "message": done}})],
                                  lambda pod, c: None)
    assert (new.phase, cond.status, new.files) == ("Ready", "True", 4) and "downloaded 0.0 MiB" in cond.message
    assert observe_pods([], lambda pod, c: None)[0] == "Pending"
    scaled_to_zero, cond, _ = model_progress(new, [], lambda pod, c: None)
    assert scaled_to_zero.phase == "Ready" and cond.status == "True"  # nothing to download, nothing lost
    assert model_progress(status, [], lambda pod, c: None)[0].phase == "Pending"


def test_reconcile_pins_the_commit_and_creates_no_pods_for_a_source_it_cannot_resolve(hub):
    kube = FakeKube({("Secret", "hf"): {"data": {"HF_TOKEN": "dG9r"}}})  # "tok"
    result = reconcile(kube, body({"model": {"source": "hf://org/tiny", "hf": {"tokenSecretRef": {"name": "hf"}}}}))
    deployment = next(m for m, _ in kube.applied if m["kind"] == "Deployment")
    engine = deployment["spec"]["template"]["spec"]["containers"][0]
    assert f"hf://org/tiny@{COMMIT}" in engine["args"] and hub[-1][3] == "tok"
    assert result.status.model.revision == COMMIT
    assert result.status.condition(MODEL_READY).reason == "Pending"

    kube = FakeKube()
    result = reconcile(kube, body({"model": {"source": "hf://org/tiny@nope"}}))
    assert "Deployment" not in kinds(kube)
    degraded = result.status.condition("Degraded")
    assert degraded.status == "True" and degraded.reason == "ModelRevisionNotFound"
    assert "revision 'nope' does not exist" in degraded.message
    assert result.status.model.progress == "Failed"


def test_missing_secrets_and_cache_claim_are_named():
    kube = FakeKube({("Secret", "s3"): {"data": {"AWS_ACCESS_KEY_ID": "eA=="}}})
    result = reconcile(kube, body({"model": {"source": "s3://models/tiny",
                                             "s3": {"credentialsSecretRef": {"name": "s3"}},
                                             "cache": {"claimName": "models"}}}))
    message = result.status.condition("Degraded").message
    assert "Secret s3 has no key AWS_SECRET_ACCESS_KEY (spec.model.s3.credentialsSecretRef)" in message
    assert "PersistentVolumeClaim models (spec.model.cache.claimName) does not exist" in message
