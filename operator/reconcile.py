"""One level-based reconcile pass of an LLMDeployment, free of kopf: parse and
check the spec, look for missing prerequisites and failing pods, let the autotuner
(if any) propose settings, write the status, and apply the owned objects from it."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

from pydantic import ValidationError

from .runtime import faults
from .runtime.apply import Kube
from .api.conditions import CORE_CONDITIONS, Problem, Rollout, status_from
from .manifests.deployment import build_deployment, pvc_claim
from .manifests.objects import (Owner, build_configmap, build_pdb, build_service, effective_settings, endpoint_url,
                      selector_string)
from .model_size import s3_credentials, s3_model_size
from .model_status import MODEL_READY, hub_token, model_progress, resolve_revision, sized_bytes, unresolved
from .pod_health import pod_problems
from .manifests.simulate import simulated_summary
from .api.spec import LLMDeploymentSpec
from .names import GROUP, KIND, VERSION
from .api.fields import InvalidSpec
from .api.defaults import OperatorDefaults, with_defaults
from .api.validation import validate_spec
from .api.status import AutotuneStatus, Condition, Effective, LLMDeploymentStatus, ModelDownloadStatus
from .autotune.context import AutotuneContext, AutotuneOutcome

log = logging.getLogger(__name__)


AutotuneHook = Callable[[AutotuneContext], AutotuneOutcome]


@dataclass
class Result:
    status: LLMDeploymentStatus
    problems: list[Problem] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        c = self.status.condition("Ready")
        return c is not None and c.status == "True"


def parse_spec(body, defaults: OperatorDefaults | None = None) -> LLMDeploymentSpec:
    """The spec, checked, with the operator's defaults (default: from its environment, which
    `kvpilot operator` sets from its flags) filled in."""
    try:
        spec = LLMDeploymentSpec.model_validate(dict(body.get("spec") or {}))
    except ValidationError as e:
        errs = "; ".join(f"spec.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise InvalidSpec(errs) from None
    validate_spec(spec)
    return with_defaults(spec, defaults if defaults is not None else OperatorDefaults.from_env(os.environ))


def find_problems(kube: Kube, namespace: str, spec: LLMDeploymentSpec) -> list[Problem]:
    """Prerequisites the API server cannot check: the model's PVC, the API key's Secret,
    a simulated model's ConfigMap."""
    problems = []
    claim = pvc_claim(spec)
    if claim and kube.get("v1", "PersistentVolumeClaim", namespace, claim) is None:
        problems.append(Problem("PVCNotFound", f"PersistentVolumeClaim {claim} (spec.model.source) does not exist"))
    ref = spec.engine.api_key_secret_ref
    if ref is not None:
        problems += secret_problems(kube, namespace, ref.name, [ref.key], "spec.engine.apiKeySecretRef",
                                    "spec.engine.apiKeySecretRef.key")
    problems += model_source_problems(kube, namespace, spec)
    sim = spec.engine.simulate
    cm_ref = sim.model_config_map if sim is not None else None
    if cm_ref is not None:
        cm = kube.get("v1", "ConfigMap", namespace, cm_ref.name)
        if cm is None:
            problems.append(Problem("ConfigMapNotFound", f"ConfigMap {cm_ref.name} "
                                    "(spec.engine.simulate.modelConfigMap) does not exist"))
        elif cm_ref.key not in (cm.get("data") or {}) and cm_ref.key not in (cm.get("binaryData") or {}):
            problems.append(Problem("ConfigMapKeyNotFound", f"ConfigMap {cm_ref.name} has no key {cm_ref.key} "
                                    "(spec.engine.simulate.modelConfigMap.key)"))
    return problems


def secret_problems(kube: Kube, namespace: str, name: str, keys: list[str], where: str,
                    key_where: str | None = None) -> list[Problem]:
    """A Secret the spec names (at `where`) that is missing, or lacks one of `keys`."""
    secret = kube.get("v1", "Secret", namespace, name)
    if secret is None:
        return [Problem("SecretNotFound", f"Secret {name} ({where}) does not exist")]
    have = set(secret.get("data") or {}) | set(secret.get("stringData") or {})
    return [Problem("SecretKeyNotFound", f"Secret {name} has no key {key} ({key_where or where})")
            for key in keys if key not in have]


