"""The autotuner in virtual time: a PromQL subset with Prometheus's semantics over the
simulated fleet's scrapes, read by the operator's own reader, driving the pure policy."""

from __future__ import annotations

import math
import random

import pytest

from kvpilot.engine.config.engine import EngineConfig
from kvpilot.engine.fleet.fleet import Fleet
from kvpilot.engine.fleet.report import summarize
from kvpilot.engine.fleet.trace import Phase, TraceRequest, generate
from kvpilot.operator.autotune.decision import Bounds, Diagnosis, Range, Thresholds
from kvpilot.operator.autotune.prometheus.queries import Target, build_freshness_queries, build_queries
from kvpilot.operator.autotune.prometheus.reader import PrometheusReader
from kvpilot.operator.autotune.virtual.promql_lite import TSDB, extrapolated_rate, histogram_quantile
from kvpilot.operator.autotune.virtual.autotuner import AutotuneSettings, VirtualPrometheus, run_autotuned


def test_rate_extrapolates_as_prometheus_does():
    # Samples every 15 s of a counter growing 1/s, window 60 s ending 5 s after the last.
    times = [10.0, 25.0, 40.0, 55.0]
    values = [100.0, 115.0, 130.0, 145.0]
    # Prometheus: 45 over 45 s sampled, extrapolated 10 s at the start (< 1.1 x 15) and 5 s
    # at the end: 45 x 60 / 45 = 60 over the 60 s window.
    assert extrapolated_rate(times, values, 0.0, 60.0) == pytest.approx(1.0)
    # A counter starting at 0 is not extrapolated before its zero point.
    assert extrapolated_rate([30.0, 45.0, 60.0], [0.0, 15.0, 30.0], 0.0, 60.0) == pytest.approx(0.5)
    assert extrapolated_rate([10.0], [1.0], 0.0, 60.0) is None
    # A reset counts what came before it: 15 - 10 + 20 = 25 over 45 s sampled, extrapolated
    # 15 s back to the window's start.
    assert extrapolated_rate([15.0, 30.0, 45.0, 60.0], [10.0, 20.0, 5.0, 15.0], 0.0, 60.0) == pytest.approx(
        25 * 60 / 45 / 60)


def test_histogram_quantile_interpolates_inside_the_bucket():
    inf = math.inf
    assert histogram_quantile(0.5, [(0.1, 50), (0.3, 100), (inf, 100)]) == pytest.approx(0.1)
    assert histogram_quantile(0.95, [(0.1, 10), (0.3, 10), (inf, 10)]) == pytest.approx(0.095)
    assert histogram_quantile(0.99, [(0.1, 0), (0.3, 0), (inf, 10)]) == 0.3  # in +Inf: the last bound
    assert math.isnan(histogram_quantile(0.9, [(0.1, 0), (inf, 0)]))


def test_every_query_the_reader_builds_evaluates():
    db = TSDB()
    sel = {"namespace": "n", "llmdeployment": "d", "pod": "p0"}
    for t in range(0, 121, 15):
        db.add("vllm:kv_cache_usage_perc", sel, t, 0.5)
        db.add("vllm:num_preemptions_total", sel, t, t / 15)
    target = Target("n", "d")
    queries = {**build_queries(target, 60), **build_freshness_queries(target)}
    results = {k: db.query(q, 120.0) for k, q in queries.items()}
    assert float(results["kv_usage_mean"][0]["value"][1]) == 0.5
    assert float(results["preemptions_per_s"][0]["value"][1]) == pytest.approx(1 / 15)
    assert results["queue_time_p95_s"] == []  # no such series: no result, as Prometheus answers
    assert float(results["vllm:kv_cache_usage_perc"][0]["value"][1]) == 120.0  # min(timestamp(...))
    with pytest.raises(ValueError, match="promql"):
        db.query("sum(rate(x[5m])", 1.0)


def test_a_query_asked_again_reads_the_samples_added_since():
    # The parsed query is kept, never its result: a later evaluation sees the new samples.
    db = TSDB()
    for t in (0.0, 15.0, 30.0):
        db.add("c", {}, t, t)
    q = "sum(rate(c[30s]))"
    assert float(db.query(q, 30.0)[0]["value"][1]) == pytest.approx(1.0)
    for t in (45.0, 60.0):
        db.add("c", {}, t, 30.0 + 3 * (t - 30.0))
    assert float(db.query(q, 60.0)[0]["value"][1]) == pytest.approx(3.0)
    for i in range(1100):  # more distinct texts than are kept parsed: still answered
        assert db.query(f"c * {i}", 60.0)[0]["value"][1] == repr(120.0 * i)


