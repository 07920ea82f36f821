"""The operator's autotune hook with a fake Prometheus reader and a fake API: interval
gating, Auto vs Recommend, the scale subresource, HPA ownership, Events and metrics,
capacity from the pods' own KV gauges, NoData on a Prometheus failure, the prefix-cache
warning, and the whole loop through reconcile() with the history kept in status."""
from __future__ import annotations

import functools

import pytest
from prometheus_client import REGISTRY

from kvpilot.operator.autotune.hook import SERIES_LABEL, autotune_step, parse_duration, thresholds_for
from kvpilot.operator.autotune.report import rfc3339
from kvpilot.operator.autotune.signals import PodSettings, MetricsSnapshot
from kvpilot.operator.manifests.objects import Owner
from kvpilot.operator.autotune.context import AutotuneContext
from kvpilot.operator.reconcile import parse_spec, reconcile
from kvpilot.operator.api.status import Effective, LLMDeploymentStatus

T0 = 1_800_000_000.0
MiB = 2**20
OWNER = Owner("tiny", "demo", "u")


class FakeReader:
    def __init__(self, snaps):
        self.snaps, self.calls = list(snaps), []

    def __call__(self, url):  # the factory
        self.url = url
        return self

    def snapshot(self, namespace, name, window_s):
        self.calls.append((namespace, name, window_s))
        s = self.snaps.pop(0) if len(self.snaps) > 1 else self.snaps[0]
        if isinstance(s, Exception):
            raise s
        return s


def judged(out):
    """The autotuner's conditions other than MetricsAvailable (tested on its own)."""
    return [c for c in out.conditions if c.type != "MetricsAvailable"]


class FakeKube:
    """The API the hook uses, plus enough of reconcile's (apply/get/delete)."""

    def __init__(self, hpa=False):
        self.hpa, self.scaled, self.events, self.applied = hpa, [], [], []

    def scale_targeted_by_hpa(self, ns, name):
        if isinstance(self.hpa, Exception):
            raise self.hpa
        return self.hpa

    def patch_scale(self, ns, name, replicas):
        self.scaled.append((ns, name, replicas))

    def create_event(self, involved, type_, reason, message):
        self.events.append((involved["kind"], involved["name"], type_, reason, message))

    def apply(self, manifest, subresource="", **_):
        self.applied.append((manifest, subresource))
        if manifest["kind"] == "Deployment":
            n = manifest["spec"]["replicas"]
            return {**manifest, "metadata": {**manifest["metadata"], "generation": 1},
                    "status": {"observedGeneration": 1, "replicas": n, "readyReplicas": n, "updatedReplicas": n,
                               "availableReplicas": n}}
        return manifest

    def get(self, *a):
        return None

    def list_pods(self, ns, selector):
        return list(getattr(self, "pods", []))

    def delete(self, *a):
        return False


def snap(t=T0, seqs=64, model_len=512, **kw) -> MetricsSnapshot:
    base = dict(time=t, window_s=15.0, kv_usage_mean=0.40, kv_usage_max=0.55, preemptions_per_s=0.0,
                queue_time_p95_s=0.05, ttft_p95_s=0.1, num_waiting=0.0, num_running=4.0,
                request_rate_per_s=2.0, request_len_p99=160.0, prefix_hit_rate=0.5,
                length_refusals_per_s=0.0, kv_cache_bytes=2 * MiB, kv_bytes_per_token=4096,
                pods=(PodSettings("tiny-0", seqs, model_len),))
    base.update(kw)
    return MetricsSnapshot(**base)


PREEMPTING = dict(preemptions_per_s=2.0, kv_usage_mean=0.97, kv_usage_max=1.0, num_waiting=10.0, num_running=40.0,
                  queue_time_p95_s=3.0)
QUEUED_FULL = dict(preemptions_per_s=0.0, kv_usage_mean=0.95, kv_usage_max=1.0, num_waiting=10.0,
                   queue_time_p95_s=3.0, request_len_p99=300.0)
SCHED = dict(queue_time_p95_s=2.0, num_waiting=8.0, kv_usage_mean=0.10, kv_usage_max=0.15)


