"""pod_health: the engine pods' container states -> Problems, and reconcile turning them
into Degraded with the reason (no cluster)."""
from __future__ import annotations

from kvpilot.operator.pod_health import pod_problems
from kvpilot.operator.reconcile import reconcile
from test_operator_reconcile import FakeKube, body


def pod(name: str, waiting: str | None = None, restarts: int = 0, last: dict | None = None,
        deleting: bool = False, init: bool = False) -> dict:
    cs = {"name": "engine", "restartCount": restarts,
          "state": {"waiting": {"reason": waiting, "message": "back-off 10s"}} if waiting else {"running": {}}}
    if last:
        cs["lastState"] = {"terminated": last}
    meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    key = "initContainerStatuses" if init else "containerStatuses"
    return {"metadata": meta, "status": {key: [cs]}}


CRASH = {"exitCode": 1, "reason": "Error", "message": "Traceback ...\nFileNotFoundError: /nonexistent/model\n"}


def test_a_crash_loop_names_pod_container_restarts_exit_code_and_message():
    (p,) = pod_problems([pod("tiny-1", "CrashLoopBackOff", 3, CRASH)])
    assert p.reason == "CrashLoopBackOff"
    assert p.message == ("pod tiny-1 container engine: CrashLoopBackOff, 3 restart(s); last exit code 1 (Error): "
                         "Traceback ... FileNotFoundError: /nonexistent/model")


def test_running_starting_and_deleted_pods_are_no_problem():
    assert pod_problems([pod("a"), pod("b", "ContainerCreating"),
                         pod("c", "CrashLoopBackOff", 2, CRASH, deleting=True)]) == []


def test_image_pull_and_init_containers_count_and_the_message_is_capped():
    long = {**CRASH, "message": "x" * 5000}
    probs = pod_problems([pod("b", "ImagePullBackOff"), pod("a", "CrashLoopBackOff", 1, long, init=True)])
    assert [p.reason for p in probs] == ["CrashLoopBackOff", "ImagePullBackOff"]  # pods by name
    assert len(probs[0].message) < 600 and "back-off 10s" in probs[1].message


def test_reconcile_is_degraded_by_a_crash_looping_pod_and_recovers():
    kube = FakeKube()
    kube.pods = [pod("tiny-1", "CrashLoopBackOff", 3, CRASH)]
    result = reconcile(kube, body({"model": {"source": "file:///nonexistent/model"}}))
    degraded, ready = result.status.condition("Degraded"), result.status.condition("Ready")
    assert (degraded.status, degraded.reason) == ("True", "CrashLoopBackOff") and "last exit code 1" in degraded.message
    assert (ready.status, ready.reason) == ("False", "CrashLoopBackOff")
    assert [p.reason for p in result.problems] == ["CrashLoopBackOff"]  # the handler posts it as a Warning Event
    kube.pods = [pod("tiny-2")]
    fixed = reconcile(kube, body({"model": {"source": "builtin:tiny"}}, result.status.dump()))
    assert fixed.status.condition("Degraded").status == "False" and fixed.ready