def model_source_problems(kube: Kube, namespace: str, spec: LLMDeploymentSpec) -> list[Problem]:
    """The Secrets and the cache PVC an hf:// or s3:// source names."""
    m, problems = spec.model, []
    if m.hf is not None and m.hf.token_secret_ref is not None:
        ref = m.hf.token_secret_ref
        problems += secret_problems(kube, namespace, ref.name, [ref.key], "spec.model.hf.tokenSecretRef")
    if m.s3 is not None and m.s3.credentials_secret_ref is not None:
        problems += secret_problems(kube, namespace, m.s3.credentials_secret_ref.name,
                                    ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"], "spec.model.s3.credentialsSecretRef")
    claim = m.cache.claim_name if m.cache is not None else None
    if claim and kube.get("v1", "PersistentVolumeClaim", namespace, claim) is None:
        problems.append(Problem("PVCNotFound", f"PersistentVolumeClaim {claim} (spec.model.cache.claimName) "
                                               "does not exist"))
    return problems


def run_autotune(hook: AutotuneHook | None, owner: Owner, spec: LLMDeploymentSpec,
                 prev: LLMDeploymentStatus, kube: Kube | None = None
                 ) -> tuple[Effective | None, AutotuneStatus | None, list[Condition] | None,
                            Callable[[], None] | None]:
    """(tuned settings to run, report, autotuner conditions, announcement to make once the
    status is written). Off: none. A failing hook
    keeps the last values. Replicas always come from spec.replicas: the autotuner moves
    them through the scale subresource (as an HPA would), so a tuned replica count never
    outlives a later change of spec.replicas; a proposal may carry the value it just wrote."""
    if spec.autotune.mode == "Off":
        return None, None, [], None
    tuned = prev.effective.model_copy(update={"replicas": None}) if prev.effective else None
    current = effective_settings(spec, tuned)
    if hook is None:
        return tuned, prev.autotune or AutotuneStatus(diagnosis="NoData", message="autotuner not installed"), None, None
    try:
        out = hook(AutotuneContext(owner, spec, prev, current, kube))
        report = out.status()
    except Exception as e:  # the autotuner must never stop the reconcile
        log.exception("autotune hook failed for %s/%s", owner.namespace, owner.name)
        report = (prev.autotune or AutotuneStatus()).model_copy(update={"message": f"autotuner error: {e}"})
        return tuned, report, None, None
    if spec.autotune.mode == "Auto":  # a partial proposal (or none: hold) keeps the rest running
        return current.model_copy(update=out.proposed.model_dump(exclude_none=True)) if out.proposed \
            else current, report, out.conditions, out.announce
    report = report.model_copy(update={"recommendation": out.proposed}) if out.proposed else report
    return None, report, out.conditions, out.announce


def reconcile(kube: Kube, body, hook: AutotuneHook | None = None) -> Result:
    """Raises InvalidSpec for a spec that cannot work; apply.Conflict to retry later.

    Crash-safe order: the status carrying the autotuner's decision (status.autotune, the
    history's only home) and the settings it chose (status.effective) is written first;
    the owned objects are then applied from status.effective. A crash between the two
    leaves a status whose settings the next pass applies again (idempotent server-side
    apply); the decision is neither lost nor made twice, since the next pass's autotuner
    starts from the recorded decision and settings."""
    owner = Owner.from_body(body)
    generation = body["metadata"].get("generation")
    prev = LLMDeploymentStatus.model_validate(dict(body.get("status") or {}))
    spec = parse_spec(body)
    problems = find_problems(kube, owner.namespace, spec)
    tuned, report, autotune_conditions, announce = run_autotune(hook, owner, spec, prev, kube)
    effective = effective_settings(spec, tuned)
    pods = kube.list_pods(owner.namespace, selector_string(owner))
    model, model_condition = None, None
    if (model := resolve_revision(spec, prev.model, lambda: hub_token(kube, owner.namespace, spec),
                                  s3_size=lambda: s3_model_size(
                                      spec, lambda: s3_credentials(kube, owner.namespace, spec)))) is not None:
        model, model_condition, model_problems = model_progress(
            model, pods, lambda pod, container: kube.last_log_line(owner.namespace, pod, container))
        problems += model_problems
    problems += pod_problems(pods)
    snapshot = report.snapshot if report is not None else None
    kv = None if snapshot is None or snapshot.kv_usage_mean is None else round(100 * snapshot.kv_usage_mean)
    sim = spec.engine.simulate
    # "simulated h100-80gb", or "simulated 4xh100-80gb" for one engine over four
    ready_note = f"simulated {simulated_summary(spec).split('/')[0]}" if sim is not None else None
    before = kube.get("apps/v1", "Deployment", owner.namespace, owner.name)
    # simulated=None clears a previous value: the status apply then leaves the field out.
    # observedGeneration moves only with the second write: until the objects are applied,
    # the running pods are still the previous generation's.
    decided = status_from(prev, Rollout.from_deployment(before, effective.replicas), problems,
                          prev.observed_generation,
                          effective=effective, autotune=report, endpoint=endpoint_url(owner, spec),
                          selector=selector_string(owner), kv_cache_usage_percent=kv,
                          simulated=simulated_summary(spec), model=model,
                          extra_conditions=with_model_condition(prev.conditions, autotune_conditions,
                                                                model_condition),
                          ready_note=ready_note)
    if decided.dump() != prev.dump():
        # Unchanged (most resync passes between autotune intervals): no write, so no request
        # and no watch event for the operator's own watch and every other watcher.
        write_status(kube, owner, decided)
    if announce is not None:  # the Event and counter of a change the status now holds
        announce()
    if new_decision(prev, decided):
        faults.exit_if_armed(faults.STATUS_WRITTEN)
    deployment = apply_owned(kube, owner, spec, decided.effective, before, decided.model)
    # The rollout as the Deployment now reports it; a second write only when that moved.
    status = status_from(decided, Rollout.from_deployment(deployment, decided.effective.replicas), problems,
                         generation, ready_note=ready_note)
    if status.dump() != decided.dump():
        write_status(kube, owner, status)
    return Result(status, problems)


def with_model_condition(prev: list[Condition], autotune: list[Condition] | None,
                         model: Condition | None) -> list[Condition] | None:
    """The conditions beyond the core ones: the autotuner's (None: as they were) and ModelReady
    (absent for a model that is not downloaded)."""
    if autotune is None:
        if model is None and not any(c.type == MODEL_READY for c in prev):
            return None  # nothing changes: keep them all
        autotune = [c for c in prev if c.type not in CORE_CONDITIONS and c.type != MODEL_READY]
    return [c for c in autotune if c.type != MODEL_READY] + ([model] if model is not None else [])


def new_decision(prev: LLMDeploymentStatus, status: LLMDeploymentStatus) -> bool:
    """Whether this pass's status records an autotune decision that changed the settings."""
    before = prev.autotune.last_decision if prev.autotune is not None else None
    after = status.autotune.last_decision if status.autotune is not None else None
    return (after is not None and after != before and bool(after.change) and after.action != "hold"
            and after.applied is not False and status.effective != prev.effective)


def apply_owned(kube: Kube, owner: Owner, spec: LLMDeploymentSpec, effective: Effective,
                before: dict | None, model: ModelDownloadStatus | None = None) -> dict | None:
    """The owned objects for the settings in `effective` and the model revision in `model`
    (both read from status); the Deployment as the API server returned it (`before`: as
    this pass read it, None if absent). An hf:// source not yet resolved to a commit leaves
    the Deployment as it is (absent, or still running the previous source)."""
    kube.apply(build_configmap(owner, effective))
    if unresolved(model):
        deployment = before
    else:
        deployment = kube.apply(build_deployment(owner, spec, effective.replicas,
                                                 model.revision if model is not None else None,
                                                 sized_bytes(model)),
                                live=before, live_read=True)
    kube.apply(build_service(owner, spec))
    pdb = build_pdb(owner, effective.replicas)
    if pdb is not None:
        kube.apply(pdb)
    else:
        kube.delete("policy/v1", "PodDisruptionBudget", owner.namespace, owner.name)
    return deployment


def write_status(kube: Kube, owner: Owner, status: LLMDeploymentStatus) -> None:
    kube.apply({"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                "metadata": {"name": owner.name, "namespace": owner.namespace},
                "status": status.dump()}, subresource="status")


def write_invalid(kube: Kube, body, message: str) -> None:
    """Degraded (InvalidSpec) for a spec the API server admitted but that cannot work."""
    owner = Owner.from_body(body)
    prev = LLMDeploymentStatus.model_validate(dict(body.get("status") or {}))
    status = status_from(prev, Rollout.from_deployment(None, 0), [Problem("InvalidSpec", message)],
                         body["metadata"].get("generation"))
    write_status(kube, owner, status)
