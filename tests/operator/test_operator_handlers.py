"""The kopf handlers' error mapping, with a fake API (no cluster)."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

kopf = pytest.importorskip("kopf")

from kvpilot.operator import handlers  # noqa: E402
from kvpilot.operator.deployment_metrics import DeploymentMetrics  # noqa: E402
from kvpilot.operator.api.status import LLMDeploymentStatus  # noqa: E402


class FakeKube:
    def __init__(self, ready: bool):
        self.ready, self.applied = ready, []

    def apply(self, manifest, subresource="", **_):
        self.applied.append((manifest, subresource))
        if manifest["kind"] == "Deployment":
            n = 1 if self.ready else 0
            return {**manifest, "status": {"replicas": 1, "readyReplicas": n, "updatedReplicas": 1}}
        return manifest

    def get(self, *a):
        return None

    def list_pods(self, ns, selector):
        return list(getattr(self, "pods", []))

    def delete(self, *a):
        return False


@pytest.fixture
def fake(monkeypatch):
    def make(ready: bool) -> FakeKube:
        kube = FakeKube(ready)
        metrics = DeploymentMetrics(CollectorRegistry())
        monkeypatch.setattr(handlers, "_state", {"kube": kube, "hook": None, "deployment_metrics": metrics})
        monkeypatch.setattr(kopf, "warn", lambda *a, **k: None)
        return kube
    return make


def body(spec):
    return {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "tiny", "namespace": "demo", "uid": "u", "generation": 1}, "spec": spec}


def test_not_ready_is_a_temporary_error(fake):
    fake(ready=False)
    with pytest.raises(kopf.TemporaryError):
        handlers.on_change(body({"model": {"source": "builtin:tiny"}}))
    fake(ready=True)
    handlers.on_change(body({"model": {"source": "builtin:tiny"}}))  # ready: returns


def test_invalid_spec_is_permanent_and_sets_degraded(fake):
    kube = fake(ready=True)
    with pytest.raises(kopf.PermanentError, match="minReplicas"):
        handlers.on_change(body({"model": {"source": "builtin:tiny"},
                                 "autoscaling": {"minReplicas": 4, "maxReplicas": 2}}))
    (status, sub), = kube.applied
    assert sub == "status"
    degraded = next(c for c in status["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "minReplicas" in degraded["message"]


def test_timer_pass_never_raises(fake):
    fake(ready=False)
    handlers._pass(body({"model": {"source": "builtin:tiny"}}), "timer", retry=False)
    handlers._pass(body({"autoscaling": {"minReplicas": 4, "maxReplicas": 2}}), "timer", retry=False)


def test_a_pass_reconciles_the_freshest_object_not_the_events_body(fake, monkeypatch):
    """An event's body can predate the status the previous pass wrote (the autotuner's
    history lives there); reconciling it would write the older status back."""
    from types import SimpleNamespace
    kube = fake(ready=True)
    fresh = body({"model": {"source": "builtin:tiny"}})
    fresh["status"] = {"autotune": {"diagnosis": "HardwareBound"}}
    kube.get = lambda api_version, kind, ns, name: fresh if kind == "LLMDeployment" else None
    seen = []
    monkeypatch.setattr(handlers, "reconcile",
                        lambda k, b, h: seen.append(b) or SimpleNamespace(problems=[], ready=True,
                                                                          status=LLMDeploymentStatus()))
    handlers.on_change(body({"model": {"source": "builtin:tiny"}}))
    assert seen == [fresh]


def test_a_problem_is_announced_once_per_change_of_its_message(fake, monkeypatch):
    """A crash loop posts a Warning Event when Degraded's message changes (a new restart),
    not on every resync pass."""
    from test_pod_health import CRASH, pod
    kube = fake(ready=False)
    warned = []
    kube.create_event = lambda involved, type_, reason, message: warned.append(reason)
    obj = body({"model": {"source": "file:///nonexistent/model"}})
    kube.get = lambda api_version, kind, ns, name: obj if kind == "LLMDeployment" else None

    def run(restarts):
        kube.pods = [pod("tiny-1", "CrashLoopBackOff", restarts, CRASH)]
        kube.applied.clear()
        handlers._pass(obj, "timer", retry=False)
        obj["status"] = [m for m, sub in kube.applied if sub == "status"][-1]["status"]

    run(2)
    run(2)
    assert warned == ["CrashLoopBackOff"]
    run(3)
    assert warned == ["CrashLoopBackOff", "CrashLoopBackOff"]


def test_a_process_unsure_of_its_leadership_writes_nothing(fake):
    """With --leader-elect, kopf's memo carries the elector's check; a frozen leader whose
    renew deadline passed must not run a pass before it notices and exits."""
    from prometheus_client import REGISTRY

    kube = fake(ready=True)
    handlers.on_change(body({"model": {"source": "builtin:tiny"}}), memo=kopf.Memo(leading=lambda: False))
    assert kube.applied == []
    handlers._pass(body({"model": {"source": "builtin:tiny"}}), "timer", retry=False, leading=lambda: False)
    assert kube.applied == []
    assert REGISTRY.get_sample_value("kvpilot_operator_reconciles_total",
                                     {"trigger": "change", "result": "not-leader"}) >= 1


def test_the_resync_skips_an_object_an_event_pass_holds_and_uses_the_pass_hook(fake, monkeypatch):
    """A resync reconcile finding the object's lock held (an event-triggered pass doing the
    same work) skips instead of tying up a worker; otherwise it runs with the pass's hook."""
    from types import SimpleNamespace
    fake(ready=True)
    seen = []
    monkeypatch.setattr(handlers, "reconcile",
                        lambda k, b, h: seen.append(h) or SimpleNamespace(problems=[], ready=True,
                                                                          status=LLMDeploymentStatus()))
    lock = handlers._lock("demo", "tiny")
    with lock:
        handlers._resync_one(body({"model": {"source": "builtin:tiny"}}), "the pass's hook")
    assert seen == []
    handlers._resync_one(body({"model": {"source": "builtin:tiny"}}), "the pass's hook")
    assert seen == ["the pass's hook"]
    assert lock.acquire(blocking=False)  # released after the pass
    lock.release()