def spec_body(mode="Auto", seqs=64, seqs_range=(4, 64), replicas=1, shared_prefix=False, **autotune):
    return {"model": {"source": "builtin:tiny"},
            "engine": {"maxNumSeqs": seqs, "maxModelLen": 512, "maxNumBatchedTokens": 512, "kvCacheMemory": "2Mi"},
            "replicas": replicas, "autoscaling": {"minReplicas": 1, "maxReplicas": 3},
            "autotune": {"mode": mode, "interval": "5s", "window": "15s", "cooldown": "10s",
                         "prometheus": {"url": "http://prom:9090"}, "sharedPrefix": shared_prefix,
                         "maxNumSeqs": {"min": seqs_range[0], "max": seqs_range[1]},
                         "maxModelLen": {"min": 128, "max": 2048}, **autotune}}


def ctx(spec: dict, status: dict | None = None, kube=None, effective=None) -> AutotuneContext:
    s = parse_spec({"spec": spec})
    eff = effective or Effective(max_num_seqs=s.engine.max_num_seqs, max_model_len=s.engine.max_model_len,
                                 replicas=s.replicas)
    return AutotuneContext(OWNER, s, LLMDeploymentStatus.model_validate(status or {}), eff, kube)


def counter(name, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --- tests ------------------------------------------------------------------------------

def test_parse_duration():
    assert parse_duration("30s") == 30 and parse_duration("2m") == 120 and parse_duration("1m30s") == 90
    assert parse_duration("500ms") == 0.5
    with pytest.raises(ValueError):
        parse_duration("5x")


def test_series_label_matches_prometheus_labelmap_of_the_pod_label():
    assert SERIES_LABEL == "serving_kvpilot_dev_llmdeployment"


def test_auto_lowers_max_num_seqs_with_an_event_a_metric_and_a_capacity_plan():
    reader, kube = FakeReader([snap(**PREEMPTING)]), FakeKube()
    before = counter("kvpilot_operator_autotune_decisions_total", llmdeployment_namespace="demo", llmdeployment="tiny",
                     action="change", setting="max_num_seqs")
    out = autotune_step(ctx(spec_body(), kube=kube), reader_factory=reader, now=T0)
    assert reader.url == "http://prom:9090" and reader.calls == [("demo", "tiny", 15.0)]
    r = out.status()
    assert r.diagnosis == "PreemptionBound" and r.last_decision.action == "change"
    assert r.last_decision.change == {"maxNumSeqs": [64, 32]} and r.last_decision.applied is True
    # 2 MiB / 4 KiB = 512 tokens; p99 160 tokens -> 160-token sequences -> 3 fit
    assert r.capacity.max_concurrent_seqs == 3 and r.capacity.bytes_per_token == 4096
    assert r.capacity.bound == "HardwareBound"
    assert out.proposed == Effective(max_num_seqs=32, max_model_len=512, replicas=1)
    assert kube.events == []  # announced only once reconcile has written the status
    out.announce()
    ((kind, name, type_, reason, message),) = kube.events
    assert (kind, name, type_, reason) == ("LLMDeployment", "tiny", "Normal", "AutotuneChange")
    assert "max_num_seqs 64 -> 32" in message and "preemptions" in message
    after = counter("kvpilot_operator_autotune_decisions_total", llmdeployment_namespace="demo", llmdeployment="tiny",
                     action="change", setting="max_num_seqs")
    assert after == before + 1
    assert kube.scaled == []
    # The pod still reports the 64 in effect when this interval began.
    assert [(c.type, c.status, c.reason) for c in judged(out)] == [("TuningApplied", "True", "PodsReportSettings")]


def test_recommend_reports_but_applies_nothing():
    kube = FakeKube()
    out = autotune_step(ctx(spec_body(mode="Recommend"), kube=kube), reader_factory=FakeReader([snap(**PREEMPTING)]),
                        now=T0)
    r = out.status()
    assert r.last_decision.change == {"maxNumSeqs": [64, 32]} and r.last_decision.applied is False
    assert out.proposed.max_num_seqs == 32 and kube.events == [] and kube.scaled == []


def test_not_due_before_the_interval_keeps_the_report_and_reads_nothing():
    reader = FakeReader([snap(**PREEMPTING)])
    first = autotune_step(ctx(spec_body()), reader_factory=reader, now=T0)
    status = {"autotune": first.status().dump()}
    again = autotune_step(ctx(spec_body(), status), reader_factory=reader, now=T0 + 3)
    assert len(reader.calls) == 1 and again.proposed is None and again.conditions is None
    assert again.status().last_decision.time == rfc3339(T0)
    due = autotune_step(ctx(spec_body(), status), reader_factory=reader, now=T0 + 6)
    assert len(reader.calls) == 2 and due.status().last_decision.time == rfc3339(T0 + 6)


def test_prometheus_failure_is_nodata_not_a_guess():
    kube = FakeKube()
    out = autotune_step(ctx(spec_body(), kube=kube), reader_factory=FakeReader([ConnectionError("refused")]), now=T0)
    r = out.status()
    assert r.diagnosis == "NoData" and r.last_decision.action == "hold" and "refused" in r.last_decision.reason
    assert out.proposed is None and kube.events == []


def _scale_out_status(kube, body, now):
    """Two queue-bound intervals at the tuning bounds: the second adds a replica."""
    reader = FakeReader([snap(seqs=8, **QUEUED_FULL)])
    first = autotune_step(ctx(body, kube=kube), reader_factory=reader, now=now)
    assert first.status().diagnosis == "HardwareBound" and first.proposed is None
    return autotune_step(ctx(body, {"autotune": first.status().dump()}, kube=kube), reader_factory=reader,
                         now=now + 6)


def test_hardware_bound_adds_a_replica_through_the_scale_subresource():
    kube = FakeKube()
    out = _scale_out_status(kube, spec_body(seqs=8, seqs_range=(8, 8)), T0)
    assert kube.scaled == [("demo", "tiny", 2)]
    assert out.proposed.replicas == 2 and out.status().last_decision.change == {"replicas": [1, 2]}
    out.announce()
    assert [e[3] for e in kube.events] == ["AutotuneChange"]


@pytest.mark.parametrize("hpa", [True, PermissionError("forbidden")])
def test_an_hpa_owns_the_scale(hpa):
    kube = FakeKube(hpa=hpa)
    out = _scale_out_status(kube, spec_body(seqs=8, seqs_range=(8, 8)), T0)
    assert kube.scaled == [] and out.proposed is None
    assert "HPA" in out.status().last_decision.reason


def test_failed_scale_patch_is_not_applied():
    class Refusing(FakeKube):
        def patch_scale(self, *a):
            raise PermissionError("forbidden")
    kube = Refusing()
    out = _scale_out_status(kube, spec_body(seqs=8, seqs_range=(8, 8)), T0)
    assert out.proposed is None and out.status().last_decision.applied is False and kube.events == []


def test_prefix_cache_warning_needs_the_spec_hint_and_posts_one_event_per_episode():
    low = snap(prefix_hit_rate=0.02)
    kube = FakeKube()
    out = autotune_step(ctx(spec_body(), kube=kube), reader_factory=FakeReader([low]), now=T0)
    assert [c.type for c in judged(out)] == ["TuningApplied"] and kube.events == []  # no hint: no judgement
    out = autotune_step(ctx(spec_body(shared_prefix=True), kube=kube), reader_factory=FakeReader([low]), now=T0)
    cond, _ = judged(out)
    assert (cond.type, cond.status) == ("PrefixCacheIneffective", "True") and "2%" in cond.message
    assert [(e[2], e[3]) for e in kube.events] == [("Warning", "PrefixCacheIneffective")]
    status = {"autotune": out.status().dump(), "conditions": [cond.dump()]}
    again = autotune_step(ctx(spec_body(shared_prefix=True), status, kube=kube), reader_factory=FakeReader([low]),
                          now=T0 + 6)
    assert again.conditions[0].status == "True" and len(kube.events) == 1
    fine = autotune_step(ctx(spec_body(shared_prefix=True), status, kube=kube),
                         reader_factory=FakeReader([snap(prefix_hit_rate=0.8)]), now=T0 + 12)
    assert fine.conditions[0].status == "False"


def test_the_loop_through_reconcile_keeps_history_in_status_and_verifies():
    """Pass 1 raises max_num_seqs (SchedulerBound); passes within the cooldown hold; after a
    window the change is verified from the history read back from status."""
    kube = FakeKube()
    body = {"metadata": {"name": "tiny", "namespace": "demo", "uid": "u", "generation": 1},
            "spec": spec_body(seqs=4, seqs_range=(2, 64)), "status": {}}
    clock = {"now": T0}
    snaps = {"s": snap(seqs=4, **SCHED)}
    reader = FakeReader([None])
    reader.snapshot = lambda ns, name, w: snaps["s"]
    hook = functools.partial(autotune_step, reader_factory=reader)

    def run(now):
        clock["now"] = now
        result = reconcile(kube, body, lambda c: hook(c, now=now))
        body["status"] = result.status.dump()
        return result.status

    st = run(T0)
    assert st.effective.max_num_seqs == 6 and st.autotune.last_decision.change == {"maxNumSeqs": [4, 6]}
    cm = [m for m, _ in kube.applied if m["kind"] == "ConfigMap"][-1]
    assert '"max_num_seqs": 6' in cm["data"]["tuning.json"]
    assert body["spec"]["engine"]["maxNumSeqs"] == 4  # never written back into the spec
    snaps["s"] = snap(t=T0 + 6, seqs=6, **SCHED)
    st = run(T0 + 6)
    assert st.effective.max_num_seqs == 6 and st.autotune.last_decision.action == "hold"
    snaps["s"] = snap(t=T0 + 20, seqs=6, queue_time_p95_s=0.1, num_waiting=0.0, kv_usage_mean=0.2, kv_usage_max=0.3)
    st = run(T0 + 20)
    assert st.autotune.diagnosis == "Healthy" and st.autotune.history[-1].verified is True
    assert st.effective.max_num_seqs == 6


def test_kube_sends_scale_patches_and_events_as_json_objects():
    """The real kubernetes client JSON-encodes bodies of JSON content types itself: a body
    passed as a string would go out double-encoded (a JSON string, refused by the server)."""
    import json

    from kubernetes import client

    from kvpilot.operator.runtime.apply import Kube

    sent = []

    class Resp:
        status, reason, data, headers = 200, "OK", b'{"items": []}', {}

        def read(self):
            return self.data

        def getheaders(self):
            return {}

        def getheader(self, name, default=None):
            return default

    class Pool:
        def request(self, method, url, body=None, headers=None, **kw):
            sent.append((method, url, headers.get("Content-Type"), body))
            return Resp()

    api = client.ApiClient(client.Configuration(host="http://api"))
    api.rest_client.pool_manager = Pool()
    kube = Kube(api)
    kube.patch_scale("demo", "tiny", 2)
    kube.create_event({"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment", "name": "tiny",
                       "namespace": "demo", "uid": "u"}, "Normal", "AutotuneChange", "max_num_seqs 64 -> 32")
    assert kube.scale_targeted_by_hpa("demo", "tiny") is False
    (m1, u1, ct1, b1), (m2, u2, ct2, b2), (m3, u3, _, _) = sent
    assert (m1, u1, ct1) == ("PATCH", "http://api/apis/serving.kvpilot.dev/v1alpha1/namespaces/demo/llmdeployments/"
                                      "tiny/scale", "application/merge-patch+json")
    assert json.loads(b1) == {"spec": {"replicas": 2}}
    assert (m2, u2) == ("POST", "http://api/api/v1/namespaces/demo/events")
    ev = json.loads(b2)
    assert ev["reason"] == "AutotuneChange" and ev["involvedObject"]["kind"] == "LLMDeployment"
    assert (m3, u3) == ("GET", "http://api/apis/autoscaling/v2/namespaces/demo/horizontalpodautoscalers")


def test_the_tpot_objective_reaches_the_policy_and_a_bad_one_is_refused():
    assert thresholds_for(parse_spec({"spec": spec_body()})).tpot_objective_s is None
    t = thresholds_for(parse_spec({"spec": spec_body(objectives={"tpot": "50ms"})}))
    assert t.tpot_objective_s == 0.05 and t.cooldown_s == 10.0
    with pytest.raises(ValueError, match="tpot"):
        parse_spec({"spec": spec_body(objectives={"tpot": "fast"})})


def test_tuning_applied_turns_to_pods_disagree_after_the_grace_and_warns_once():
    kube = FakeKube()
    # In effect: max_model_len 512 (the spec); the pod reports 256 (it refused the file).
    stuck = snap(model_len=256)
    out = autotune_step(ctx(spec_body(), kube=kube), reader_factory=FakeReader([stuck]), now=T0)
    (cond,) = [c for c in out.conditions if c.type == "TuningApplied"]
    assert (cond.status, cond.reason) == ("False", "Propagating") and "max_model_len=[256]" in cond.message
    assert out.status().last_decision.action == "hold" and "waiting for the pods" in out.status().last_decision.reason
    cond.last_transition_time = rfc3339(T0)
    status = {"autotune": out.status().dump(), "conditions": [cond.dump()]}
    soon = autotune_step(ctx(spec_body(), status, kube=kube), reader_factory=FakeReader([stuck]), now=T0 + 100)
    assert [c.reason for c in judged(soon)] == ["Propagating"] and kube.events == []
    late = autotune_step(ctx(spec_body(), status, kube=kube), reader_factory=FakeReader([stuck]), now=T0 + 200)
    (cond,) = judged(late)
    assert (cond.status, cond.reason) == ("False", "PodsDisagree") and "see the pod logs" in cond.message
    assert [(e[2], e[3]) for e in kube.events] == [("Warning", "TuningNotApplied")]
    cond.last_transition_time = rfc3339(T0)
    status["conditions"] = [cond.dump()]
    again = autotune_step(ctx(spec_body(), status, kube=kube), reader_factory=FakeReader([stuck]), now=T0 + 300)
    assert again.conditions[0].reason == "PodsDisagree" and len(kube.events) == 1  # one Event per episode
    fixed = autotune_step(ctx(spec_body(), status, kube=kube), reader_factory=FakeReader([snap()]), now=T0 + 400)
    assert [(c.status, c.reason) for c in judged(fixed)] == [("True", "PodsReportSettings")]
    # No pod reporting the gauges (stock vLLM) keeps whatever was there.
    bare = autotune_step(ctx(spec_body(), status, kube=kube), reader_factory=FakeReader([snap(pods=())]),
                         now=T0 + 500)
    assert [c.reason for c in judged(bare)] == ["PodsDisagree"]


def test_controller_model_keeps_its_memory_in_status_and_plans_replicas():
    """autotune.controller Model: each pass adds its window to status.autotune.model, the
    next pass fits on what status kept; a model fitted on one window does not size replicas."""
    kube = FakeKube()
    body = {"metadata": {"name": "tiny", "namespace": "demo", "uid": "u", "generation": 1},
            "spec": spec_body(seqs=64, seqs_range=(4, 64), controller="Model", objectives={"tpot": "50ms"}),
            "status": {}}
    loaded = dict(num_running=60.0, running_min=50.0, tpot_p95_s=0.08, tpot_mean_s=0.06,
                  generation_tokens_per_s=1000.0, request_rate_per_s=5.0, prompt_tokens_per_s=2000.0,
                  num_waiting_now=0.0)
    snaps = {"s": snap(**loaded)}
    reader = FakeReader([None])
    reader.snapshot = lambda ns, name, w: snaps["s"]
    hook = functools.partial(autotune_step, reader_factory=reader)

    def run(now):
        result = reconcile(kube, body, lambda c: hook(c, now=now))
        body["status"] = result.status.dump()
        return result.status

    assert thresholds_for(parse_spec({"spec": body["spec"]})).planner
    st = run(T0)
    memory = body["status"]["autotune"]["model"]
    assert len(memory["observations"]) == 1 and memory["observations"][0][1:] == [60.0, 2000.0, 0.06]
    assert "TPOT ~=" in memory["fit"]
    # One window supports no model: the rules decide, and the reason says why.
    assert "replicas" not in st.autotune.last_decision.change
    assert "rules decide: the model" in st.autotune.last_decision.reason
    snaps["s"] = snap(t=T0 + 6, **loaded)
    run(T0 + 6)
    assert len(body["status"]["autotune"]["model"]["observations"]) == 2  # read back, then one more
