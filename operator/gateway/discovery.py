"""Where the routing table's snapshots come from: the Kubernetes API (LLMDeployments and
their ready pods), or fixed `--backend MODEL=URL[,URL...]` lists for use without a cluster."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from ..names import ENGINE_POD_SELECTOR, GROUP, HTTP_PORT, INSTANCE_LABEL, PLURAL, VERSION
from .table import BackendSnapshot

log = logging.getLogger("kvpilot.gateway")


def _ready(pod: dict) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False  # a terminating pod is draining: no new requests
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _port(pod: dict) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return int(port["containerPort"])
    return HTTP_PORT


def snapshots_from_objects(deployments: Iterable[dict], pods: Iterable[dict]) -> list[BackendSnapshot]:
    """Pure: LLMDeployments (as the API returns them) and engine pods -> one snapshot per
    deployment, with the URLs of its ready pods (sorted by pod name)."""
    ready: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(INSTANCE_LABEL)
        if owner and _ready(pod):
            ready.setdefault((meta.get("namespace", ""), owner), []).append(
                (meta["name"], f"http://{pod['status']['podIP']}:{_port(pod)}"))
    out = []
    for d in deployments:
        meta = d.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        name, namespace = meta["name"], meta.get("namespace", "")
        model = ((d.get("spec") or {}).get("model") or {}).get("servedName") or name
        replicas = (d.get("spec") or {}).get("replicas", 1)
        out.append(BackendSnapshot(model, namespace, name, tuple(sorted(ready.get((namespace, name), []))),
                                   meta.get("creationTimestamp", ""), int(replicas)))
    return out


def parse_backend_flag(text: str) -> BackendSnapshot:
    """`MODEL=URL[,URL...]` -> a static backend (each URL's position names its replica)."""
    model, sep, urls = text.partition("=")
    if not sep or not model or not urls:
        raise ValueError(f"--backend must be MODEL=URL[,URL...], got {text!r}")
    endpoints = []
    for i, url in enumerate(u.strip() for u in urls.split(",")):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--backend {model}: {url!r} is not an http:// or https:// URL")
        endpoints.append((f"{model}-{i}", url.rstrip("/")))
    return BackendSnapshot(model, None, None, tuple(endpoints))


class KubernetesScaler:
    """Wakes an LLMDeployment at zero: spec.replicas 0 -> 1 through its scale subresource,
    as an HPA or KEDA would write it. The operator reconciles that like any scale."""

    def __init__(self, api_client) -> None:
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)

    def _patch(self, namespace: str, name: str) -> None:
        current = self.custom.get_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, name)
        if (current.get("spec") or {}).get("replicas", 0) == 0:  # someone may have scaled it already
            self.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, name,
                                                             {"spec": {"replicas": 1}})

    async def wake(self, namespace: str, name: str) -> None:
        await asyncio.to_thread(self._patch, namespace, name)


class KubernetesDiscovery:
    """Lists LLMDeployments and engine pods every `interval` seconds (in a worker thread:
    the client is blocking). A failed list keeps the last table and is retried."""

    def __init__(self, namespaces: list[str], interval: float) -> None:
        from kubernetes import client

        from ..kube_config import load_kube_config

        load_kube_config()
        self.api = client.ApiClient()
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)
        self.namespaces = namespaces
        self.interval = interval
        self.scaler = KubernetesScaler(self.api)

    def _list(self) -> list[BackendSnapshot]:
        deployments, pods = [], []
        for ns in self.namespaces or [None]:
            if ns is None:
                d = self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)
                p = self.core.list_pod_for_all_namespaces(label_selector=ENGINE_POD_SELECTOR)
            else:
                d = self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)
                p = self.core.list_namespaced_pod(ns, label_selector=ENGINE_POD_SELECTOR)
            deployments += d.get("items", [])
            pods += [self.api.sanitize_for_serialization(pod) for pod in p.items]
        return snapshots_from_objects(deployments, pods)

    async def run(self, on_snapshot) -> None:
        while True:
            try:
                on_snapshot(await asyncio.to_thread(self._list))
            except Exception as e:  # noqa: BLE001 (the API being away must not stop routing)
                log.warning("discovery: listing LLMDeployments and pods failed: %s", e)
            await asyncio.sleep(self.interval)
