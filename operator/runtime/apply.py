"""The small apply layer over the kubernetes client: server-side apply under one
field manager (force), reads and deletes that treat 404 as "absent". With an
AppliedCache (the operator's), an apply or delete that would change nothing is not
sent (applied.py says when that is certain)."""
from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

from . import metrics
from .applied import AppliedCache, key_of
from ..manifests.objects import FIELD_MANAGER
from ..names import GROUP, KIND, PLURAL, VERSION

log = logging.getLogger(__name__)

_COLLECTIONS = {
    ("v1", "ConfigMap"): "/api/v1/namespaces/{ns}/configmaps",
    ("v1", "Service"): "/api/v1/namespaces/{ns}/services",
    ("v1", "Secret"): "/api/v1/namespaces/{ns}/secrets",
    ("v1", "PersistentVolumeClaim"): "/api/v1/namespaces/{ns}/persistentvolumeclaims",
    ("apps/v1", "Deployment"): "/apis/apps/v1/namespaces/{ns}/deployments",
    ("policy/v1", "PodDisruptionBudget"): "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    (f"{GROUP}/{VERSION}", "LLMDeployment"): f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/{PLURAL}",
}


class Conflict(Exception):
    """A 404/409 while applying (namespace going away, object being deleted):
    retried on the next pass."""


def object_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    return _COLLECTIONS[(api_version, kind)].format(ns=namespace) + f"/{name}"


