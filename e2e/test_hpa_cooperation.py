"""Cooperation with an autoscaler: with a HorizontalPodAutoscaler targeting the
LLMDeployment (through its scale subresource, as KEDA's ScaledObject does), the
Kubernetes HPA controller owns the replica count and kvpilot leaves it alone, while it
still tunes max_num_seqs. The deployment is the demo's simulated H100 at max_num_seqs 8
under 48 users, so SchedulerBound is certain; the HPA's metric does not exist, so the HPA
controller only enforces its minReplicas (2): any other count would be kvpilot's doing."""
from __future__ import annotations

import math

import pytest

import kvsession as ks
from demo_story import SIM_ENGINE, SIM_RESOURCES
from test_operator import diagnose

pytestmark = pytest.mark.e2e

NAME = "hpa-owned"
WORKLOAD = ks.Workload(num_requests=4000, rate=math.inf, max_concurrency=48, seed=5,
                       input_min=200, input_max=2000, output_min=100, output_max=400, stream=False)


def _hpa(ns: str) -> dict:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": NAME, "namespace": ns},
            "spec": {"scaleTargetRef": {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment",
                                        "name": NAME},
                     "minReplicas": 2, "maxReplicas": 3,
                     "metrics": [{"type": "Pods", "pods": {
                         "metric": {"name": "vllm_num_requests_waiting"},
                         "target": {"type": "AverageValue", "averageValue": "5"}}}]}}


def test_kvpilot_leaves_replicas_to_an_hpa_and_still_tunes_the_engine(cluster, tuned_operator, namespace,
                                                                     wait_for):
    kube = tuned_operator
    autotune = {"mode": "Auto", "interval": "4s", "window": "10s", "cooldown": "8s",
                "maxNumSeqs": {"min": 4, "max": 256}, "maxModelLen": {"min": 1024, "max": 8192},
                "prometheus": {"url": cluster.prometheus_url}}
    m = ks.llmd_manifest(namespace, NAME, SIM_ENGINE, autotune, replicas=1, resources=SIM_RESOURCES,
                         autoscaling={"minReplicas": 1, "maxReplicas": 3},
                         model={"source": "builtin:tiny", "servedName": NAME})
    cluster.apply(m)
    cluster.apply(_hpa(namespace))

    def scaled_by_hpa():
        obj = ks.get_llmd(kube, namespace, NAME) or {}
        return obj if obj.get("spec", {}).get("replicas") == 2 and len(ks.engine_pods(kube, namespace, NAME)) == 2 \
            else None
    try:
        wait_for(scaled_by_hpa, timeout=300, interval=1, what="the HPA controller to scale the LLMDeployment to 2")
    except TimeoutError:
        raise AssertionError(diagnose(cluster, namespace)) from None

    load = ks.LoadDriver(lambda: ks.pod_urls(kube, namespace, NAME), NAME, WORKLOAD, loop_forever=True).start()
    try:
        def raised():
            obj = ks.get_llmd(kube, namespace, NAME) or {}
            at = (obj.get("status") or {}).get("autotune") or {}
            ups = [d for d in at.get("history") or [] if d.get("applied") and "maxNumSeqs" in (d.get("change") or {})
                   and d["change"]["maxNumSeqs"][1] > d["change"]["maxNumSeqs"][0]]
            return (obj, at, ups) if ups else None
        try:
            obj, at, ups = wait_for(raised, timeout=240, interval=1, what="kvpilot to raise max_num_seqs")
        except TimeoutError:
            raise AssertionError(diagnose(cluster, namespace)) from None
    finally:
        load.stop()
    assert obj["spec"]["replicas"] == 2, "kvpilot moved the replica count an HPA owns"
    assert not any("replicas" in (d.get("change") or {}) for d in at.get("history") or [])
    assert ups[0]["change"]["maxNumSeqs"][0] == SIM_ENGINE["maxNumSeqs"]
    effective = obj["status"].get("effective") or {}
    assert effective.get("maxNumSeqs", 0) > SIM_ENGINE["maxNumSeqs"]
    events = cluster.kubectl("get", "events", "-n", namespace, "-o", "jsonpath={.items[*].reason}").stdout
    assert "SuccessfulRescale" in events  # the HPA controller's own event: it really acted
