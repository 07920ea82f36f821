"""The apply cache: a reconcile pass whose owned objects are as this process last wrote
them sends no apply and no delete; a changed manifest, a Deployment changed by someone
else, and an entry past the recheck time are sent again. The API server here is a small
in-memory one behind Kube._call (resourceVersions, 404s)."""
from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from kvpilot.operator.runtime.applied import AppliedCache, digest_of, key_of
from kvpilot.operator.runtime.apply import Kube
from kvpilot.operator.reconcile import reconcile


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class MiniApiServer:
    """Objects by path; every write bumps a resourceVersion, as the API server's would."""

    def __init__(self):
        self.objects: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.version = 0

    def bump(self, path: str) -> None:
        self.version += 1
        self.objects[path]["metadata"]["resourceVersion"] = str(self.version)

    def call(self, method, path, body=None, query=None, content_type="application/json"):
        self.requests.append((method, path))
        if method == "GET" and path.endswith("/pods"):
            return {"items": []}
        if method == "GET":
            if path not in self.objects:
                raise ApiException(status=404, reason="Not Found")
            return json.loads(json.dumps(self.objects[path]))
        if method == "PATCH":
            base = path.removesuffix("/status")
            manifest = json.loads(body) if isinstance(body, str) else body
            obj = self.objects.setdefault(base, {"metadata": {}})
            if path.endswith("/status"):
                obj["status"] = manifest["status"]
            else:
                obj.update({k: v for k, v in manifest.items() if k != "status"})
            self.bump(base)
            return json.loads(json.dumps(obj))
        if method == "DELETE":
            if self.objects.pop(path, None) is None:
                raise ApiException(status=404, reason="Not Found")
            return {}
        raise AssertionError(f"unexpected {method} {path}")

    def sent(self, method: str) -> list[str]:
        """The collections written to ("status" for a status write)."""
        return ["status" if p.endswith("/status") else p.rsplit("/", 2)[-2] for m, p in self.requests if m == method]


LLMD = "/apis/serving.kvpilot.dev/v1alpha1/namespaces/demo/llmdeployments/tiny"
DEPLOYMENT = "/apis/apps/v1/namespaces/demo/deployments/tiny"


@pytest.fixture
def setup():
    api, clock = MiniApiServer(), Clock()
    kube = Kube(api_client=object(), applied=AppliedCache(recheck_s=60, clock=clock))
    kube._call = api.call
    api.objects[LLMD] = {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment",
                         "metadata": {"name": "tiny", "namespace": "demo", "uid": "u", "generation": 1},
                         "spec": {"model": {"source": "builtin:tiny"}}}
    api.bump(LLMD)
    return api, clock, kube


def one_pass(api, kube):
    api.requests.clear()
    reconcile(kube, api.objects[LLMD])


def test_an_unchanged_pass_sends_no_apply_and_no_delete(setup):
    api, clock, kube = setup
    one_pass(api, kube)
    assert sorted(api.sent("PATCH")) == ["configmaps", "deployments", "services", "status", "status"]
    assert api.sent("DELETE") == ["poddisruptionbudgets"]  # one replica: no PDB (a 404 here)
    one_pass(api, kube)
    assert api.sent("PATCH") == [] and api.sent("DELETE") == []
    assert [m for m, _ in api.requests] == ["GET", "GET"]  # its pods, its Deployment


def test_a_deployment_changed_by_someone_else_is_applied_again(setup):
    api, clock, kube = setup
    one_pass(api, kube)
    api.objects[DEPLOYMENT]["spec"]["replicas"] = 5  # a hand edit
    api.bump(DEPLOYMENT)
    one_pass(api, kube)
    assert api.sent("PATCH") == ["deployments"]
    assert api.objects[DEPLOYMENT]["spec"]["replicas"] == 1  # reverted at once
    api.objects.pop(DEPLOYMENT)  # deleted
    one_pass(api, kube)
    assert api.sent("PATCH") == ["deployments"] and DEPLOYMENT in api.objects


def test_a_changed_manifest_is_applied_and_the_rest_waits_for_the_recheck(setup):
    api, clock, kube = setup
    one_pass(api, kube)
    api.objects[LLMD]["spec"]["engine"] = {"maxNumSeqs": 8}  # the tuning file changes
    one_pass(api, kube)
    assert api.sent("PATCH") == ["status", "configmaps"]  # the settings in effect, then the file
    clock.t += 59.9
    one_pass(api, kube)
    assert api.sent("PATCH") == []
    clock.t += 0.1  # the recheck: every object is written again once a minute
    one_pass(api, kube)
    assert sorted(api.sent("PATCH")) == ["configmaps", "deployments", "services"]
    assert api.sent("DELETE") == ["poddisruptionbudgets"]


def test_a_failed_apply_is_forgotten_and_sent_again():
    api, clock = MiniApiServer(), Clock()
    kube = Kube(api_client=object(), applied=AppliedCache(clock=clock))
    manifest = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "n"}, "data": {}}
    calls = []

    def failing(method, path, *a, **k):
        calls.append(method)
        raise ConnectionError("API server unreachable")
    kube._call = api.call
    kube.apply(manifest)
    kube._call = failing
    manifest2 = {**manifest, "data": {"a": "1"}}
    with pytest.raises(ConnectionError):
        kube.apply(manifest2)
    assert kube.applied.applied(manifest) is None  # neither the old nor the new state is assumed
    kube._call = api.call
    kube.apply(manifest)
    assert api.sent("PATCH") == ["configmaps", "configmaps"]


def test_the_cache_drops_entries_of_objects_it_no_longer_writes():
    clock = Clock()
    cache = AppliedCache(recheck_s=10, clock=clock)
    for i in range(5):
        m = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"c{i}", "namespace": "n"}}
        cache.remember_apply(m, {"metadata": {"resourceVersion": "1"}})
    assert len(cache) == 5
    clock.t += 10
    kept = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "n"}}
    cache.remember_apply(kept, {})
    assert len(cache) == 1 and cache.applied(kept) == {}
    assert key_of(kept) == ("v1", "Service", "n", "s")
    assert digest_of({"b": 1, "a": 2}) == digest_of({"a": 2, "b": 1})
    with pytest.raises(ValueError, match="recheck_s"):
        AppliedCache(recheck_s=0)