class Kube:
    """What the reconcile needs from the API server, over one ApiClient."""

    def __init__(self, api_client=None, applied: AppliedCache | None = None):
        if api_client is None:
            from kubernetes import client
            api_client = client.ApiClient()
        self.api = api_client
        self.applied = applied

    def _call(self, method: str, path: str, body=None, query=None, content_type="application/json"):
        """One request; ApiException for an error status, the decoded JSON otherwise."""
        from kubernetes.client.exceptions import ApiException
        metrics.API_REQUESTS.labels(method).inc()
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        if not hasattr(self.api, "param_serialize"):  # kubernetes < 35: the older generator
            return self.api.call_api(path, method, query_params=query or [], body=body, header_params=headers,
                                     response_type="object", auth_settings=["BearerToken"],
                                     _return_http_data_only=True)
        serialized = self.api.param_serialize(
            method, path, query_params=query or [], body=body, auth_settings=["BearerToken"],
            header_params=headers)
        resp = self.api.call_api(*serialized)
        resp.read()
        if resp.status >= 400:
            raise ApiException(status=resp.status, reason=resp.reason or "", body=resp.data)
        return json.loads(resp.data) if resp.data else {}

    def apply(self, manifest: dict, subresource: str = "", *, live: dict | None = None,
              live_read: bool = False) -> dict:
        """Server-side apply; the object as the API server answered. `live_read`: `live` is
        the object as the caller just read it (None: absent), which lets the cache skip an
        apply that would change nothing (the status subresource is never skipped)."""
        meta = manifest["metadata"]
        path = object_path(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        cache = self.applied if not subresource else None
        if cache is not None and (earlier := cache.applied(manifest, live, live_read=live_read)) is not None:
            metrics.API_REQUESTS_SKIPPED.labels("PATCH").inc()
            return earlier
        from kubernetes.client.exceptions import ApiException
        try:
            # JSON is YAML: the body goes as a string, whatever the client's YAML support.
            result = self._call("PATCH", path + (f"/{subresource}" if subresource else ""), json.dumps(manifest),
                                [("fieldManager", FIELD_MANAGER), ("force", "true")],
                                "application/apply-patch+yaml")
        except Exception as e:  # the object's state is unknown now: the next pass sends it
            if cache is not None:
                cache.forget(key_of(manifest))
            if isinstance(e, ApiException) and e.status in (404, 409):
                raise Conflict(f"apply {manifest['kind']} {meta['namespace']}/{meta['name']}: "
                               f"{e.status} {e.reason}") from e
            raise
        if cache is not None:
            cache.remember_apply(manifest, result)
        return result

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException
        try:
            return self._call("GET", object_path(api_version, kind, namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list_llmdeployments(self, namespace: str | None = None) -> list[dict]:
        base = f"/apis/{GROUP}/{VERSION}" + (f"/namespaces/{namespace}" if namespace else "")
        items = self._call("GET", f"{base}/{PLURAL}").get("items") or []
        for it in items:  # list items carry no apiVersion/kind
            it.setdefault("apiVersion", f"{GROUP}/{VERSION}")
            it.setdefault("kind", "LLMDeployment")
        return items

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        """The pods matching a label selector (the engine pods of one LLMDeployment)."""
        return self._call("GET", f"/api/v1/namespaces/{namespace}/pods",
                          query=[("labelSelector", selector)]).get("items") or []

    def last_log_line(self, namespace: str, pod: str, container: str) -> str | None:
        """The last JSON line among the last few a container logged (a model download's
        progress; a library's warning may follow it); None when there is none, or the log
        cannot be read (the container just started, or is gone)."""
        from kubernetes.client.exceptions import ApiException
        path = f"/api/v1/namespaces/{namespace}/pods/{pod}/log"
        query = [("container", container), ("tailLines", "5")]
        metrics.API_REQUESTS.labels("GET").inc()
        try:
            if not hasattr(self.api, "param_serialize"):  # kubernetes < 35
                text = self.api.call_api(path, "GET", query_params=query, response_type="str",
                                         auth_settings=["BearerToken"], _return_http_data_only=True)
            else:
                resp = self.api.call_api(*self.api.param_serialize("GET", path, query_params=query,
                                                                   auth_settings=["BearerToken"]))
                resp.read()
                if resp.status >= 400:
                    return None
                text = resp.data.decode("utf-8", "replace")
        except (ApiException, OSError) as e:
            log.debug("reading %s/%s %s log: %s", namespace, pod, container, e)
            return None
        lines = [line for line in (text or "").strip().splitlines() if line.startswith("{")]
        return lines[-1] if lines else None

    def patch_scale(self, namespace: str, name: str, replicas: int) -> dict:
        """spec.replicas through the LLMDeployment's scale subresource, as an HPA would."""
        path = object_path(f"{GROUP}/{VERSION}", "LLMDeployment", namespace, name) + "/scale"
        # a dict, not a string: the client JSON-encodes bodies of JSON content types itself
        return self._call("PATCH", path, {"spec": {"replicas": int(replicas)}},
                          content_type="application/merge-patch+json")

    def scale_targeted_by_hpa(self, namespace: str, name: str) -> bool:
        """Whether an autoscaling/v2 HorizontalPodAutoscaler's scaleTargetRef is this LLMDeployment."""
        items = self._call("GET", f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers"
                           ).get("items") or []
        for hpa in items:
            ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
            if (ref.get("kind") == KIND and ref.get("name") == name
                    and (ref.get("apiVersion") or "").split("/")[0] == GROUP):
                return True
        return False

    def create_event(self, involved: dict, type_: str, reason: str, message: str) -> dict:
        """A core/v1 Event on `involved` (apiVersion, kind, name, namespace, uid)."""
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"generateName": f"{involved['name']}.", "namespace": involved["namespace"]},
                 "involvedObject": involved, "type": type_, "reason": reason, "message": message[:1024],
                 "firstTimestamp": now, "lastTimestamp": now, "count": 1,
                 "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER}
        return self._call("POST", f"/api/v1/namespaces/{involved['namespace']}/events", event)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """True when it deleted the object; False when it was absent (or this process
        deleted it, or found it absent, under the cache's recheck time ago)."""
        from kubernetes.client.exceptions import ApiException
        key = (api_version, kind, namespace, name)
        if self.applied is not None and self.applied.deleted(key):
            metrics.API_REQUESTS_SKIPPED.labels("DELETE").inc()
            return False
        try:
            self._call("DELETE", object_path(api_version, kind, namespace, name))
            deleted = True
        except ApiException as e:
            if e.status != 404:
                if self.applied is not None:
                    self.applied.forget(key)
                raise
            deleted = False
        if self.applied is not None:
            self.applied.remember_delete(key)
        return deleted
