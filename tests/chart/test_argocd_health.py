"""docs/argocd/health.lua, Argo CD's health check for LLMDeployment, run in Lua 5.1 (the
language of Argo CD's gopher-lua) through lupa, against statuses the operator's own
status code writes."""
from __future__ import annotations

from pathlib import Path

import pytest

from status_examples import MISSING_SECRET, READY, ROLLING, STUCK, llmd, status

lua51 = pytest.importorskip("lupa.lua51")
SCRIPT = (Path(__file__).resolve().parents[2] / "docs" / "argocd" / "health.lua").read_text()


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
    (READY, [MISSING_SECRET], "SecretNotFound"),
    (STUCK, [], "ProgressDeadlineExceeded"),
])
def test_degraded_names_the_reason(rollout, problems, reason):
    state, message = health(llmd(status(rollout, problems)))
    assert state == "Degraded" and message.startswith(reason + ": ")
