"""The reconcile's crash-safe order (status with the decision first, owned objects from
status.effective after) and the test-only fault hook, with a fake API: an operator killed
between the two writes loses and doubles nothing once it runs again."""
from __future__ import annotations

import functools

import pytest

from kvpilot.operator.runtime import faults
from kvpilot.operator.autotune.hook import autotune_step
from kvpilot.operator.reconcile import reconcile
from test_autotune_hook import PREEMPTING, T0, FakeKube, FakeReader, snap, spec_body


class Killed(BaseException):
    """Stands in for os._exit: nothing after it runs (BaseException: no handler catches it)."""


@pytest.fixture
def killable(monkeypatch):
    def exit_(code):
        raise Killed(code)
    monkeypatch.setattr(faults.os, "_exit", exit_)
    monkeypatch.setenv(faults.EXIT_AFTER_ENV, faults.STATUS_WRITTEN)


def configmaps(kube) -> list[str]:
    return [m["data"]["tuning.json"] for m, _ in kube.applied if m["kind"] == "ConfigMap"]


def statuses(kube) -> list[dict]:
    return [m["status"] for m, sub in kube.applied if sub == "status"]


def test_a_kill_after_the_status_write_is_healed_by_the_next_pass(killable, monkeypatch):
    kube = FakeKube()
    body = {"metadata": {"name": "tiny", "namespace": "demo", "uid": "u", "generation": 1},
            "spec": spec_body(seqs=64), "status": {}}
    hook = functools.partial(autotune_step, reader_factory=FakeReader([snap(**PREEMPTING)]))
    with pytest.raises(Killed) as killed:
        reconcile(kube, body, lambda c: hook(c, now=T0))
    assert killed.value.args == (faults.EXIT_CODE,)
    # the decision is durable in status; nothing acted on it yet
    (written,) = statuses(kube)
    lowered = written["effective"]["maxNumSeqs"]
    assert lowered < 64 and written["autotune"]["lastDecision"]["change"] == {"maxNumSeqs": [64, lowered]}
    assert configmaps(kube) == [] and not [m for m, _ in kube.applied if m["kind"] == "Deployment"]

    # restarted (the fault disarmed), within the interval: the same settings applied, no new decision
    monkeypatch.delenv(faults.EXIT_AFTER_ENV)
    body["status"] = written
    result = reconcile(kube, body, lambda c: hook(c, now=T0 + 1))
    assert f'"max_num_seqs": {lowered}' in configmaps(kube)[-1]
    assert result.status.effective.max_num_seqs == lowered
    history = result.status.autotune.history
    assert [d.change for d in history] == [{"maxNumSeqs": [64, lowered]}]  # once: not lost, not doubled
    # and again: idempotent
    body["status"] = result.status.dump()
    again = reconcile(kube, body, lambda c: hook(c, now=T0 + 2))
    assert configmaps(kube)[-1] == configmaps(kube)[-2] and len(again.status.autotune.history) == 1


def test_the_fault_fires_only_after_a_decision_that_changes_settings(killable):
    kube = FakeKube()
    body = {"metadata": {"name": "tiny", "namespace": "demo", "uid": "u", "generation": 1},
            "spec": spec_body(seqs=64), "status": {}}
    healthy = functools.partial(autotune_step, reader_factory=FakeReader([snap()]))
    result = reconcile(kube, body, lambda c: healthy(c, now=T0))  # a hold: no exit
    assert result.status.autotune.last_decision.action == "hold" and configmaps(kube)


def test_the_once_file_fires_the_fault_once(tmp_path, monkeypatch):
    marker = tmp_path / "fired"
    env = {faults.EXIT_AFTER_ENV: faults.STATUS_WRITTEN, faults.ONCE_FILE_ENV: str(marker)}
    codes = []
    monkeypatch.setattr(faults.os, "_exit", codes.append)
    assert faults.should_exit(faults.STATUS_WRITTEN, env) and not faults.should_exit("elsewhere", env)
    faults.exit_if_armed(faults.STATUS_WRITTEN, env)
    faults.exit_if_armed(faults.STATUS_WRITTEN, env)
    assert codes == [faults.EXIT_CODE] and marker.exists()
    assert not faults.should_exit(faults.STATUS_WRITTEN, {})  # unset: never


def test_observed_generation_moves_only_once_the_objects_are_applied():
    kube = FakeKube()
    body = {"metadata": {"name": "tiny", "namespace": "demo", "uid": "u", "generation": 2},
            "spec": spec_body(mode="Off"), "status": {"observedGeneration": 1}}
    result = reconcile(kube, body)
    first, last = statuses(kube)[0], statuses(kube)[-1]
    assert first["observedGeneration"] == 1 and last["observedGeneration"] == 2
    assert result.status.observed_generation == 2
