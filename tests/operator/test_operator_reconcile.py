"""Spec validation, status conditions and one reconcile pass against a fake API."""
from __future__ import annotations

import pytest

from kvpilot.operator.api.conditions import Problem, Rollout, compute_conditions
from kvpilot.operator.autotune.context import AutotuneOutcome
from kvpilot.operator.reconcile import parse_spec, reconcile
from kvpilot.operator.api.fields import InvalidSpec
from kvpilot.operator.api.status import AutotuneStatus, Condition, Effective, SnapshotStatus


class FakeKube:
    def __init__(self, objects: dict | None = None):
        self.objects = dict(objects or {})
        self.applied: list[tuple[dict, str]] = []
        self.deleted: list[tuple[str, str]] = []

    def apply(self, manifest, subresource="", **_):
        self.applied.append((manifest, subresource))
        if manifest["kind"] == "Deployment":  # kept, as the API server keeps it, for the next pass's get
            stored = {**manifest, "metadata": {**manifest["metadata"], "generation": 1},
                      "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1,
                                 "updatedReplicas": 1, "availableReplicas": 1}}
            self.objects[("Deployment", manifest["metadata"]["name"])] = stored
            return stored
        return manifest

    def get(self, api_version, kind, ns, name):
        return self.objects.get((kind, name))

    def list_pods(self, ns, selector):
        return list(getattr(self, "pods", []))

    def delete(self, api_version, kind, ns, name):
        self.deleted.append((kind, name))
        return False


def body(spec: dict, status: dict | None = None) -> dict:
    return {"metadata": {"name": "tiny", "namespace": "demo", "uid": "u", "generation": 3},
            "spec": spec, "status": status or {}}


def kinds(kube: FakeKube) -> list[str]:
    return [m["kind"] for m, _ in kube.applied]


def test_invalid_specs_name_the_field():
    with pytest.raises(InvalidSpec, match="spec.model"):
        parse_spec({"spec": {}})
    with pytest.raises(InvalidSpec, match="minReplicas"):
        parse_spec({"spec": {"model": {"source": "builtin:tiny"},
                             "autoscaling": {"minReplicas": 3, "maxReplicas": 1}}})
    with pytest.raises(InvalidSpec, match="engine.maxNumSeqs"):
        parse_spec({"spec": {"model": {"source": "builtin:tiny"}, "engine": {"maxNumSeqs": 512},
                             "autotune": {"mode": "Auto", "maxNumSeqs": {"min": 1, "max": 64}}}})
    with pytest.raises(InvalidSpec, match="mutually exclusive"):
        parse_spec({"spec": {"model": {"source": "builtin:tiny"}, "resources": {"gpus": 1},
                             "engine": {"kvCacheMemory": "1Gi", "gpuMemoryUtilization": 0.9}}})


def test_conditions_follow_the_rollout_and_keep_transition_times():
    r = Rollout(desired=2, replicas=2, ready=1, updated=2, available=1, up_to_date=True, deadline_exceeded=False)
    c = {x.type: x for x in compute_conditions([], r, [], 3, now="2024-01-01T00:00:00Z")}
    assert (c["Ready"].status, c["Ready"].reason) == ("False", "PartiallyReady")
    assert (c["Progressing"].status, c["Degraded"].status) == ("True", "False")
    assert all(x.observed_generation == 3 for x in c.values())
    done = Rollout(2, 2, 2, 2, 2, True, False)
    c2 = {x.type: x for x in compute_conditions(list(c.values()), done, [], 3, now="2024-01-01T00:01:00Z")}
    assert (c2["Ready"].status, c2["Ready"].reason) == ("True", "AllReplicasReady")
    assert c2["Ready"].last_transition_time == "2024-01-01T00:01:00Z"
    assert c2["Degraded"].last_transition_time == "2024-01-01T00:00:00Z"  # unchanged status keeps its time
    bad = {x.type: x for x in compute_conditions([], done, [Problem("PVCNotFound", "pvc x missing")], 3)}
    assert (bad["Degraded"].status, bad["Degraded"].reason) == ("True", "PVCNotFound")
    assert bad["Ready"].status == "False"
    stuck = {x.type: x for x in compute_conditions([], Rollout(1, 2, 1, 1, 1, True, True), [], 3)}
    assert stuck["Degraded"].reason == "ProgressDeadlineExceeded"


