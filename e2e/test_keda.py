"""The real KEDA (v2.21, built from its Go module: e2e/keda, localcluster/keda.py) scales
an LLMDeployment through the cluster's HPA controller, with vLLM production-stack's rule: a
ScaledObject whose Prometheus trigger is sum(vllm:num_requests_waiting) with threshold 5.

The deployment is the demo's simulated H100 at max_num_seqs 8 under 48 users, so about 40
requests wait on one replica and KEDA's HPA (external metric, AverageValue 5) wants more
than its maximum of 3. The autotuner runs in Auto mode but may not raise max_num_seqs above
8 (its bounds), so the queue, and with it KEDA's reason to scale, lasts; what it must not
do is touch the replica count, which KEDA's HPA owns.

Not in `make test` (marker `keda`): KEDA's first build takes about 11 minutes on 2 cores, the
mechanism (kvpilot leaves replicas to whichever HPA targets the LLMDeployment's scale
subresource) is test_hpa_cooperation's, and `make autotune-bench`, which builds KEDA for its
real-time day anyway, runs this module first."""
from __future__ import annotations

import math

import pytest

import kvsession as ks
from demo_story import SIM_ENGINE, SIM_RESOURCES
from localcluster.keda import start_keda
from test_operator import diagnose

pytestmark = [pytest.mark.e2e, pytest.mark.keda]

NAME = "keda-owned"
WORKLOAD = ks.Workload(num_requests=4000, rate=math.inf, max_concurrency=48, seed=7,
                       input_min=200, input_max=2000, output_min=100, output_max=400, stream=False)


@pytest.fixture(scope="module")
def keda(cluster, request):
    # Shown live: on a machine without the cached build this builds KEDA (with progress).
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        k = start_keda(cluster)
    yield k
    k.stop()


def _scaled_object(ns: str, prometheus: str) -> dict:
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": NAME, "namespace": ns},
            "spec": {"scaleTargetRef": {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment",
                                        "name": NAME},
                     "pollingInterval": 5, "minReplicaCount": 1, "maxReplicaCount": 3,
                     "triggers": [{"type": "prometheus", "metadata": {
                         "serverAddress": prometheus, "threshold": "5",
                         "query": f'sum(vllm:num_requests_waiting{{namespace="{ns}"}})'}}]}}


def _keda_diagnose(cluster, ns: str) -> str:
    r = cluster.kubectl("get", "scaledobject,hpa", "-n", ns, "-o", "yaml", check=False)
    return (f"{diagnose(cluster, ns)}\n--- scaledobject, hpa ---\n{r.stdout}{r.stderr}\n"
            f"--- keda-operator ---\n{cluster.log_tail('keda-operator')}\n"
            f"--- keda-adapter ---\n{cluster.log_tail('keda-adapter')}")


def _replicas_managers(obj: dict) -> set[str]:
    """The managers that own spec.replicas (server-side field ownership)."""
    return {m["manager"] for m in obj["metadata"].get("managedFields") or []
            if "f:replicas" in ((m.get("fieldsV1") or {}).get("f:spec") or {})}


def test_keda_scales_an_llmdeployment_and_kvpilot_leaves_replicas_to_it(cluster, tuned_operator, keda,
                                                                        namespace, wait_for):
    kube = tuned_operator
    autotune = {"mode": "Auto", "interval": "4s", "window": "10s", "cooldown": "8s",
                "maxNumSeqs": {"min": 4, "max": SIM_ENGINE["maxNumSeqs"]}, "maxModelLen": {"min": 1024, "max": 8192},
                "prometheus": {"url": cluster.prometheus_url}}
    cluster.apply(ks.llmd_manifest(namespace, NAME, SIM_ENGINE, autotune, replicas=1, resources=SIM_RESOURCES,
                                   autoscaling={"minReplicas": 1, "maxReplicas": 3},
                                   model={"source": "builtin:tiny", "servedName": NAME}))
    cluster.apply(_scaled_object(namespace, cluster.prometheus_url))
    hpa_path = f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/keda-hpa-{NAME}"
    try:
        try:
            # KEDA's HPA exists before any load, so kvpilot sees it from its first decision on.
            hpa = wait_for(lambda: kube.get(hpa_path, ok404=True), timeout=120, interval=1,
                           what=f"KEDA to create the HPA keda-hpa-{NAME}")
            wait_for(lambda: len(ks.engine_pods(kube, namespace, NAME)) == 1, timeout=300, interval=1,
                     what="the engine pod to be Ready")
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{_keda_diagnose(cluster, namespace)}") from None
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("serving.kvpilot.dev/v1alpha1", "LLMDeployment", NAME)
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
        assert hpa["spec"]["metrics"][0]["type"] == "External"

        load = ks.LoadDriver(lambda: ks.pod_urls(kube, namespace, NAME), NAME, WORKLOAD, loop_forever=True).start()
        try:
            def scaled_by_keda():
                obj = ks.get_llmd(kube, namespace, NAME) or {}
                n = (obj.get("spec") or {}).get("replicas") or 0
                return obj if n > 1 and len(ks.engine_pods(kube, namespace, NAME)) == n else None
            try:
                obj = wait_for(scaled_by_keda, timeout=240, interval=1,
                               what="KEDA's HPA to scale the LLMDeployment above 1 replica")
            except TimeoutError as e:
                raise AssertionError(f"{e}\n{_keda_diagnose(cluster, namespace)}") from None
            hpa = kube.get(hpa_path)
        finally:
            load.stop()
        assert load.error is None, load.error

        assert 1 < obj["spec"]["replicas"] <= 3
        # The HPA read KEDA's external metric (through the aggregated API) above the threshold.
        current = [m for m in (hpa.get("status") or {}).get("currentMetrics") or [] if m["type"] == "External"]
        assert current, hpa.get("status")
        assert float(current[0]["external"]["current"]["averageValue"].rstrip("m") or 0) > 0
        events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                                 f"involvedObject.name=keda-hpa-{NAME}", "-o", "jsonpath={.items[*].reason}").stdout
        assert "SuccessfulRescale" in events  # the HPA controller's own event: it really acted
        # kvpilot neither decided nor wrote a replica count: the apply set 1, the HPA controller the rest.
        at = (obj.get("status") or {}).get("autotune") or {}
        assert not any("replicas" in (d.get("change") or {}) for d in at.get("history") or []), at
        assert _replicas_managers(obj) <= {"kubectl-client-side-apply", "kube-controller-manager"}, \
            obj["metadata"]["managedFields"]
    finally:
        # KEDA's finalizer on the ScaledObject needs KEDA running to go away.
        cluster.kubectl("delete", "scaledobject", NAME, "-n", namespace, "--wait=true", "--timeout=60s", check=False)
