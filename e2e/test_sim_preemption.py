"""The field guide's case (a) on the local cluster, with a simulated pod: max_num_seqs 256 on
an A10G whose KV cache holds ~26.6k tokens of Llama-3.1-8B, under more chat traffic than
it can serve. The real operator reads the real Prometheus, diagnoses PreemptionBound and
lowers max_num_seqs (kvpilot autotune contest --scenario preemption is the same case in
virtual time)."""
from __future__ import annotations

import pytest

import kvsession as ks
from test_operator import diagnose

pytestmark = pytest.mark.e2e

NAME = "a10g-preempt"
ENGINE = {"maxNumSeqs": 256, "maxModelLen": 8192, "maxNumBatchedTokens": 8192, "gpuMemoryUtilization": 0.9,
          "simulate": {"accelerator": "a10g", "model": "llama-3.1-8b"}}
# Poisson 4 req/s of 250-550-token prompts and 150-450-token answers: past this A10G's
# capacity, so the running set grows until the cache is full and the engine preempts.
WORKLOAD = ks.Workload(num_requests=3000, rate=4.0, max_concurrency=400, seed=3,
                       input_min=250, input_max=550, output_min=150, output_max=450, stream=False)


def test_preemption_bound_lowers_max_num_seqs_on_a_simulated_a10g(cluster, tuned_operator, namespace, wait_for):
    kube = tuned_operator
    autotune = {"mode": "Auto", "interval": "4s", "window": "15s", "cooldown": "10s",
                "maxNumSeqs": {"min": 4, "max": 256}, "maxModelLen": {"min": 1024, "max": 8192},
                "prometheus": {"url": cluster.prometheus_url}}
    m = ks.llmd_manifest(namespace, NAME, ENGINE, autotune, resources={"gpus": 1, "cpu": "100m", "memory": "512Mi"},
                         model={"source": "builtin:tiny", "servedName": NAME})
    try:
        ks.deploy(cluster, kube, m)
    except ks.SetupError as e:
        raise AssertionError(f"{e}\n{diagnose(cluster, namespace)}") from None
    load = ks.LoadDriver(lambda: ks.pod_urls(kube, namespace, NAME), NAME, WORKLOAD).start()
    try:
        def lowered():
            at = ((ks.get_llmd(kube, namespace, NAME) or {}).get("status") or {}).get("autotune") or {}
            moves = [d for d in at.get("history") or [] if d.get("applied") and d.get("diagnosis") == "PreemptionBound"
                     and "maxNumSeqs" in (d.get("change") or {})]
            return moves or None
        try:
            moves = wait_for(lowered, timeout=300, interval=1, what="PreemptionBound to lower max_num_seqs")
        except TimeoutError:
            raise AssertionError(diagnose(cluster, namespace)) from None
    finally:
        load.stop()
    old, new = moves[0]["change"]["maxNumSeqs"]
    print(f"\n[a, simulated A10G] {moves[0]['reason']}")
    assert old == 256 and new < 256
    assert "preemptions" in moves[0]["reason"]
