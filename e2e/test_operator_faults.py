"""Faults on the local cluster, against the real operator from the chart (resync every
second, conftest's `tuned_operator`), each asserting convergence with no lost or doubled
change (issue 15, item 5):

    1. Prometheus unreachable, then answering garbage (not JSON, HTTP 500, a wrong shape,
       NaN/Inf values): MetricsAvailable says why, the diagnosis is NoData, nothing moves;
       pointed back at the real Prometheus, MetricsAvailable turns True;
    2. an engine pod crash-looping: Degraded with the reason, the container, the exit code
       and a Warning Event; Ready again once the spec is fixed;
    3. the API server killed (-9) while reconciles and the autotuner run, then started again:
       Ready, settings unchanged, no change doubled, a spec change afterwards is applied;
    4. the operator killed between writing status (a new autotune decision) and the tuning
       ConfigMap: after its restart the ConfigMap equals status.effective and the history
       holds each change once, in an unbroken chain.

Each prints its measured convergence time (pytest -s); docs/reliability.md
quotes them. The fault-injected operator (4) runs last: its env var rolls the operator pod."""
from __future__ import annotations

import json
import time
import uuid

import pytest

from fakeprom import FakePrometheus
from kvpilot.operator.autotune.hook import SERIES_LABEL
from localcluster.ports import free_port
from localcluster.restart import restart_apiserver
from tiny_autotune import Load, applied_changes, autotune, events, trail
from test_operator import (OPERATOR_NS, condition, diagnose, engine_pods, is_ready, llmd, operator_leader,
                           operator_ready, tuning)

pytestmark = pytest.mark.e2e
ENGINE_IMAGE = True  # real engine pods (builtin:tiny): conftest builds the engine image
SPOILS_OPERATOR = True  # it kills the operator mid-change and restarts the API server: the next module installs afresh

FAULT_EXIT_CODE = 86  # kvpilot.operator.runtime.faults.EXIT_CODE
READY_S = 300


def spec(prometheus_url: str, *, mode: str = "Auto", seqs: int = 16, kv: str = "8Mi",
         source: str = "builtin:tiny", seqs_range: tuple[int, int] = (2, 64)) -> dict:
    return {"model": {"source": source, "servedName": "tiny"},
            "engine": {"maxNumSeqs": seqs, "maxModelLen": 512, "maxNumBatchedTokens": 512,
                       "blockSize": 16, "kvCacheMemory": kv},
            "resources": {"gpus": 0, "cpu": "500m", "memory": "1Gi"},
            "replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 1},
            "autotune": {"mode": mode, "interval": "2s", "window": "10s", "cooldown": "5s",
                         "prometheus": {"url": prometheus_url},
                         "maxNumSeqs": {"min": seqs_range[0], "max": seqs_range[1]},
                         "maxModelLen": {"min": 128, "max": 512}}}


def create(cluster, body_spec: dict) -> str:
    ns = f"f-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(ns)
    cluster.apply({"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment",
                   "metadata": {"name": "tiny", "namespace": ns}, "spec": body_spec})
    return ns


def patch(cluster, ns: str, spec_patch: dict) -> None:
    cluster.kubectl("patch", "llmd", "tiny", "-n", ns, "--type=merge", "-p", json.dumps({"spec": spec_patch}))


def status(kube, ns: str) -> dict:
    return (llmd(kube, ns) or {}).get("status") or {}


def tuned_settings(kube, ns: str) -> dict:
    """The tuning ConfigMap's settings, as the engine reads them."""
    text = tuning(kube, ns)
    return json.loads(text) if text else {}


def seqs_in_configmap(kube, ns: str) -> int | None:
    return tuned_settings(kube, ns).get("max_num_seqs")


def settle(wait_for, kube, ns: str, predicate, timeout: float, what: str, cluster=None):
    try:
        return wait_for(predicate, timeout=timeout, interval=0.5, what=what)
    except TimeoutError as e:
        extra = diagnose(cluster, ns) if cluster is not None else ""
        raise AssertionError(f"{e}\nstatus: {json.dumps(status(kube, ns))[:3000]}\n{trail(kube, ns)}\n{extra}") \
            from None


