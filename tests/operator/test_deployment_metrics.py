"""The operator's per-LLMDeployment series: written from the status, replaced as it changes,
removed with the deployment."""
from __future__ import annotations

from pathlib import Path

import yaml
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator.deployment_metrics import DeploymentMetrics
from kvpilot.operator.reconcile import parse_spec
from kvpilot.operator.api.status import AutotuneStatus, Capacity, Condition, Effective, LLMDeploymentStatus

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llmdeployment-simulated.yaml"


def series(registry) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def labels(**kw) -> tuple:
    return tuple(sorted({"llmdeployment_namespace": "ml", "llmdeployment": "chat", **kw}.items()))


def test_series_follow_the_status_and_leave_with_the_deployment():
    spec = parse_spec(yaml.safe_load(EXAMPLE.read_text()))
    registry = CollectorRegistry()
    m = DeploymentMetrics(registry)
    status = LLMDeploymentStatus(
        effective=Effective(max_num_seqs=64, max_model_len=8192, replicas=2),
        autotune=AutotuneStatus(diagnosis="KVCacheBound", capacity=Capacity(max_concurrent_seqs=41)),
        conditions=[Condition(type="TuningApplied", status="False", reason="Propagating")])
    m.record("ml", "chat", spec, status)
    s = series(registry)
    assert s[("kvpilot_operator_setting", labels(setting="max_num_seqs"))] == 64
    assert s[("kvpilot_operator_setting", labels(setting="replicas"))] == 2
    assert s[("kvpilot_operator_autotune_diagnosis", labels(diagnosis="KVCacheBound"))] == 1
    assert s[("kvpilot_operator_autotune_diagnosis", labels(diagnosis="Healthy"))] == 0
    assert s[("kvpilot_operator_capacity_fit_seqs", labels())] == 41
    assert s[("kvpilot_operator_objective_seconds", labels(objective="tpot"))] == 0.05
    assert s[("kvpilot_operator_condition", labels(condition="TuningApplied", status="False",
                                                   reason="Propagating"))] == 1

    m.record("ml", "chat", spec, status.model_copy(update={"conditions": [
        Condition(type="TuningApplied", status="True", reason="PodsReportSettings")]}))
    s = series(registry)
    assert ("kvpilot_operator_condition", labels(condition="TuningApplied", status="False",
                                                 reason="Propagating")) not in s
    assert s[("kvpilot_operator_condition", labels(condition="TuningApplied", status="True",
                                                   reason="PodsReportSettings"))] == 1

    decisions = {"llmdeployment_namespace": "ml", "llmdeployment": "chat", "action": "revert",
                 "setting": "replicas"}
    assert REGISTRY.get_sample_value("kvpilot_operator_autotune_decisions_total", decisions) == 0  # not absent

    m.record("ml", "other", spec, status)
    m.keep_only({("ml", "other")})
    assert REGISTRY.get_sample_value("kvpilot_operator_autotune_decisions_total", decisions) is None
    assert not [k for k in series(registry) if ("llmdeployment", "chat") in k[1]]
    assert [k for k in series(registry) if ("llmdeployment", "other") in k[1]]
