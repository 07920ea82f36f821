"""The routing table: served model name -> its backend (the LLMDeployment, its ready
replicas, a picker and an admission queue). Refreshed from snapshots (discovery.py);
Replica objects persist across refreshes so each keeps its in-flight count and load."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from .admission import AdmissionQueue
from .picker import Picker
from .replicas import Replica

log = logging.getLogger("kvpilot.gateway")


@dataclass(frozen=True)
class BackendSnapshot:
    """One served model as discovery saw it."""
    model: str
    namespace: str | None  # None for --backend (no LLMDeployment behind it)
    deployment: str | None
    endpoints: tuple[tuple[str, str], ...]  # (pod name, base URL) of ready pods
    created: str = ""  # the LLMDeployment's creationTimestamp: the oldest wins a name clash
    desired_replicas: int | None = None  # spec.replicas (0: scaled to zero); None for --backend


@dataclass
class Backend:
    model: str
    namespace: str | None
    deployment: str | None
    picker: Picker
    queue: AdmissionQueue
    replicas: dict[str, Replica] = field(default_factory=dict)
    desired_replicas: int | None = None

    @property
    def scaled_to_zero(self) -> bool:
        return self.deployment is not None and self.desired_replicas == 0


class RoutingTable:
    def __init__(self, make_picker: Callable[[], Picker], per_replica_capacity: int) -> None:
        if per_replica_capacity < 1:
            raise ValueError(f"per-replica capacity must be >= 1, got {per_replica_capacity}")
        self._make_picker = make_picker
        self.per_replica_capacity = per_replica_capacity
        self.backends: dict[str, Backend] = {}

    def get(self, model: str) -> Backend | None:
        return self.backends.get(model)

    def models(self) -> list[str]:
        return sorted(self.backends)

    def update(self, snapshots: list[BackendSnapshot]) -> None:
        chosen: dict[str, BackendSnapshot] = {}
        for snap in sorted(snapshots, key=lambda s: (s.created, s.namespace or "", s.deployment or "")):
            other = chosen.setdefault(snap.model, snap)
            if other is not snap:
                log.warning("model %r is served by both %s/%s and %s/%s; routing to the older, %s/%s",
                            snap.model, other.namespace, other.deployment, snap.namespace, snap.deployment,
                            other.namespace, other.deployment)
        for model in list(self.backends):
            if model not in chosen:
                backend = self.backends.pop(model)
                backend.queue.set_capacity(0)  # its waiters time out with a 404-like 503
        for model, snap in chosen.items():
            backend = self.backends.get(model)
            if backend is None or (backend.namespace, backend.deployment) != (snap.namespace, snap.deployment):
                backend = Backend(model, snap.namespace, snap.deployment, self._make_picker(),
                                  backend.queue if backend else AdmissionQueue())
                self.backends[model] = backend
            current = backend.replicas
            fresh: dict[str, Replica] = {}
            for name, url in snap.endpoints:
                kept = current.get(name)
                fresh[name] = kept if kept is not None and kept.url == url else Replica(name, url)
            backend.replicas = fresh
            backend.desired_replicas = snap.desired_replicas
            backend.queue.set_capacity(len(fresh) * self.per_replica_capacity)

    def all_replicas(self) -> list[Replica]:
        return [r for b in self.backends.values() for r in b.replicas.values()]