def test_reconcile_applies_owned_objects_and_writes_status():
    kube = FakeKube()
    result = reconcile(kube, body({"model": {"source": "builtin:tiny"}}))
    # status (settings and decision) first, the owned objects from it, then the rollout's status
    assert kinds(kube) == ["LLMDeployment", "ConfigMap", "Deployment", "Service", "LLMDeployment"]
    assert kube.deleted == [("PodDisruptionBudget", "tiny")]  # one replica: no PDB
    status_manifest, sub = kube.applied[-1]
    assert sub == "status" and set(status_manifest) == {"apiVersion", "kind", "metadata", "status"}
    st = status_manifest["status"]
    assert st["observedGeneration"] == 3 and st["endpoint"] == "http://tiny.demo.svc:8000"
    assert st["effective"] == {"maxNumSeqs": 64, "maxModelLen": 2048, "replicas": 1}
    assert st["selector"].startswith("app.kubernetes.io/name=kvpilot-engine")
    assert result.ready and {c["type"] for c in st["conditions"]} == {"Ready", "Progressing", "Degraded",
                                                                             "Reconciling", "Stalled"}


def test_reconcile_builds_a_pdb_for_several_replicas():
    kube = FakeKube()
    reconcile(kube, body({"model": {"source": "builtin:tiny"}, "replicas": 2}))
    assert "PodDisruptionBudget" in kinds(kube) and not kube.deleted


def test_missing_pvc_and_secret_degrade():
    kube = FakeKube({("Secret", "key"): {"data": {"other": "eA=="}}})
    result = reconcile(kube, body({"model": {"source": "pvc://weights/m"},
                                   "engine": {"apiKeySecretRef": {"name": "key", "key": "token"}}}))
    assert [p.reason for p in result.problems] == ["PVCNotFound", "SecretKeyNotFound"]
    assert result.status.condition("Degraded").status == "True" and not result.ready


def test_autotune_hook_auto_mode_moves_configmap_not_spec():
    seen = []

    def hook(ctx):
        seen.append(ctx)
        return AutotuneOutcome(AutotuneStatus(diagnosis="PreemptionBound", snapshot=SnapshotStatus(kv_usage_mean=0.93)),
                               Effective(max_num_seqs=24))

    spec = {"model": {"source": "builtin:tiny"}, "engine": {"maxNumSeqs": 64},
            "autotune": {"mode": "Auto", "maxNumSeqs": {"min": 4, "max": 128}}}
    kube = FakeKube()
    result = reconcile(kube, body(spec), hook)
    cm = next(m for m, _ in kube.applied if m["kind"] == "ConfigMap")
    assert '"max_num_seqs": 24' in cm["data"]["tuning.json"]
    assert result.status.effective.max_num_seqs == 24 and result.status.kv_cache_usage_percent == 93
    assert seen[0].effective.max_num_seqs == 64 and spec["engine"]["maxNumSeqs"] == 64

    kube = FakeKube()
    spec["autotune"]["mode"] = "Recommend"
    result = reconcile(kube, body(spec), hook)
    assert result.status.effective.max_num_seqs == 64
    assert result.status.autotune.recommendation.max_num_seqs == 24


def test_failing_autotune_hook_does_not_stop_the_reconcile():
    def hook(ctx):
        raise RuntimeError("prometheus down")

    spec = {"model": {"source": "builtin:tiny"}, "autotune": {"mode": "Auto"}}
    result = reconcile(FakeKube(), body(spec, {"effective": {"maxNumSeqs": 32}}), hook)
    assert result.status.effective.max_num_seqs == 32
    assert "prometheus down" in result.status.autotune.message


def test_condition_model_roundtrip():
    c = Condition(type="Ready", status="True", reason="X", observed_generation=1)
    assert c.dump() == {"type": "Ready", "status": "True", "reason": "X", "message": "", "observedGeneration": 1}