def test_negative_label_matchers():
    db = TSDB()
    for t in (0.0, 15.0, 30.0):
        db.add("c", {"tier": "flex"}, t, t)
        db.add("c", {"tier": "default"}, t, 2 * t)
        db.add("c", {}, t, 4 * t)
    assert float(db.query('sum(rate(c{tier!="flex"}[30s]))', 30.0)[0]["value"][1]) == pytest.approx(6.0)
    both = db.query('c{tier!="default",tier!=""}', 30.0)  # an absent label reads as ""
    assert [r["metric"] for r in both] == [{"tier": "flex"}]


def _fleet(seqs: int, accelerator: str = "h100-80gb", **kw) -> Fleet:
    cfg = EngineConfig(model=None, simulate={"accelerator": accelerator, "model": "llama-3.1-8b"},
                       max_model_len=kw.pop("max_model_len", 8192), max_num_seqs=seqs,
                       max_num_batched_tokens=8192)
    return Fleet(cfg, scrape_interval=5, **kw)


def _watched(fleet: Fleet) -> VirtualPrometheus:
    """A virtual Prometheus that ingests every scrape of `fleet` from now on."""
    prom = VirtualPrometheus()
    fleet.on_scrape = prom.ingest
    return prom


def _read(prom: VirtualPrometheus, fleet: Fleet, window_s: float = 60):
    """The operator's reader's snapshot of the `window_s` seconds ending at the fleet's now."""
    return PrometheusReader(prom, scrape_interval_s=5).snapshot("sim", "sim", window_s, at=fleet.now)


def test_the_virtual_snapshot_reads_what_the_fleet_did():
    trace = list(generate([Phase(duration=120, rate=6, input="uniform:200:1000", output="uniform:100:300")],
                          seed=2, max_len=8192))
    fleet = _fleet(64)
    prom = _watched(fleet)
    fleet.run(trace)
    snap = _read(prom, fleet)
    assert snap.no_data_reason() is None and not snap.stale
    finished_late = [r for r in fleet.requests if r.finished > fleet.now - 60]
    truth_rate = len(finished_late) / 60
    assert snap.request_rate_per_s == pytest.approx(truth_rate, rel=0.3)
    assert snap.kv_cache_bytes and snap.kv_bytes_per_token == 131072
    assert {p.max_num_seqs for p in snap.pods} == {64}
    ttft = [snap.ttft_p50_s, snap.ttft_p75_s, snap.ttft_p90_s, snap.ttft_p95_s]
    tpot = [snap.tpot_p50_s, snap.tpot_p75_s, snap.tpot_p90_s, snap.tpot_p95_s]
    assert None not in ttft + tpot and ttft == sorted(ttft) and tpot == sorted(tpot)
    assert not snap.aborted_per_s  # no client gave up


def test_the_virtual_snapshot_reads_the_busiest_pods_running_count():
    """A backlog built on one replica stays in its queue when a second joins after the
    arrivals: the busiest pod runs its cap while the mean per pod reads about half of it."""
    trace = list(generate([Phase(duration=20, rate=20, input="uniform:500:1000", output="uniform:800:1000")],
                          seed=2, max_len=8192))
    fleet = _fleet(8)
    prom = _watched(fleet)
    fleet.submit(trace)
    fleet.run_until(30.0)
    fleet.add_replica()
    fleet.run_until(90.0)
    snap = _read(prom, fleet)
    assert len(snap.pods) == 2 and snap.running_busiest_pod == pytest.approx(8.0, abs=0.5)
    assert snap.running_per_pod(2) < 0.6 * 8 and snap.batch_width(2) == snap.running_busiest_pod


