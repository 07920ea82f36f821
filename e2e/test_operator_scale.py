"""The operator at fleet scale on the local cluster (simulated pods): 20 LLMDeployments in
Auto, each reconciled and autotuned every interval, reconciles overlapping (the resync
pool), and the autotuner's Prometheus reads shared by the pass (the fleet reader)."""
from __future__ import annotations

import time

import pytest

from scale_fleet import (QUERIES_PER_SNAPSHOT, Scrape, fleet, fleet_member, fleet_reads, last_decision,
                         operator_metrics_url, operator_pod, quantile_bound, ready_count)
from test_operator import diagnose

pytestmark = pytest.mark.e2e

N = 20
INTERVAL_S, WINDOW = 10, "30s"
RESYNC_S = 2
OPERATOR = {"resync_interval": RESYNC_S, "values": {"maxConcurrentReconciles": 8}}


@pytest.fixture(scope="module")
def scale_operator(cluster, shared_operator):
    if not cluster.prometheus_url:
        pytest.skip("the local cluster runs without Prometheus")
    return shared_operator.get(**OPERATOR)


def test_twenty_deployments_are_each_autotuned_every_interval(cluster, scale_operator, namespace, wait_for):
    kube = scale_operator
    cluster.apply([fleet_member(f"sim-{i:03d}", namespace, cluster.prometheus_url, f"{INTERVAL_S}s", WINDOW)
                   for i in range(N)])
    try:
        wait_for(lambda: ready_count(fleet(kube, namespace)) == N, timeout=360, interval=2,
                 what=f"{N} simulated LLMDeployments to be Ready")
    except TimeoutError:
        raise AssertionError(diagnose(cluster, namespace)) from None
    url = operator_metrics_url(operator_pod(kube))
    reads = fleet_reads(kube)
    before, start = Scrape.get(url), time.time()

    # Two rounds: each deployment's lastDecision must move past the round's start within
    # two intervals (the decision is due every interval; a pass every RESYNC_S seconds).
    for round_ in (1, 2):
        t0 = time.time()

        def all_decided():
            times = [last_decision(o) for o in fleet(kube, namespace)]
            return all(t is not None and t >= int(t0) for t in times)
        try:
            wait_for(all_decided, timeout=2 * INTERVAL_S + RESYNC_S, interval=1,
                     what=f"round {round_}: every deployment autotuned within two intervals")
        except TimeoutError:
            late = [o["metadata"]["name"] for o in fleet(kube, namespace) if (last_decision(o) or 0) < int(t0)]
            raise AssertionError(f"not autotuned in round {round_}: {late}\n{diagnose(cluster, namespace)}") \
                from None
    after, elapsed = Scrape.get(url), time.time() - start
    reads |= fleet_reads(kube)

    p99, n = quantile_bound(before, after, "kvpilot_operator_reconcile_duration_seconds", 0.99)
    timer = (after.total("kvpilot_operator_reconciles_total", trigger="timer")
             - before.total("kvpilot_operator_reconciles_total", trigger="timer"))
    conc = dict(after.buckets("kvpilot_operator_reconcile_concurrency"))
    conc0 = dict(before.buckets("kvpilot_operator_reconcile_concurrency"))
    overlapping = (conc[float("inf")] - conc0.get(float("inf"), 0)) - (conc[1.0] - conc0.get(1.0, 0))
    fleet_q = (after.total("kvpilot_operator_prometheus_queries_total", reader="fleet")
               - before.total("kvpilot_operator_prometheus_queries_total", reader="fleet"))
    single_q = (after.total("kvpilot_operator_prometheus_queries_total", reader="deployment")
                - before.total("kvpilot_operator_prometheus_queries_total", reader="deployment"))
    steps = (after.total("kvpilot_operator_autotune_diagnoses_total")
             - before.total("kvpilot_operator_autotune_diagnoses_total"))  # autotune steps taken
    passes = (after.total("kvpilot_operator_resync_duration_seconds_count")
              - before.total("kvpilot_operator_resync_duration_seconds_count"))
    # Passes overlap under a backlog, so the passes that could read in the window are those
    # started before `after` and not completed before `before` (not the completions between).
    readers = (after.total("kvpilot_operator_resync_passes_started_total")
               - before.total("kvpilot_operator_resync_duration_seconds_count"))
    rss = after.total("process_resident_memory_bytes")
    print(f"\n[simulated pods] {N} deployments over {elapsed:.0f}s: {timer:.0f} resync reconciles, "
          f"p99 reconcile <= {p99}s of {n}, {overlapping:.0f} reconciles started while another ran, "
          f"{steps:.0f} autotune steps in {passes:.0f} resync passes completed ({readers:.0f} ran in the "
          f"window) read with {fleet_q:.0f} fleet + "
          f"{single_q:.0f} per-deployment Prometheus queries ({(fleet_q + single_q) / elapsed:.1f}/s; "
          f"per-deployment reads: {steps * QUERIES_PER_SNAPSHOT:.0f}; {len(reads)} (URL, window) pair(s) "
          f"autotuned), operator RSS {rss / 2**20:.0f} MiB")
    assert timer >= N * elapsed / RESYNC_S * 0.5, "the resync did not reconcile every deployment each pass"
    assert overlapping > 0, "no reconcile ever overlapped another: the resync is serialized"
    assert p99 <= 2.5, f"p99 reconcile latency above 2.5 s: {p99}"
    # The fleet reader: at most one set of queries per pass and (URL, window), far fewer than
    # one set per step.
    assert steps >= N
    assert fleet_q <= readers * len(reads) * QUERIES_PER_SNAPSHOT, (fleet_q, readers, sorted(reads))
    assert fleet_q + single_q < steps * QUERIES_PER_SNAPSHOT / 2, (fleet_q, single_q, steps)