def test_the_autotuners_report_fits_the_status_schema():
    """Contract with operator/autotune: its report validates into status.autotune without loss
    (the API server would prune anything the CRD schema lacks)."""
    report_mod = pytest.importorskip("kvpilot.operator.autotune.report")
    from kvpilot.operator.autotune.decision import Action, Decision, Diagnosis
    from kvpilot.operator.autotune.history import History

    d = Decision(time=1700000000.0, diagnosis=Diagnosis.PREEMPTION_BOUND, action=Action.CHANGE,
                 reason="preempting", change={"max_num_seqs": (64, 24)})
    history = History(limit=20).record(d, True)
    dumped = report_mod.build_report(d, history).dump()
    ours = AutotuneStatus.model_validate(dumped).dump()
    assert {k: v for k, v in ours.items() if k in dumped} == dumped


def test_auto_mode_keeps_tuned_values_on_hold_and_merges_partial_proposals():
    spec = {"model": {"source": "builtin:tiny"}, "engine": {"maxNumSeqs": 64, "maxModelLen": 2048},
            "autotune": {"mode": "Auto"}}
    prev = {"effective": {"maxNumSeqs": 24, "maxModelLen": 1024, "replicas": 1}}
    hold = reconcile(FakeKube(), body(spec, prev), lambda ctx: AutotuneOutcome({"diagnosis": "Healthy"}))
    assert (hold.status.effective.max_num_seqs, hold.status.effective.max_model_len) == (24, 1024)
    assert hold.status.autotune.diagnosis == "Healthy"
    part = reconcile(FakeKube(), body(spec, prev),
                     lambda ctx: AutotuneOutcome({"diagnosis": "KVCacheBound"}, Effective(max_model_len=512)))
    assert (part.status.effective.max_num_seqs, part.status.effective.max_model_len) == (24, 512)


def test_unknown_diagnosis_from_the_autotuner_is_kept():
    spec = {"model": {"source": "builtin:tiny"}, "autotune": {"mode": "Recommend"}}
    r = reconcile(FakeKube(), body(spec), lambda ctx: AutotuneOutcome({"diagnosis": "SomethingNew"}))
    assert r.status.autotune.diagnosis == "SomethingNew"


def test_replicas_follow_spec_replicas_and_autotuner_conditions_persist():
    """Replicas move through the scale subresource (spec.replicas), so a tuned count in the
    previous status never overrides the spec; the hook's own conditions are kept between
    passes (None) and dropped when autotune is Off."""
    spec = {"model": {"source": "builtin:tiny"}, "replicas": 1, "autotune": {"mode": "Auto"}}
    prev = {"effective": {"maxNumSeqs": 24, "maxModelLen": 1024, "replicas": 3}}
    warn = Condition(type="PrefixCacheIneffective", status="True", reason="LowPrefixCacheHitRate", message="m")
    r = reconcile(FakeKube(), body(spec, prev),
                  lambda ctx: AutotuneOutcome({"diagnosis": "Healthy"}, conditions=[warn]))
    assert r.status.effective.replicas == 1 and r.status.effective.max_num_seqs == 24
    assert r.status.condition("PrefixCacheIneffective").status == "True"
    since = r.status.condition("PrefixCacheIneffective").last_transition_time
    again = reconcile(FakeKube(), body(spec, r.status.dump()), lambda ctx: AutotuneOutcome({"diagnosis": "Healthy"}))
    assert again.status.condition("PrefixCacheIneffective").last_transition_time == since
    spec["autotune"]["mode"] = "Off"
    off = reconcile(FakeKube(), body(spec, r.status.dump()), lambda ctx: AutotuneOutcome({"diagnosis": "Healthy"}))
    assert off.status.condition("PrefixCacheIneffective") is None


def test_an_unchanged_status_is_not_written_again():
    """A resync pass that changes nothing writes no status: no request, no watch event."""
    kube = FakeKube()
    reconcile(kube, body({"model": {"source": "builtin:tiny"}}))
    written = kube.applied[-1][0]["status"]
    kube.applied.clear()
    reconcile(kube, body({"model": {"source": "builtin:tiny"}}, status=written))
    assert kinds(kube) == ["ConfigMap", "Deployment", "Service"]  # the owned objects still applied
    kube.applied.clear()
    changed = {**written, "observedGeneration": 2}  # a new generation: status must follow
    reconcile(kube, body({"model": {"source": "builtin:tiny"}}, status=changed))
    assert kinds(kube)[1:] == ["ConfigMap", "Deployment", "Service", "LLMDeployment"]
    assert kube.applied[-1][0]["status"]["observedGeneration"] == 3
    assert kube.applied[-1][0]["status"]["observedGeneration"] == 3
