"""What the operator scale test and benchmark share: a fleet of small simulated
LLMDeployments in Auto, their readiness and autotune progress, and the figures read off
the operator's own /metrics (reconcile latency histogram, Prometheus queries, RSS) and
Prometheus's (its query API request count).

A fleet member is one replica of a simulated H100 serving Llama-3.1-8B with no GPU
request (the local node advertises only 8 simulated GPUs; the pod count is what is
being scaled), a CPU request of a few millicores (the node has 2 cores to share among
a hundred pods) and a KV cache size given in bytes (the simulator allocates none)."""
from __future__ import annotations

import datetime as dt
import math
import re
from dataclasses import dataclass

import httpx
from kvpilot.operator.autotune.prometheus.queries import (Target, build_freshness_queries, build_queries, build_settings_queries)

OPERATOR_NS = "kvpilot-system"
LLMD = "/apis/serving.kvpilot.dev/v1alpha1/namespaces/{ns}/llmdeployments"
POD_MEMORY = "192Mi"  # a simulated pod's RSS is about 100 MiB (measured: see the bench)
POD_CPU = "5m"
_ONE = Target("n", "d")
# What the per-deployment reader asks for one MetricsSnapshot (the fleet reader asks as many per pass).
QUERIES_PER_SNAPSHOT = len(build_queries(_ONE, 60)) + len(build_freshness_queries(_ONE)) + \
    len(build_settings_queries(_ONE))


def fleet_member(name: str, namespace: str, prometheus_url: str, interval: str, window: str) -> dict:
    return {
        "apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"servedName": "llama-3.1-8b"},
            "engine": {"maxNumSeqs": 64, "maxModelLen": 4096, "maxNumBatchedTokens": 4096, "blockSize": 16,
                       "kvCacheMemory": "40Gi", "enablePrefixCaching": True,
                       "simulate": {"accelerator": "h100-80gb", "model": "llama-3.1-8b"}},
            "resources": {"gpus": 0, "cpu": POD_CPU, "memory": POD_MEMORY},
            "replicas": 1,
            "autoscaling": {"minReplicas": 1, "maxReplicas": 1},
            "autotune": {"mode": "Auto", "interval": interval, "window": window,
                         "prometheus": {"url": prometheus_url},
                         "maxNumSeqs": {"min": 8, "max": 256}, "maxModelLen": {"min": 1024, "max": 8192}},
        },
    }


def fleet(kube, namespace: str) -> list[dict]:
    return kube.get(LLMD.format(ns=namespace))["items"]


def fleet_reads(kube) -> set[tuple[str, str]]:
    """The (Prometheus URL, window) pairs of every LLMDeployment the operator autotunes, in
    any namespace: a resync pass's fleet reader asks one set of queries per pair. Another
    test's deployments can still be there (its namespace is deleted at teardown, not waited
    for), with a window of their own."""
    items = kube.get(LLMD.replace("namespaces/{ns}/", ""))["items"]
    reads = set()
    for obj in items:
        autotune = (obj.get("spec") or {}).get("autotune") or {}
        if obj["metadata"].get("deletionTimestamp") or autotune.get("mode", "Off") == "Off":
            continue
        reads.add(((autotune.get("prometheus") or {}).get("url") or "", autotune.get("window") or ""))
    return reads


def _condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def ready_count(objs: list[dict]) -> int:
    return sum(1 for o in objs if _condition(o, "Ready").get("status") == "True")


def last_decision(obj: dict) -> float | None:
    """status.autotune.lastDecision.time as unix seconds (second resolution)."""
    text = (((obj.get("status") or {}).get("autotune") or {}).get("lastDecision") or {}).get("time")
    if not text:
        return None
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc).timestamp()


def operator_pod(kube) -> dict:
    """The operator pod that reconciles: the leader-election Lease's holder (the chart runs two)."""
    from test_operator import operator_leader  # a test module's helper, imported when used

    return operator_leader(kube)


# --- Prometheus text format --------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN|\+Inf|-Inf)$", re.M)


@dataclass
class Scrape:
    """One /metrics text: samples by (name, labels text)."""

    samples: dict[tuple[str, str], float]

    @classmethod
    def get(cls, url: str) -> "Scrape":
        text = httpx.get(url, timeout=10).text
        return cls({(m.group(1), m.group(2) or ""): float(m.group(3)) for m in _SAMPLE.finditer(text)})

    def total(self, name: str, **labels: str) -> float:
        """The sum over the series of `name` carrying these label values."""
        want = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(v for (n, lab), v in self.samples.items() if n == name and all(w in lab for w in want))

    def buckets(self, name: str) -> list[tuple[float, float]]:
        out = []
        for (n, lab), v in self.samples.items():
            m = re.search(r'le="([^"]+)"', lab)
            if n == f"{name}_bucket" and m:
                out.append((math.inf if m.group(1) == "+Inf" else float(m.group(1)), v))
        return sorted(out)


def quantile_bound(before: Scrape, after: Scrape, name: str, q: float) -> tuple[float, int]:
    """(the upper bound of the histogram bucket holding the q-quantile of the
    observations between two scrapes, how many observations)."""
    b0 = dict(before.buckets(name))
    diff = [(le, c - b0.get(le, 0.0)) for le, c in after.buckets(name)]
    total = diff[-1][1] if diff else 0
    if not total:
        return math.nan, 0
    for le, c in diff:
        if c >= q * total:
            return le, int(total)
    return math.inf, int(total)


def count_over(before: Scrape, after: Scrape, name: str, bound: float) -> int:
    """How many observations between two scrapes exceeded `bound` (a bucket boundary)."""
    b0, b1 = dict(before.buckets(name)), dict(after.buckets(name))
    return int((b1[math.inf] - b0.get(math.inf, 0.0)) - (b1[bound] - b0.get(bound, 0.0)))


def mean_between(before: Scrape, after: Scrape, name: str) -> float:
    n = after.total(f"{name}_count") - before.total(f"{name}_count")
    return (after.total(f"{name}_sum") - before.total(f"{name}_sum")) / n if n else math.nan


def operator_metrics_url(pod: dict) -> str:
    return f"http://{pod['status']['podIP']}:8080/metrics"
