"""LLMDeployment objects whose status the operator's own status code wrote, in the states a
health checker must tell apart (Argo CD's Lua check, kstatus)."""
from __future__ import annotations

from kvpilot.operator.api.conditions import Problem, Rollout, status_from
from kvpilot.operator.api.status import LLMDeploymentStatus

READY = Rollout(desired=2, replicas=2, ready=2, updated=2, available=2, up_to_date=True, deadline_exceeded=False)
ROLLING = Rollout(desired=2, replicas=2, ready=1, updated=1, available=1, up_to_date=True, deadline_exceeded=False)
STUCK = Rollout(desired=2, replicas=2, ready=0, updated=1, available=0, up_to_date=True, deadline_exceeded=True)
MISSING_SECRET = Problem("SecretNotFound", "Secret k (spec.engine.apiKeySecretRef) does not exist")


def status(rollout: Rollout, problems=(), generation: int = 3) -> LLMDeploymentStatus:
    return status_from(LLMDeploymentStatus(), rollout, list(problems), generation)


def llmd(status: LLMDeploymentStatus | None, generation: int = 3) -> dict:
    obj = {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment",
           "metadata": {"name": "chat", "namespace": "ml", "generation": generation}, "spec": {}}
    if status is not None:
        obj["status"] = status.dump()
    return obj