def assert_history_is_a_chain(kube, ns: str, setting: str, start: int) -> list[dict]:
    """Every applied change of `setting` starts where the previous one ended (none lost), no
    decision is recorded twice (none doubled), and the chain ends at status.effective (all
    read from one GET of the object)."""
    st = status(kube, ns)
    changes = [d for d in (st.get("autotune") or {}).get("history", [])
               if setting in d.get("change", {}) and d.get("applied")]
    times = [d["time"] for d in changes]
    assert len(times) == len(set(times)), f"a decision recorded twice: {changes}"
    value = start
    for d in changes:
        old, new = d["change"][setting]
        assert old == value, f"change {d['change']} starts at {old}, not at {value}: a change was lost or doubled"
        value = new
    assert st["effective"][setting] == value, (st["effective"], changes)
    return changes


# --- 1. Prometheus unreachable, then answering garbage --------------------------------------
def test_prometheus_unreachable_or_garbage_holds_every_setting(cluster, tuned_operator, wait_for):
    kube = tuned_operator
    closed = f"http://{cluster.gateway}:{free_port(cluster.gateway)}"  # nothing listens there
    t0 = time.monotonic()
    ns = create(cluster, spec(closed, seqs=16))
    times = {}
    try:
        def metrics(reason: str, needle: str):
            def check():
                c = condition(llmd(kube, ns), "MetricsAvailable")
                return c if c.get("status") == "False" and c.get("reason") == reason and needle in c["message"] \
                    else None
            return check

        c = settle(wait_for, kube, ns, metrics("PrometheusUnreachable", closed), 120,
                   "MetricsAvailable False (PrometheusUnreachable)", cluster)
        times["unreachable"] = time.monotonic() - t0
        assert closed in c["message"] and "Error" in c["message"], c
        assert autotune(kube, ns).get("diagnosis") == "NoData"
        settle(wait_for, kube, ns, lambda: is_ready(kube, ns) and engine_pods(kube, ns), READY_S,
               "the LLMDeployment to be Ready", cluster)

        with FakePrometheus(cluster.gateway, labels={"namespace": ns, SERIES_LABEL: "tiny"}) as fake:
            patch(cluster, ns, {"autotune": {"prometheus": {"url": fake.url}}})
            for mode, reason, needle in (("not-json", "BadResponse", "JSONDecodeError"),
                                         ("http-500", "BadResponse", "Status Code 500"),
                                         ("wrong-shape", "BadResponse", "not a list"),
                                         ("nan", "NoData", "no value for")):
                fake.mode, t = mode, time.monotonic()
                seen = fake.queries
                settle(wait_for, kube, ns, lambda: fake.queries > seen and metrics(reason, needle)(), 60,
                       f"MetricsAvailable False ({reason}, {needle!r}) with Prometheus answering {mode}")
                times[mode] = time.monotonic() - t
                assert fake.url in condition(llmd(kube, ns), "MetricsAvailable")["message"]
                assert autotune(kube, ns).get("diagnosis") == "NoData"
        # nothing moved through all of it
        st = status(kube, ns)
        assert st["effective"]["maxNumSeqs"] == 16 and st["effective"]["maxModelLen"] == 512, st["effective"]
        assert tuned_settings(kube, ns).get("max_num_seqs") == 16
        assert not applied_changes(kube, ns, "maxNumSeqs") and not applied_changes(kube, ns, "maxModelLen")
        assert not events(kube, ns, "AutotuneChange")

        t = time.monotonic()
        patch(cluster, ns, {"autotune": {"prometheus": {"url": cluster.prometheus_url}}})
        settle(wait_for, kube, ns, lambda: condition(llmd(kube, ns), "MetricsAvailable").get("status") == "True",
               120, "MetricsAvailable True from the real Prometheus", cluster)
        times["recovered"] = time.monotonic() - t
        print(f"\n[prometheus faults] condition set after: {', '.join(f'{k} {v:.1f}s' for k, v in times.items())}; "
              f"max_num_seqs held at 16, no change recorded")
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# --- 2. an engine pod crash-looping -----------------------------------------------------------
def test_crash_looping_engine_is_degraded_with_the_reason_then_recovers(cluster, tuned_operator, wait_for):
    kube = tuned_operator
    t0 = time.monotonic()
    ns = create(cluster, spec(cluster.prometheus_url, mode="Off", source="file:///nonexistent/model"))
    try:
        def degraded():
            c = condition(llmd(kube, ns), "Degraded")
            return c if c.get("status") == "True" and c.get("reason") == "CrashLoopBackOff" else None
        c = settle(wait_for, kube, ns, degraded, 240, "Degraded (CrashLoopBackOff)", cluster)
        t_degraded = time.monotonic() - t0
        assert "container engine" in c["message"] and "last exit code" in c["message"], c
        assert condition(llmd(kube, ns), "Ready")["status"] == "False"
        warned = settle(wait_for, kube, ns, lambda: [e for e in events(kube, ns, "CrashLoopBackOff")
                                                     if e.get("type") == "Warning"], 60,
                        "a Warning Event CrashLoopBackOff on the LLMDeployment")
        t = time.monotonic()
        patch(cluster, ns, {"model": {"source": "builtin:tiny"}})
        settle(wait_for, kube, ns, lambda: is_ready(kube, ns) and condition(llmd(kube, ns), "Degraded")
               .get("status") == "False", READY_S, "Ready and not Degraded after the fix", cluster)
        t_fixed = time.monotonic() - t
        print(f"\n[crash loop] Degraded CrashLoopBackOff {t_degraded:.1f}s after create; message: {c['message']!r}; "
              f"{len(warned)} Warning Event(s); Ready again {t_fixed:.1f}s after the fix")
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# --- 3. the API server restarted mid-reconcile ---------------------------------------------------
def test_apiserver_restart_mid_reconcile_converges_without_a_change(cluster, tuned_operator, wait_for):
    kube = tuned_operator
    ns = create(cluster, spec(cluster.prometheus_url, seqs=16))
    try:
        settle(wait_for, kube, ns, lambda: is_ready(kube, ns) and engine_pods(kube, ns)
               and condition(llmd(kube, ns), "MetricsAvailable").get("status") == "True", READY_S,
               "Ready with metrics", cluster)
        before = status(kube, ns)
        changes_before = applied_changes(kube, ns, "maxNumSeqs")
        op = operator_leader(kube)  # the chart runs two; the leader reconciles
        op_restarts = op["status"]["containerStatuses"][0]["restartCount"]
        t0 = time.monotonic()
        up_s = restart_apiserver(cluster, down_s=5)  # kill -9 while the 1 s resync runs
        # converged: Ready, the same settings in status and in the ConfigMap, nothing decided
        settle(wait_for, kube, ns, lambda: is_ready(kube, ns), 120, "Ready after the restart", cluster)
        t_ready = time.monotonic() - t0
        after = status(kube, ns)
        assert after["effective"] == before["effective"], (before["effective"], after["effective"])
        assert seqs_in_configmap(kube, ns) == before["effective"]["maxNumSeqs"]
        assert applied_changes(kube, ns, "maxNumSeqs") == changes_before
        # still reconciling: a spec change made after the restart is applied
        patch(cluster, ns, {"autotune": {"interval": "3s"}})
        generation = llmd(kube, ns)["metadata"]["generation"]
        settle(wait_for, kube, ns, lambda: status(kube, ns).get("observedGeneration") == generation, 60,
               "the operator to observe a spec change made after the restart", cluster)
        t_spec = time.monotonic() - t0
        (op,) = [p for p in operator_ready(kube) if p["metadata"]["name"] == op["metadata"]["name"]]
        restarts = op["status"]["containerStatuses"][0]["restartCount"] - op_restarts
        print(f"\n[apiserver restart] API server down 5s, healthy {up_s:.1f}s after its start; LLMDeployment "
              f"Ready {t_ready:.1f}s and a new spec change observed {t_spec:.1f}s after the kill; "
              f"settings unchanged ({after['effective']}); operator container restarts: {restarts}")
        assert restarts == 0, "the operator had to restart to recover from the API server's restart"
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# --- 4. the operator killed between status and the tuning ConfigMap ------------------------------
def operator_exit(kube) -> dict | None:
    """The operator container's last termination, if it ended with the fault's exit code."""
    pods = kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/pods",
                    params={"labelSelector": "app.kubernetes.io/name=kvpilot-operator"})["items"]
    for p in pods:
        for cs in p.get("status", {}).get("containerStatuses") or []:
            term = (cs.get("lastState") or {}).get("terminated") or {}
            if term.get("exitCode") == FAULT_EXIT_CODE:
                return term
    return None


