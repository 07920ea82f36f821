"""The fleet reader (operator/autotune/prometheus/fleet.py): the same MetricsSnapshot as the
per-deployment reader for every deployment, from one grouped set of queries, over a real
HTTP server standing in for Prometheus (promql_lite answering /api/v1/query)."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
from prometheus_api_client import PrometheusConnect

from kvpilot.engine.metrics.buckets import FLEX_TIER, TIER_TPOT_METRIC
from kvpilot.operator.autotune.prometheus.fleet import FleetReader, FleetReaders
from kvpilot.operator.autotune.prometheus.client import MetricsUnavailable
from kvpilot.operator.autotune.prometheus.reader import PrometheusReader
from kvpilot.operator.autotune.prometheus.queries import (build_freshness_queries, build_queries, build_settings_queries)
from kvpilot.operator.autotune.virtual.promql_lite import TSDB

NOW = 1_800_000_000.0  # the fake Prometheus's clock
WINDOW = 60.0
HISTOGRAMS = {
    "vllm:request_queue_time_seconds": (0.01, 0.1, 1.0),
    "vllm:time_to_first_token_seconds": (0.05, 0.25, 1.0),
    "vllm:request_time_per_output_token_seconds": (0.01, 0.05, 0.1),
    "vllm:e2e_request_latency_seconds": (1.0, 5.0, 20.0),
    "vllm:request_prompt_tokens": (100, 500, 2000),
    "vllm:request_generation_tokens": (50, 200, 1000),
}
COUNTERS = ("vllm:num_preemptions_total", "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def add_pod(db: TSDB, ns: str, name: str, pod: str, *, scale: float, until: float = NOW,
            tiers: bool = False, refusals: bool = False, seqs: int = 64, skip: tuple[str, ...] = ()) -> None:
    """Two minutes of one engine pod's series, scraped every 5 s up to `until`."""
    base = {"namespace": ns, "llmdeployment": name, "pod": pod}
    for i, t in enumerate(range(int(NOW - 120), int(until) + 1, 5)):
        def put(metric, value, **extra):
            if metric not in skip:
                db.add(metric, {**base, **extra}, float(t), value)
        put("vllm:kv_cache_usage_perc", min(1.0, 0.3 * scale + 0.01 * (i % 7)))
        put("vllm:num_requests_running", float((i * 3) % 11) * scale)
        put("vllm:num_requests_waiting", float(i % 4) * scale)
        put("kvpilot:kv_cache_bytes", 2**30 * scale)
        put("kvpilot:kv_cache_bytes_per_token", 131072.0)
        put("kvpilot:max_num_seqs", float(seqs))
        put("kvpilot:max_model_len", 4096.0)
        for k, metric in enumerate(COUNTERS):
            put(metric, i * scale * (k + 1) * 3.0)
        if refusals:
            put("kvpilot:request_length_refusals_total", float(i // 4))
        for metric, bounds in HISTOGRAMS.items():
            n = i * 2 * scale
            for j, le in enumerate((*bounds, "+Inf")):
                put(f"{metric}_bucket", n * (j + 1) / 4, le=str(le))
            put(f"{metric}_count", n)
            put(f"{metric}_sum", n * bounds[1])
        if tiers:
            for tier, share in ((FLEX_TIER, 1.0), ("default", 2.0)):
                for j, le in enumerate((0.01, 0.05, 0.1, "+Inf")):
                    put(f"{TIER_TPOT_METRIC}_bucket", i * share * (j + 1), le=str(le), service_tier=tier)
                put(f"{TIER_TPOT_METRIC}_count", i * share * 4, service_tier=tier)


def fleet_db() -> TSDB:
    db = TSDB()
    add_pod(db, "team-a", "chat", "chat-0", scale=1.0, tiers=True, refusals=True)
    add_pod(db, "team-a", "chat", "chat-1", scale=2.0, tiers=True, refusals=True, seqs=32)  # disagrees
    add_pod(db, "team-b", "chat", "chat-0", scale=0.5)  # the same name in another namespace
    add_pod(db, "team-b", "code", "code-0", scale=1.5, skip=("vllm:request_queue_time_seconds_bucket",))
    add_pod(db, "team-b", "old", "old-0", scale=1.0, until=NOW - 80)  # scraped no more: stale
    db.add("vllm:kv_cache_usage_perc", {"namespace": "team-c", "pod": "x"}, NOW, 0.9)  # no deployment label
    return db


class FakePrometheus:
    """/api/v1/query over HTTP, answered by promql_lite at `time` (else at NOW); counts queries."""

    def __init__(self, db: TSDB) -> None:
        fake = self
        self.queries: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                url = urlparse(self.path)
                args = {k: v[0] for k, v in parse_qs(url.query).items()}
                fake.queries.append(args["query"])
                result = db.query(args["query"], float(args.get("time", NOW)))
                payload = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(payload.encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def client(self) -> PrometheusConnect:
        return PrometheusConnect(url=self.url, disable_ssl=True, timeout=10)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def prom():
    p = FakePrometheus(fleet_db())
    yield p
    p.close()


DEPLOYMENTS = [("team-a", "chat"), ("team-b", "chat"), ("team-b", "code"), ("team-b", "old"), ("team-z", "none")]


@pytest.mark.parametrize("at", [None, NOW - 10])
def test_the_fleet_reader_gives_each_deployment_the_per_deployment_snapshot(prom, at):
    single = PrometheusReader(prom.client(), scrape_interval_s=5)
    fleet = FleetReader(prom.client(), scrape_interval_s=5)
    for ns, name in DEPLOYMENTS:
        expected = single.snapshot(ns, name, WINDOW, at=at)
        got = fleet.snapshot(ns, name, WINDOW, at=at)
        assert got == expected, (ns, name)
    # the data exercises what it should: values, tiers, disagreeing pods, missing, stale, absent
    a = fleet.snapshot("team-a", "chat", WINDOW, at=at)
    assert a.kv_usage_mean is not None and a.flex_share is not None and a.length_refusals_per_s is not None
    assert {p.max_num_seqs for p in a.pods} == {32, 64}
    assert fleet.snapshot("team-b", "chat", WINDOW, at=at).kv_usage_mean != a.kv_usage_mean
    assert "queue_time_p95_s" in fleet.snapshot("team-b", "code", WINDOW, at=at).missing
    assert "kv_usage_mean" in fleet.snapshot("team-b", "old", WINDOW, at=at).stale
    assert fleet.snapshot("team-z", "none", WINDOW, at=at).no_data_reason() is not None


def test_one_set_of_queries_for_the_whole_fleet(prom):
    target = FleetReader(None).target
    per_deployment = len(build_queries(target, WINDOW)) + len(build_freshness_queries(target)) + \
        len(build_settings_queries(target))
    prom.queries.clear()
    single = PrometheusReader(prom.client())
    for ns, name in DEPLOYMENTS:
        single.snapshot(ns, name, WINDOW)
    assert len(prom.queries) == len(DEPLOYMENTS) * per_deployment
    prom.queries.clear()
    fleet = FleetReader(prom.client())
    for ns, name in DEPLOYMENTS:
        fleet.snapshot(ns, name, WINDOW)
    assert len(prom.queries) == per_deployment  # N deployments, one set of queries
    fleet.snapshot("team-a", "chat", 2 * WINDOW)  # another window is another set
    assert len(prom.queries) == 2 * per_deployment


def test_concurrent_reconciles_share_one_read(prom):
    prom.queries.clear()
    fleet = FleetReader(prom.client())
    with ThreadPoolExecutor(8) as pool:
        snaps = list(pool.map(lambda d: fleet.snapshot(*d, WINDOW), DEPLOYMENTS * 4))
    assert len(snaps) == 20
    assert len(prom.queries) == len(set(prom.queries))  # nothing asked twice


class FailingClient:
    def __init__(self) -> None:
        self.calls = 0

    def custom_query(self, query, params=None):
        self.calls += 1
        raise ConnectionError("prometheus is down")


def test_a_failed_read_is_kept_for_the_pass():
    client = FailingClient()
    fleet = FleetReader(client)
    for ns, name in DEPLOYMENTS:
        with pytest.raises(MetricsUnavailable, match="cannot reach Prometheus .*down"):
            fleet.snapshot(ns, name, WINDOW)
    assert client.calls == 1  # one failed query per pass, not one per deployment


def test_deployments_are_grouped_per_prometheus_url():
    made = []

    def make(url):
        made.append(url)
        return f"reader for {url}"
    readers = FleetReaders(make)
    assert readers.reader_for("http://a:9090") == "reader for http://a:9090"
    assert readers.reader_for("http://b:9090") == "reader for http://b:9090"
    assert readers.reader_for("http://a:9090") == "reader for http://a:9090"
    assert made == ["http://a:9090", "http://b:9090"] and readers.urls == made