def test_requests_whose_clients_give_up_read_as_aborted():
    # Three times what one replica serves, clients that wait 5 s for a first token.
    trace = list(generate([Phase(duration=70, rate=30, input="uniform:2000:4000", output="uniform:100:300")],
                          seed=2, max_len=8192))
    fleet = _fleet(8, client_timeout=5.0)
    prom = _watched(fleet)
    fleet.run(trace)
    snap = _read(prom, fleet)
    aborted = [r for r in fleet.requests if r.finish_reason == "abort" and r.finished > fleet.now - 60]
    assert aborted and snap.aborted_per_s == pytest.approx(len(aborted) / 60, rel=0.3)


def test_flex_requests_leave_the_tpot_objective_to_the_others():
    def snapshot(phases, window_s):
        trace = list(generate(phases, seed=3, max_len=8192))
        fleet = _fleet(64)
        prom = _watched(fleet)
        fleet.run(trace)
        return _read(prom, fleet, window_s)

    shape = dict(duration=90, input="uniform:200:1000", output="uniform:100:300")
    mixed = snapshot([Phase(rate=3, **shape), Phase(rate=3, service_tier="flex", **shape)], 150)
    assert 0 < mixed.flex_share < 1 and mixed.tpot_p95_s is not None
    batch = snapshot([Phase(rate=4, service_tier="flex", **shape)], 60)
    assert batch.flex_share == 1.0 and batch.tpot_p95_s is None and batch.no_data_reason() is None
    assert batch.prompt_len_mean == pytest.approx(600, rel=0.3)
    assert batch.generation_len_mean == pytest.approx(200, rel=0.3)


def _closed_loop(n: int, seed: int = 11) -> list[TraceRequest]:
    rng = random.Random(seed)
    return [TraceRequest(0.0, rng.randint(200, 2000), rng.randint(100, 400)) for _ in range(n)]


FAST = dict(interval_s=10, window_s=20, thresholds=Thresholds(cooldown_s=20))


def test_scenario_c_a_cool_cache_with_a_queue_raises_max_num_seqs():
    fleet = _fleet(8, max_concurrency=48)
    tune = AutotuneSettings(bounds=Bounds(Range(4, 256), Range(1024, 8192), Range(1, 1)), **FAST)
    ivs = run_autotuned(fleet, _closed_loop(1500), tune)
    changes = [iv.decision.change["max_num_seqs"] for iv in ivs if iv.applied]
    assert changes and all(b > a for a, b in changes)
    assert changes[-1][1] >= 48  # every user admitted
    assert ivs[-1].decision.diagnosis in (Diagnosis.HEALTHY, Diagnosis.IDLE)
    assert Diagnosis.SCHEDULER_BOUND in {iv.decision.diagnosis for iv in ivs}


def test_an_overload_does_not_revert_a_raise_that_helped():
    # Open-loop arrivals above the capacity at max_num_seqs 8: the backlog grows even after
    # a raise; the raise is kept because output tokens/s rose.
    trace = list(generate([Phase(duration=300, rate=12, input="uniform:200:2000", output="uniform:100:400")],
                          seed=1, max_len=8192))
    fleet = _fleet(8)
    tune = AutotuneSettings(bounds=Bounds(Range(4, 256), Range(1024, 8192), Range(1, 1)), **FAST)
    ivs = run_autotuned(fleet, trace, tune)
    actions = [iv.decision.action.value for iv in ivs if iv.applied]
    assert "revert" not in actions and actions.count("change") >= 4
    assert summarize(fleet)["failed"] == 0


def test_a_hardware_bound_fleet_gains_a_replica_after_its_startup():
    # Every setting already fits: queueing with the cap not binding is hardware, so the
    # autotuner adds a replica; it serves only once its startup time has passed.
    trace = list(generate([Phase(duration=200, rate=30, input="uniform:1000:3000", output="uniform:50:150")],
                          seed=3, max_len=8192))
    fleet = _fleet(256, accelerator="l40s")
    tune = AutotuneSettings(bounds=Bounds(Range(4, 256), Range(1024, 8192), Range(1, 3)),
                            replica_startup_s=40, **FAST)
    ivs = run_autotuned(fleet, trace, tune)
    adds = [iv for iv in ivs if iv.applied and "replicas" in iv.decision.change]
    assert adds and adds[0].decision.change["replicas"] == (1, 2)
    first = adds[0].time
    routed = [r for r in fleet.requests if r.replica != 0]
    assert routed and min(r.arrival for r in routed) >= first + 40
