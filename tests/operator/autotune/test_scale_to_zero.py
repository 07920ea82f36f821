"""Scale to zero: the pure rule, its PromQL, and the autotune hook taking a quiet
deployment with minReplicas 0 to zero replicas through the scale subresource (and
leaving every other deployment to the usual rules)."""
from __future__ import annotations

import pytest

from kvpilot.operator.autotune.decision import Action, Bounds, Decision, Diagnosis, Range, Settings
from kvpilot.operator.autotune.history import History, HistoryEntry
from kvpilot.operator.autotune.hook import autotune_step
from kvpilot.operator.autotune.prometheus.queries import Target, build_idle_queries
from kvpilot.operator.autotune.scale_to_zero import IdleReport, last_to_zero, quiet, scale_to_zero
from test_autotune_hook import T0, FakeKube, FakeReader, ctx, snap, spec_body

BOUNDS = Bounds(max_num_seqs=Range(4, 64), max_model_len=Range(128, 2048), replicas=Range(0, 3))
CUR = Settings(max_num_seqs=64, max_model_len=512, replicas=1, block_size=16, max_num_batched_tokens=512)
IDLE = IdleReport(requests=0.0, in_flight=0.0, youngest_pod_s=1200.0)


def test_rule_scales_to_zero_only_after_a_whole_idle_period():
    d = scale_to_zero(IDLE, CUR, BOUNDS, 900.0, T0)
    assert d.action is Action.CHANGE and d.change == {"replicas": (1, 0)}
    assert "no request for 15m" in d.reason and "youngest 20m" in d.reason
    assert scale_to_zero(IdleReport(1.0, 0.0, 1200.0), CUR, BOUNDS, 900.0, T0) is None  # a request came
    assert scale_to_zero(IdleReport(0.0, 1.0, 1200.0), CUR, BOUNDS, 900.0, T0) is None  # one is running
    assert scale_to_zero(IdleReport(0.0, 0.0, 300.0), CUR, BOUNDS, 900.0, T0) is None  # a pod just woke
    assert scale_to_zero(IdleReport(None, None, None), CUR, BOUNDS, 900.0, T0) is None  # no series at all
    assert scale_to_zero(None, CUR, BOUNDS, 900.0, T0) is None
    floor_one = Bounds(BOUNDS.max_num_seqs, BOUNDS.max_model_len, Range(1, 3))
    assert scale_to_zero(IDLE, CUR, floor_one, 900.0, T0) is None  # minReplicas 1: never
    at_zero = Settings(**{**CUR.__dict__, "replicas": 0})
    assert scale_to_zero(IDLE, at_zero, BOUNDS, 900.0, T0) is None
    hpa = Settings(**{**CUR.__dict__, "hpa_owns_scale": True})
    assert scale_to_zero(IDLE, hpa, BOUNDS, 900.0, T0) is None
    three = Settings(**{**CUR.__dict__, "replicas": 3})
    assert scale_to_zero(IDLE, three, BOUNDS, 900.0, T0).change == {"replicas": (3, 0)}


def test_rule_waits_a_whole_period_after_its_last_scale_to_zero():
    """Within scaleToZeroAfter of going to zero the deployment was woken since, and the old
    pod's series may still be in Prometheus: no second decision on them."""
    assert scale_to_zero(IDLE, CUR, BOUNDS, 900.0, T0, last_zero=T0 - 5) is None
    assert scale_to_zero(IDLE, CUR, BOUNDS, 900.0, T0, last_zero=T0 - 900).change == {"replicas": (1, 0)}
    zero = Decision(T0 - 5, Diagnosis.IDLE, Action.CHANGE, "idle", change={"replicas": (1, 0)})
    out = Decision(T0 - 60, Diagnosis.SCHEDULER_BOUND, Action.CHANGE, "scale out", change={"replicas": (1, 2)})
    assert last_to_zero(History(entries=(HistoryEntry(out, True), HistoryEntry(zero, True)))) == T0 - 5
    assert last_to_zero(History(entries=(HistoryEntry(zero, False),))) is None  # advised, not applied
    assert last_to_zero(History()) is None


def test_quiet_means_no_request_in_the_window():
    assert quiet(snap(request_rate_per_s=0.0, num_running=0.0, num_waiting=0.0))
    assert not quiet(snap(request_rate_per_s=0.0, num_running=1.0, num_waiting=0.0))
    assert not quiet(snap())


