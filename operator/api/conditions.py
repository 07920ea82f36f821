"""Pure status computation: conditions (Ready, Progressing, Degraded) from the
owned Deployment's status and the problems the reconcile found, with
lastTransitionTime kept while a condition's status does not change. Reconciling and
Stalled restate Progressing and Degraded under the names kstatus reads (Flux's and
kpt's health checks): abnormal-true, so a healthy object has both False."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from .status import Condition, LLMDeploymentStatus


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Problem:
    """Something that keeps the deployment from working (Degraded=True)."""
    reason: str
    message: str


@dataclass(frozen=True)
class Rollout:
    desired: int
    replicas: int
    ready: int
    updated: int
    available: int
    up_to_date: bool  # the Deployment controller has seen the latest template
    deadline_exceeded: bool

    @classmethod
    def from_deployment(cls, deployment: dict | None, desired: int) -> "Rollout":
        if deployment is None:
            return cls(desired, 0, 0, 0, 0, False, False)
        st = deployment.get("status") or {}
        gen = deployment.get("metadata", {}).get("generation", 0)
        conds = {c.get("type"): c for c in st.get("conditions") or []}
        prog = conds.get("Progressing") or {}
        return cls(desired, st.get("replicas", 0), st.get("readyReplicas", 0),
                   st.get("updatedReplicas", 0), st.get("availableReplicas", 0),
                   st.get("observedGeneration", 0) >= gen,
                   prog.get("reason") == "ProgressDeadlineExceeded")

    @property
    def complete(self) -> bool:
        return (self.up_to_date and self.updated == self.desired and self.replicas == self.desired
                and self.ready >= self.desired)


def _set(prev: list[Condition], type_: str, ok: bool, reason: str, message: str,
         generation: int | None, now: str) -> Condition:
    status = "True" if ok else "False"
    old = next((c for c in prev if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == status and old.last_transition_time else now
    return Condition(type=type_, status=status, reason=reason, message=message,
                     observed_generation=generation, last_transition_time=since)


def compute_conditions(prev: list[Condition], rollout: Rollout, problems: list[Problem],
                       generation: int | None, now: str | None = None,
                       ready_note: str | None = None) -> list[Condition]:
    """ready_note (e.g. "simulated h100-80gb") is appended to the Ready message."""
    now = now or now_iso()
    r = rollout
    if problems:
        degraded = (True, problems[0].reason, "; ".join(p.message for p in problems))
    elif r.deadline_exceeded:
        degraded = (True, "ProgressDeadlineExceeded",
                    f"rollout made no progress: {r.updated}/{r.desired} pods updated, {r.ready} ready")
    else:
        degraded = (False, "AsExpected", "no problems found")
    if r.complete:
        progressing = (False, "RolloutComplete", f"{r.desired} pod(s) up to date")
    else:
        progressing = (True, "RollingOut", f"{r.updated}/{r.desired} updated, {r.ready}/{r.desired} ready")
    if problems:
        ready = (False, problems[0].reason, f"{r.ready}/{r.desired} replicas ready; {degraded[2]}")
    elif r.desired == 0:
        ready = (True, "ScaledToZero", "replicas is 0")
    elif r.complete:
        ready = (True, "AllReplicasReady", f"{r.ready}/{r.desired} replicas ready")
    elif r.ready > 0:
        ready = (False, "PartiallyReady", f"{r.ready}/{r.desired} replicas ready")
    else:
        ready = (False, degraded[1] if degraded[0] else "Pending", f"{r.ready}/{r.desired} replicas ready")
    if ready_note:
        ready = (*ready[:2], f"{ready[2]} ({ready_note})")
    # kstatus reads Reconciling before Stalled: a stuck object is not reconciling.
    reconciling = (False, "Stalled", degraded[2]) if degraded[0] else progressing
    return [_set(prev, "Ready", *ready, generation, now),
            _set(prev, "Progressing", *progressing, generation, now),
            _set(prev, "Degraded", *degraded, generation, now),
            _set(prev, "Reconciling", *reconciling, generation, now),
            _set(prev, "Stalled", *degraded, generation, now)]


CORE_CONDITIONS = ("Ready", "Progressing", "Degraded", "Reconciling", "Stalled")


def merge_extra_conditions(prev: list[Condition], extra: list[Condition] | None,
                           generation: int | None, now: str | None = None) -> list[Condition]:
    """Conditions beyond the core three (the autotuner's, e.g. PrefixCacheIneffective):
    `extra` replaces them (keeping lastTransitionTime while a status holds); None keeps
    the previous ones as they are."""
    if extra is None:
        return [c for c in prev if c.type not in CORE_CONDITIONS]
    now = now or now_iso()
    return [_set(prev, c.type, c.status == "True", c.reason, c.message, generation, now)
            for c in extra if c.type not in CORE_CONDITIONS]


def complete(c: Condition, generation: int | None, now: str) -> Condition:
    """`c` with every field the CRD requires (status.CONDITION_REQUIRED): a condition read back
    from an object written before they were required may lack some, and one missing field
    would make the API server refuse the whole status write."""
    return c.model_copy(update={
        "observed_generation": c.observed_generation if c.observed_generation is not None else generation or 0,
        "last_transition_time": c.last_transition_time or now, "reason": c.reason or "Unspecified",
        "message": c.message or ""})


def status_from(prev: LLMDeploymentStatus, rollout: Rollout, problems: list[Problem],
                generation: int | None, extra_conditions: list[Condition] | None = None,
                ready_note: str | None = None, **fields) -> LLMDeploymentStatus:
    """The next status: conditions, replica counts, and the given fields."""
    new = prev.model_copy(update=fields)
    new.observed_generation = generation
    now = now_iso()
    new.conditions = [complete(c, generation, now) for c in
                      compute_conditions(prev.conditions, rollout, problems, generation, now, ready_note)
                      + merge_extra_conditions(prev.conditions, extra_conditions, generation, now)]
    new.replicas, new.ready_replicas, new.updated_replicas = rollout.replicas, rollout.ready, rollout.updated
    return new
