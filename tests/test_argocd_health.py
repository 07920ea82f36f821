"""docs/argocd/health.lua, Argo CD's health check for LLMDeployment, run in Lua 5.1 (the
language of Argo CD's gopher-lua) through lupa, against statuses the operator's own
status code writes."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.operator.conditions import Problem, Rollout, status_from
from kvpilot.operator.status import LLMDeploymentStatus

lua51 = pytest.importorskip("lupa.lua51")
SCRIPT = (Path(__file__).resolve().parents[1] / "docs" / "argocd" / "health.lua").read_text()


def health(obj: dict) -> tuple[str, str]:
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)

    def to_lua(v):
        if isinstance(v, dict):
            return lua.table_from({k: to_lua(x) for k, x in v.items()})
        if isinstance(v, list):
            return lua.table_from([to_lua(x) for x in v])
        return v

    lua.globals().obj = to_lua(obj)
    hs = lua.execute(SCRIPT)
    return hs["status"], hs["message"]


def llmd(status: LLMDeploymentStatus | None, generation: int = 3) -> dict:
    obj = {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment",
           "metadata": {"name": "chat", "namespace": "ml", "generation": generation}, "spec": {}}
    if status is not None:
        obj["status"] = status.dump()
    return obj


def status(rollout: Rollout, problems=(), generation: int = 3) -> LLMDeploymentStatus:
    return status_from(LLMDeploymentStatus(), rollout, list(problems), generation)


READY = Rollout(desired=2, replicas=2, ready=2, updated=2, available=2, up_to_date=True, deadline_exceeded=False)
ROLLING = Rollout(desired=2, replicas=2, ready=1, updated=1, available=1, up_to_date=True, deadline_exceeded=False)
STUCK = Rollout(desired=2, replicas=2, ready=0, updated=1, available=0, up_to_date=True, deadline_exceeded=True)


def test_no_status_yet_is_progressing():
    assert health(llmd(None)) == ("Progressing", "waiting for the kvpilot operator to observe generation 3")


def test_an_unobserved_generation_is_progressing_even_if_ready_before():
    assert health(llmd(status(READY, generation=2)))[0] == "Progressing"


def test_ready_is_healthy():
    assert health(llmd(status(READY))) == ("Healthy", "2/2 replicas ready")


def test_a_rollout_in_flight_is_progressing():
    state, message = health(llmd(status(ROLLING)))
    assert state == "Progressing" and message == "1/2 updated, 1/2 ready"


@pytest.mark.parametrize("rollout,problems,reason", [
    (READY, [Problem("SecretNotFound", "Secret k (spec.engine.apiKeySecretRef) does not exist")], "SecretNotFound"),
    (STUCK, [], "ProgressDeadlineExceeded"),
])
def test_degraded_names_the_reason(rollout, problems, reason):
    state, message = health(llmd(status(rollout, problems)))
    assert state == "Degraded" and message.startswith(reason + ": ")
