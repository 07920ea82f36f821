"""The virtual-clock fleet simulator: whole traces in virtual time through the real
engine, closed-loop concurrency, routing, live limits, scale-in, and scrapes that read
exactly like a real pod's /metrics."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.config.engine import EngineConfig
from kvpilot.engine.core.latency import FinishedRequest
from kvpilot.engine.core.outputs import EngineStats
from kvpilot.engine.fleet.fleet import Fleet
from kvpilot.engine.fleet.replica_metrics import ReplicaMetrics
from kvpilot.engine.fleet.report import summarize
from kvpilot.engine.fleet.trace import Phase, TraceRequest, generate


def _config(**kw) -> EngineConfig:
    kw.setdefault("max_model_len", 8192)
    sim = {"accelerator": kw.pop("accelerator", "h100-80gb"), "model": "llama-3.1-8b"}
    return EngineConfig(model=None, simulate=sim, **kw)


def _trace(duration=60, rate=4, **kw):
    return list(generate([Phase(duration=duration, rate=rate, **kw)], seed=1, max_len=8192))


def test_a_trace_runs_to_completion_in_virtual_time():
    trace = _trace(input="uniform:200:2000", output="uniform:50:300")
    fleet = Fleet(_config(), scrape_interval=15)
    fleet.run(trace)
    reqs = fleet.requests
    assert len(reqs) == len(trace) and all(r.error is None for r in reqs)
    assert [r.output_tokens for r in reqs] == [t.output_len for t in trace]
    assert all(r.ttft > 0 and r.finished >= r.first_token for r in reqs)
    r = summarize(fleet, {"ttft": 2000, "tpot": 50})
    assert r["completed"] == len(trace) and r["simulated"] and r["accelerator"] == "h100-80gb"
    assert 0 < r["median_tpot_ms"] < 50 and r["request_goodput"] > 0
    assert 0 < r["kv_usage_max"] <= 1 and r["preemptions"] == 0
    assert {s.time for s in fleet.scrapes} >= {0.0, 15.0, 30.0, 45.0}


def test_closed_loop_concurrency_caps_requests_in_flight():
    trace = [TraceRequest(0.0, 500, 100) for _ in range(40)]
    fleet = Fleet(_config(), max_concurrency=4)
    fleet.run(trace)
    events = sorted([(r.arrival, 1) for r in fleet.requests] + [(r.finished, -1) for r in fleet.requests],
                    key=lambda e: (e[0], e[1]))
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    assert peak == 4


def test_routers_spread_the_load():
    trace = _trace(duration=30, rate=10)
    rr = Fleet(_config(), replicas=3)
    rr.run(trace)
    counts = [sum(1 for r in rr.requests if r.replica == i) for i in range(3)]
    assert max(counts) - min(counts) <= 1
    ll = Fleet(_config(), replicas=3, router="least-loaded")
    ll.run(trace)
    assert {r.replica for r in ll.requests} == {0, 1, 2}


def test_live_limits_and_scale_in_mid_run():
    trace = _trace(duration=120, rate=8, input="fixed:500", output="fixed:400")
    fleet = Fleet(_config(), replicas=2, scrape_interval=5)
    fleet.submit(trace)
    fleet.run_until(40)
    fleet.set_limits(max_num_seqs=3)
    fleet.remove_replica()
    fleet.run_until(80)
    late = [s for s in fleet.scrapes if s.time >= 60]
    running = [x.value for s in late for x in s.samples if x.name == "vllm:num_requests_running"]
    assert running and max(running) <= 3
    fleet.run(())
    assert len(fleet.replicas) == 1 and len(fleet.retired) == 1
    assert all(r.error is None for r in fleet.requests)
    assert all(r.replica == 0 for r in fleet.requests if r.arrival > 41)
    with pytest.raises(ValueError, match="max_num_seqs"):
        fleet.set_limits(max_num_seqs=0)
    with pytest.raises(ValueError, match="last replica"):
        fleet.remove_replica()


def test_too_many_sequences_for_the_cache_preempt_on_a_small_gpu():
    # The field guide's case on an A10G: the cache holds a few dozen sequences; admitting
    # far more makes the engine evict and recompute them.
    trace = _trace(duration=120, rate=2, input="uniform:1000:2000", output="uniform:300:600")
    fleet = Fleet(_config(accelerator="a10g", max_model_len=4096, max_num_seqs=256), scrape_interval=10)
    fleet.run(trace)
    r = summarize(fleet)
    assert r["preemptions"] > 50 and r["kv_usage_max"] > 0.8


def test_refused_requests_count_as_length_refusals():
    fleet = Fleet(_config(max_model_len=1024), scrape_interval=10)
    fleet.run([TraceRequest(0.0, 1000, 100), TraceRequest(0.1, 100, 10)])
    bad, good = fleet.requests
    assert "max_model_len" in bad.error and good.error is None and good.output_tokens == 10
    samples = {s.name: s.value for s in fleet.scrapes[-1].samples}
    assert samples["kvpilot:request_length_refusals_total"] == 1


def test_scrapes_carry_exactly_the_series_a_simulated_server_exports():
    """(Except process_*: a simulated replica in the simulator is not a process.)"""
    from kvpilot.engine.metrics.exporter import ServerMetrics

    real, sim = ServerMetrics("m", 2048), ReplicaMetrics("m", 2048)
    stats = EngineStats(2, 1, 0.5, 100, 3, 10, 5, 40, 7, 16, 2048, {
        "simulated_steps": 9.0, "simulated_busy_seconds": 0.3, "simulated_overrun_seconds": 0.0})
    done = FinishedRequest("length", 20, 7, 1.5, 0.2, 0.1, 0.02)
    for sink in (real, sim):
        sink.record_simulation("h100-80gb", "llama-3.1-8b")
        sink.record_capacity(1 << 20, 4096, 1 << 30, 2)
        sink.record_stats(stats)
        sink.record_first_token(0.1)
        sink.record_inter_token(0.02)
        sink.record_inter_token(0.02)
        sink.record_finished(done)
    want = {}
    for family in text_string_to_metric_families(real.render().decode()):
        for s in family.samples:
            if not s.name.endswith("_created") and not s.name.startswith("process_"):
                want[(s.name, tuple(sorted(s.labels.items())))] = s.value
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in sim.samples()}
    assert got == want