def test_idle_queries():
    q = build_idle_queries(Target("demo", "tiny", "serving_kvpilot_dev_llmdeployment"), 900)
    sel = 'namespace="demo",serving_kvpilot_dev_llmdeployment="tiny"'
    assert q["requests"] == f"sum(increase(vllm:e2e_request_latency_seconds_count{{{sel}}}[900s]))"
    assert q["youngest_pod_s"] == f"min(time() - process_start_time_seconds{{{sel}}})"
    assert "vllm:num_requests_waiting" in q["in_flight"] and "vllm:num_requests_running" in q["in_flight"]


class IdleReader(FakeReader):
    def __init__(self, snaps, idle):
        super().__init__(snaps)
        self.idle_report, self.idle_calls = idle, []

    def idle(self, namespace, name, period_s):
        self.idle_calls.append((namespace, name, period_s))
        if isinstance(self.idle_report, Exception):
            raise self.idle_report
        return self.idle_report


QUIET = dict(request_rate_per_s=0.0, num_running=0.0, num_waiting=0.0, kv_usage_mean=0.0, kv_usage_max=0.0,
             queue_time_p95_s=None, ttft_p95_s=None)


def zero_spec(mode="Auto", min_replicas=0):
    body = spec_body(mode=mode)
    body["autoscaling"] = {"minReplicas": min_replicas, "maxReplicas": 3, "scaleToZeroAfter": "10m"}
    return body


def test_hook_scales_a_quiet_deployment_to_zero_through_the_scale_subresource():
    reader, kube = IdleReader([snap(**QUIET)], IDLE), FakeKube()
    out = autotune_step(ctx(zero_spec(), kube=kube), reader_factory=reader, now=T0)
    assert reader.idle_calls == [("demo", "tiny", 600.0)]
    assert kube.scaled == [("demo", "tiny", 0)]
    r = out.status()
    assert r.last_decision.action == "change" and r.last_decision.applied is True
    assert r.last_decision.change == {"replicas": [1, 0]} and "scale 1 -> 0" in r.last_decision.reason


@pytest.mark.parametrize("case", ["busy", "recommend", "min-one", "not-idle", "read-fails"])
def test_hook_leaves_zero_alone_unless_every_condition_holds(case):
    snaps = [snap()] if case == "busy" else [snap(**QUIET)]
    idle = {"not-idle": IdleReport(3.0, 0.0, 1200.0), "read-fails": ConnectionError("refused")}.get(case, IDLE)
    reader, kube = IdleReader(snaps, idle), FakeKube()
    body = zero_spec(mode="Recommend" if case == "recommend" else "Auto",
                     min_replicas=1 if case == "min-one" else 0)
    out = autotune_step(ctx(body, kube=kube), reader_factory=reader, now=T0)
    assert kube.scaled == []
    if case == "recommend":  # advised, not applied
        assert "scale 1 -> 0" in out.status().last_decision.reason and not out.status().last_decision.applied
    if case in ("busy", "min-one"):
        assert reader.idle_calls == []  # the longer period is only asked about quiet deployments


def test_hook_does_not_take_a_woken_deployment_back_to_zero_on_the_old_pods_metrics():
    """Seen on the local cluster: scaled to zero, woken by the gateway a second later, then
    scaled to zero again 5 s later on the old pod's series (youngest 40s), leaving the held
    requests to time out. History carries the first decision through status."""
    kube = FakeKube()
    first = autotune_step(ctx(zero_spec(), kube=kube), reader_factory=IdleReader([snap(**QUIET)], IDLE), now=T0)
    assert kube.scaled == [("demo", "tiny", 0)]
    status = {"autotune": first.status().dump()}
    woken = ctx(zero_spec(), status=status, kube=kube)  # spec.replicas 1 again (the gateway's write)
    again = autotune_step(woken, reader_factory=IdleReader([snap(**QUIET)], IDLE), now=T0 + 10)
    assert kube.scaled == [("demo", "tiny", 0)]  # no second scale to zero
    assert "scale 1 -> 0" not in again.status().last_decision.reason
    later = autotune_step(ctx(zero_spec(), status={"autotune": again.status().dump()}, kube=kube),
                          reader_factory=IdleReader([snap(**QUIET)], IDLE), now=T0 + 600)
    assert kube.scaled == [("demo", "tiny", 0)] * 2  # a whole period later, idle again: zero
    assert "scale 1 -> 0" in later.status().last_decision.reason