def test_operator_killed_between_status_and_configmap_loses_and_doubles_nothing(cluster, tuned_operator,
                                                                               wait_for):
    kube = tuned_operator
    # Armed once: the marker under the pod's emptyDir survives the container's restart.
    cluster.kubectl("set", "env", "deploy/kvpilot", "-n", OPERATOR_NS,
                    "KVPILOT_FAULT_EXIT_AFTER=status-written", "KVPILOT_FAULT_ONCE_FILE=/scratch/fault-fired")
    wait_for(lambda: any(any(e.get("name") == "KVPILOT_FAULT_EXIT_AFTER"
                             for e in p["spec"]["containers"][0].get("env", []))
                         for p in operator_ready(kube)), timeout=180, interval=1,
             what="the fault-armed operator pod to be Ready")
    # 2 MiB of KV at 4 KiB/token = 512 tokens; 64 + 96-token requests: 3 fit, 64 seqs preempt.
    ns = create(cluster, spec(cluster.prometheus_url, mode="Recommend", seqs=64, kv="2Mi"))
    try:
        settle(wait_for, kube, ns, lambda: is_ready(kube, ns) and engine_pods(kube, ns), READY_S,
               "Ready", cluster)
        (pod,) = engine_pods(kube, ns)
        with Load(pod, concurrency=32, input_len=64, output_len=96):
            settle(wait_for, kube, ns, lambda: ((autotune(kube, ns).get("snapshot") or {}).get("kvUsageMean")
                                                or 0) >= 0.8, 120, "a window of steady load")
            patch(cluster, ns, {"autotune": {"mode": "Auto"}})
            t0 = time.monotonic()
            term = settle(wait_for, kube, ns, lambda: operator_exit(kube), 120,
                          "the operator to exit at the fault point after an autotune decision", cluster)
            t_crash = time.monotonic() - t0
            # the status written before the exit already carries the decision
            crashed_at = status(kube, ns)["effective"]["maxNumSeqs"]
            cm_at_crash = seqs_in_configmap(kube, ns)
        t1 = time.monotonic()
        settle(wait_for, kube, ns, lambda: operator_ready(kube) and seqs_in_configmap(kube, ns)
               == status(kube, ns)["effective"]["maxNumSeqs"], 120,
               "the restarted operator to apply status.effective to the ConfigMap", cluster)
        t_healed = time.monotonic() - t1
        changes = assert_history_is_a_chain(kube, ns, "maxNumSeqs", 64)
        assert changes and changes[0]["change"]["maxNumSeqs"][0] == 64
        assert crashed_at < 64, f"status at the crash did not hold the decision: maxNumSeqs {crashed_at}"
        assert len(events(kube, ns, "AutotuneChange")) + len(events(kube, ns, "AutotuneRevert")) >= len(changes)
        print(f"\n[operator killed after status] exit {term.get('exitCode')} {t_crash:.1f}s after Auto; status "
              f"held maxNumSeqs {crashed_at} while the ConfigMap said {cm_at_crash}; ConfigMap = "
              f"status.effective {t_healed:.1f}s after the load stopped; applied changes: "
              f"{[d['change']['maxNumSeqs'] for d in changes]}")
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
