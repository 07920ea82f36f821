"""Pure builders of the small owned objects (ConfigMap with the tuning file,
Service, PodDisruptionBudget) and what they share: names, labels, owner
references. Every builder returns a manifest dict ready for server-side apply."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..api.spec import LLMDeploymentSpec

from ..names import GROUP, KIND, VERSION
from ..api.validation import spec_tokens_bounds
from ..api.status import Effective
from ..names import ENGINE_APP_NAME, HTTP_PORT, INSTANCE_LABEL  # noqa: F401  (pods' names)

FIELD_MANAGER = "kvpilot-operator"
MANAGED_BY = "kvpilot-operator"
TUNING_FILE = "tuning.json"
TUNING_DIR = "/etc/kvpilot"


@dataclass(frozen=True)
class Owner:
    """The LLMDeployment an object belongs to."""
    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body) -> "Owner":
        meta = body["metadata"]
        return cls(meta["name"], meta["namespace"], meta["uid"])


def selector_labels(owner: Owner) -> dict[str, str]:
    return {"app.kubernetes.io/name": ENGINE_APP_NAME, INSTANCE_LABEL: owner.name}


def labels(owner: Owner) -> dict[str, str]:
    return {**selector_labels(owner), "app.kubernetes.io/instance": owner.name,
            "app.kubernetes.io/component": "engine", "app.kubernetes.io/part-of": "kvpilot",
            "app.kubernetes.io/managed-by": MANAGED_BY}


def selector_string(owner: Owner) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(owner).items()))


def owner_reference(owner: Owner) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": owner.name, "uid": owner.uid,
            "controller": True, "blockOwnerDeletion": True}


def metadata(owner: Owner, name: str) -> dict:
    return {"name": name, "namespace": owner.namespace, "labels": labels(owner),
            "ownerReferences": [owner_reference(owner)]}


def tuning_configmap_name(owner: Owner) -> str:
    return f"{owner.name}-tuning"


def effective_settings(spec: LLMDeploymentSpec, tuned: Effective | None = None) -> Effective:
    """The settings to run: the autotuner's (when mode is Auto) clamped into the
    spec's bounds, else the spec's own. Never written back into the spec."""
    seqs, model_len, replicas = spec.engine.max_num_seqs, spec.engine.max_model_len, spec.replicas
    spec_tokens = spec.engine.speculative.num_speculative_tokens if spec.engine.speculative else None
    if spec_tokens is not None and spec.autotune.mode == "Auto":
        # Starts at the configured K within the bounds (their max may be below it).
        lo, hi = spec_tokens_bounds(spec)
        if tuned is not None and tuned.num_speculative_tokens is not None:
            spec_tokens = tuned.num_speculative_tokens
        spec_tokens = min(max(spec_tokens, lo), hi)
    if tuned is not None and spec.autotune.mode == "Auto":
        b = spec.autotune
        if tuned.max_num_seqs is not None:
            seqs = min(max(tuned.max_num_seqs, b.max_num_seqs.min), b.max_num_seqs.max)
        if tuned.max_model_len is not None:
            model_len = min(max(tuned.max_model_len, b.max_model_len.min), b.max_model_len.max)
        if tuned.replicas is not None:
            a = spec.autoscaling
            replicas = min(max(tuned.replicas, a.min_replicas), a.max_replicas)
    chunk = None
    if tuned is not None and spec.autotune.mode == "Auto" and tuned.max_num_batched_tokens is not None:
        lo, hi = chunk_bounds(spec)
        chunk = min(max(tuned.max_num_batched_tokens, lo, seqs), hi)
    return Effective(max_num_seqs=seqs, max_model_len=model_len, replicas=replicas,
                     num_speculative_tokens=spec_tokens, max_num_batched_tokens=chunk)


def chunk_bounds(spec: LLMDeploymentSpec) -> tuple[int, int]:
    """(min, max) of the live max_num_batched_tokens: autotune.maxNumBatchedTokens within
    [1, engine.maxNumBatchedTokens] (the engine's memory is sized for that ceiling)."""
    top = spec.engine.max_num_batched_tokens
    r = spec.autotune.max_num_batched_tokens
    if r is None:
        return min(512, top), top
    return min(r.min, top), min(r.max, top)


def tuning_json(effective: Effective) -> str:
    values = {"max_num_seqs": effective.max_num_seqs, "max_model_len": effective.max_model_len}
    if effective.num_speculative_tokens is not None:  # only where the engine speculates
        values["num_speculative_tokens"] = effective.num_speculative_tokens
    if effective.max_num_batched_tokens is not None:  # only once the autotuner moved it
        values["max_num_batched_tokens"] = effective.max_num_batched_tokens
    return json.dumps(values, sort_keys=True)


def build_configmap(owner: Owner, effective: Effective) -> dict:
    """The engine's tuning file; running pods re-read it (live settings only)."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(owner, tuning_configmap_name(owner)),
            "data": {TUNING_FILE: tuning_json(effective)}}


def build_service(owner: Owner, spec: LLMDeploymentSpec) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(owner, owner.name),
            "spec": {"type": spec.service.type, "selector": selector_labels(owner),
                     "ports": [{"name": "http", "port": spec.service.port, "targetPort": "http",
                                "protocol": "TCP"}]}}


def endpoint_url(owner: Owner, spec: LLMDeploymentSpec) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{spec.service.port}"


def build_pdb(owner: Owner, replicas: int) -> dict | None:
    """One pod at a time may be evicted; none is built for a single replica
    (a PDB there would block node drains forever)."""
    if replicas <= 1:
        return None
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": metadata(owner, owner.name),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner)}}}
