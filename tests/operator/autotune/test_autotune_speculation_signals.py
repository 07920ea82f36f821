"""Speculative decoding's signals in the autotuner's MetricsSnapshot: the PromQL the readers build
(shared by the per-deployment reader and the FleetReader), and the MetricsSnapshot with and without
the pods' vllm:spec_decode_* series, evaluated by promql_lite with Prometheus's semantics."""
from __future__ import annotations

import pytest

from kvpilot.operator.autotune import PodSettings, PrometheusReader, Target, build_queries
from kvpilot.operator.autotune.prometheus.fleet import FleetReader
from kvpilot.operator.autotune.prometheus.queries import FleetTarget, build_freshness_queries, build_settings_queries
from kvpilot.operator.autotune.virtual.promql_lite import TSDB

NOW = 1_800_000_000.0
WINDOW = 60.0
SEL = 'namespace="demo",llmdeployment="tiny"'
SPEC_FIELDS = ("spec_acceptance_rate", "spec_mean_accepted_len", "spec_drafts_per_s", "num_speculative_tokens")


def test_the_queries_use_vllm_s_counters_and_the_selector():
    q = build_queries(Target("demo", "tiny"), 300)
    accepted = f"sum(rate(vllm:spec_decode_num_accepted_tokens_total{{{SEL}}}[300s]))"
    assert q["spec_acceptance_rate"] == (
        f"{accepted} / sum(rate(vllm:spec_decode_num_draft_tokens_total{{{SEL}}}[300s]))")
    assert q["spec_mean_accepted_len"] == (
        f"1 + {accepted} / sum(rate(vllm:spec_decode_num_drafts_total{{{SEL}}}[300s]))")
    assert q["spec_drafts_per_s"] == f"sum(rate(vllm:spec_decode_num_drafts_total{{{SEL}}}[300s]))"
    assert q["num_speculative_tokens"] == f"max(kvpilot:num_speculative_tokens{{{SEL}}})"
    assert build_settings_queries(Target("demo", "tiny"))["num_speculative_tokens"] == \
        f"kvpilot:num_speculative_tokens{{{SEL}}}"
    fresh = build_freshness_queries(Target("demo", "tiny"))
    for metric in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                   "vllm:spec_decode_num_accepted_tokens_total", "kvpilot:num_speculative_tokens"):
        assert fresh[metric] == f"min(timestamp({metric}{{{SEL}}}))"


def test_the_fleet_groups_the_same_expressions():
    q = build_queries(FleetTarget(), 60)
    assert q["spec_mean_accepted_len"].startswith(
        '1 + sum by (namespace, llmdeployment) (rate(vllm:spec_decode_num_accepted_tokens_total{llmdeployment!=""}')
    assert q["num_speculative_tokens"] == 'max by (namespace, llmdeployment) (kvpilot:num_speculative_tokens{llmdeployment!=""})'


def add_pod(db: TSDB, ns: str, name: str, pod: str, *, speculate: int | None, drafts_per_s: float = 0.0,
            accepted_per_draft: float = 0.0) -> None:
    """Two minutes of an engine pod scraped every 5 s; vllm:spec_decode_* only where it speculates
    (as the engine makes them), drafting `drafts_per_s` with `speculate` tokens each."""
    base = {"namespace": ns, "llmdeployment": name, "pod": pod}
    spec_labels = {**base, "model_name": name, "engine": "0"}
    for i, t in enumerate(range(int(NOW - 120), int(NOW) + 1, 5)):
        put = lambda metric, v, labels=base: db.add(metric, labels, float(t), v)  # noqa: E731
        put("vllm:kv_cache_usage_perc", 0.4)
        put("vllm:num_requests_running", 12.0)
        put("vllm:num_requests_waiting", 0.0)
        put("vllm:num_preemptions_total", 0.0)
        put("kvpilot:max_num_seqs", 64.0)
        put("kvpilot:max_model_len", 2048.0)
        if speculate is None:
            continue
        put("kvpilot:num_speculative_tokens", float(speculate), {**base, "model_name": name})
        drafts = i * 5 * drafts_per_s
        put("vllm:spec_decode_num_drafts_total", drafts, spec_labels)
        put("vllm:spec_decode_num_draft_tokens_total", drafts * speculate, spec_labels)
        put("vllm:spec_decode_num_accepted_tokens_total", drafts * accepted_per_draft, spec_labels)


class Client:
    def __init__(self, db: TSDB) -> None:
        self.db = db

    def custom_query(self, query, params=None):
        return self.db.query(query, float((params or {}).get("time", NOW)))


@pytest.fixture(scope="module")
def db() -> TSDB:
    db = TSDB()
    add_pod(db, "demo", "spec", "spec-0", speculate=4, drafts_per_s=10.0, accepted_per_draft=1.2)
    add_pod(db, "demo", "spec", "spec-1", speculate=4, drafts_per_s=30.0, accepted_per_draft=0.4)
    add_pod(db, "demo", "plain", "plain-0", speculate=None)
    add_pod(db, "demo", "off", "off-0", speculate=0)  # speculation turned off live: no drafts
    return db


def test_snapshot_with_the_spec_series(db):
    s = PrometheusReader(Client(db), scrape_interval_s=5).snapshot("demo", "spec", WINDOW, at=NOW)
    # (10 x 1.2 + 30 x 0.4) accepted per second over 40 drafts of 4 tokens.
    assert s.spec_drafts_per_s == pytest.approx(40.0)
    assert s.spec_acceptance_rate == pytest.approx(24.0 / 160.0)
    assert s.spec_mean_accepted_len == pytest.approx(1 + 24.0 / 40.0)
    assert s.num_speculative_tokens == 4.0
    assert s.pods == (PodSettings("spec-0", 64, 2048, 4), PodSettings("spec-1", 64, 2048, 4))
    assert not set(SPEC_FIELDS) & set(s.missing + s.stale)


def test_snapshot_without_them_is_none_not_a_guess(db):
    s = PrometheusReader(Client(db), scrape_interval_s=5).snapshot("demo", "plain", WINDOW, at=NOW)
    assert all(getattr(s, f) is None for f in SPEC_FIELDS)
    assert set(SPEC_FIELDS) <= set(s.missing)
    assert s.pods == (PodSettings("plain-0", 64, 2048, None),)
    assert not any(f in (s.no_data_reason() or "") for f in SPEC_FIELDS)  # optional: never NoData


def test_speculation_off_reads_k_zero_and_no_acceptance(db):
    s = PrometheusReader(Client(db), scrape_interval_s=5).snapshot("demo", "off", WINDOW, at=NOW)
    assert s.num_speculative_tokens == 0.0 and s.spec_drafts_per_s == 0.0
    assert s.spec_acceptance_rate is None and s.spec_mean_accepted_len is None  # 0 / 0: nothing drafted
    assert s.pods == (PodSettings("off-0", 64, 2048, 0),)


def test_both_readers_give_the_same_snapshot(db):
    single = PrometheusReader(Client(db), scrape_interval_s=5)
    fleet = FleetReader(Client(db), scrape_interval_s=5)
    for name in ("spec", "plain", "off"):
        assert fleet.snapshot("demo", name, WINDOW, at=NOW) == single.snapshot("demo", name, WINDOW, at=NOW), name