def test_the_resync_loop_reconciles_the_fleet_concurrently_with_one_hook_per_pass(fake, monkeypatch):
    import asyncio
    import threading
    from types import SimpleNamespace

    from kvpilot.operator.runtime.resync import ResyncPool
    kube = fake(ready=True)
    spec = body({"model": {"source": "builtin:tiny"}})
    fleet = [{**spec, "metadata": {"name": f"d{i}", "namespace": "demo"}} for i in range(12)]
    kube.list_llmdeployments = lambda ns=None: fleet
    hooks = iter(range(100))
    monkeypatch.setattr(handlers, "autotune_step_for_pass", lambda: f"hook-{next(hooks)}")
    monkeypatch.setattr(handlers, "RESYNC_SECONDS", 0.05)
    barrier = threading.Barrier(4, timeout=10)  # passes only when 4 reconciles run at once
    seen: list[tuple[str, str]] = []
    arrivals = iter(range(100))

    def reconcile(k, b, h):
        if next(arrivals) < 4:  # the first four meet at the barrier
            barrier.wait()
        seen.append((b["metadata"]["name"], h))
        return SimpleNamespace(problems=[], ready=True, status=LLMDeploymentStatus())
    monkeypatch.setattr(handlers, "reconcile", reconcile)

    async def scenario():
        pool = ResyncPool(handlers._resync_one, max_concurrent=4)
        loop_task = asyncio.create_task(handlers._resync_loop(pool))
        deadline = asyncio.get_running_loop().time() + 20
        while len({n for n, _ in seen}) < 12 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        loop_task.cancel()
        pool.shutdown()
    asyncio.run(scenario())
    assert {n for n, _ in seen} == {f"d{i}" for i in range(12)}
    # One hook (one shared Prometheus read) per pass: every deployment's first reconcile
    # used the first pass's hook. Passes may overlap (a pass does not wait for the last
    # one's stragglers), so the order of `seen` across passes is not asserted.
    first_hook = {}
    for name, hook in seen:
        first_hook.setdefault(name, hook)
    assert first_hook == {f"d{i}": "hook-0" for i in range(12)}


def test_a_pass_records_the_deployments_series(fake):
    fake(ready=True)
    handlers._pass(body({"model": {"source": "builtin:tiny"}, "engine": {"maxNumSeqs": 24}}), "timer", retry=False)
    registry = handlers._state["deployment_metrics"].registry
    labels = {"llmdeployment_namespace": "demo", "llmdeployment": "tiny"}
    assert registry.get_sample_value("kvpilot_operator_setting", {**labels, "setting": "max_num_seqs"}) == 24
    assert registry.get_sample_value("kvpilot_operator_condition", {**labels, "condition": "Ready", "status": "True",
                                                                     "reason": "AllReplicasReady"}) == 1
