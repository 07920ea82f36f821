"""status.autotune as the operator writes it, the history round trip, the demo table row."""

from dataclasses import replace

from kvpilot.operator.autotune import (
    Decision,
    TABLE_HEADER, TINY_FLOAT32, Action, Bounds, Diagnosis, History, Range, Settings, MetricsSnapshot,
    build_report, decide, format_table_row, history_from_status, plan_capacity,
)

T0 = 1_700_000_000.0
BOUNDS = Bounds(Range(4, 256), Range(256, 8192), Range(1, 3))
CUR = Settings(max_num_seqs=64, max_model_len=2048, replicas=1)


def preempting(t=T0, rate=0.5):
    return MetricsSnapshot(time=t, window_s=60, kv_usage_mean=0.97, kv_usage_max=1.0, preemptions_per_s=rate,
                    queue_time_p95_s=2.0, ttft_p95_s=0.4, num_waiting=9.0, num_running=64.0,
                    request_rate_per_s=3.0, request_len_p99=512.0, prefix_hit_rate=None,
                    missing=("length_refusals_per_s",))


def test_report_shape_with_camel_case_keys():
    snap = preempting()
    plan = plan_capacity(TINY_FLOAT32, seq_len=512, max_num_seqs=64, kv_cache_memory="64Mi")
    d = decide(snap, CUR, BOUNDS, History(), T0, capacity=plan)
    h = History().record(d, applied=True)
    out = build_report(d, h, snap, plan).dump()
    assert out["diagnosis"] == "PreemptionBound"
    last = out["lastDecision"]
    assert last["time"] == "2023-11-14T22:13:20Z"
    assert last["change"] == {"maxNumSeqs": [64, 32]}
    assert last["action"] == "change" and last["applied"] is True and "verified" not in last
    assert "preemptions 0.50/s" in last["reason"]
    assert out["history"] == [last]
    assert out["recentDiagnoses"] == ["PreemptionBound"]
    assert out["capacity"]["maxConcurrentSeqs"] == 32 and out["capacity"]["bound"] == "HardwareBound"
    s = out["snapshot"]
    assert s["kvUsageMean"] == 0.97 and s["preemptionsPerSecond"] == 0.5 and s["queueTimeP95Seconds"] == 2.0
    assert s["windowSeconds"] == 60 and s["missing"] == ["length_refusals_per_s"]
    assert "prefixHitRate" not in s


def test_hold_report_and_verified_flag():
    d = decide(preempting(), CUR, BOUNDS, History(), T0)
    h = History().record(d, applied=True)
    v = decide(preempting(T0 + 200, rate=0.1), replace(CUR, max_num_seqs=48), BOUNDS, h, T0 + 200)
    h = h.record(v, applied=v.changes_something)
    out = build_report(v, h).dump()
    assert out["history"][0]["verified"] is True
    assert out["lastDecision"]["diagnosis"] == out["diagnosis"]


def test_history_round_trips_through_status():
    d = decide(preempting(), CUR, BOUNDS, History(), T0)
    h = History().record(d, applied=True)
    back = history_from_status(build_report(d, h).dump())
    assert [e.decision.change for e in back.entries] == [{"max_num_seqs": (64, 48)}]
    assert back.entries[0].applied and not back.entries[0].checked
    assert back.last_diagnosis() is Diagnosis.PREEMPTION_BOUND
    # The rebuilt history drives the next decision exactly like the original.
    nxt = preempting(T0 + 200, rate=1.5)
    cur = replace(CUR, max_num_seqs=48)
    a = decide(nxt, cur, BOUNDS, h, T0 + 200)
    b = decide(nxt, cur, BOUNDS, back, T0 + 200)
    assert a.action is b.action is Action.REVERT and a.change == b.change == {"max_num_seqs": (48, 64)}
    assert history_from_status(None) == History()


def test_table_row():
    d = decide(preempting(), CUR, BOUNDS, History(), T0)
    row = format_table_row(T0, replace(preempting(), tpot_p95_s=0.0473), 64, 2048, 1, d)
    assert row.startswith("22:13:20")
    for part in (" 97.0 ", "0.50", "2.00s", " 47ms ", " 64 ", "2048", "PreemptionBound", "change max_num_seqs 64->48"):
        assert part in row
    # time KV% preempt/s queue p95 TTFT p95 TPOT p95 tok/s seqs len repl diagnosis decision
    assert len(TABLE_HEADER.split()) == 15
    empty = format_table_row(T0, None, 64, 2048, 1, None)
    assert empty.split()[1:5] == ["-", "-", "-", "-"]


def test_every_tunable_setting_round_trips_through_the_status():
    """A change to any live setting is written as the spec spells it and read back: a setting
    missing from a hand-kept table once made the whole autotune step fail whenever the chunk
    size (max_num_batched_tokens) moved."""
    change = {"max_num_seqs": (64, 48), "max_model_len": (2048, 1024), "replicas": (1, 2),
              "num_speculative_tokens": (4, 2), "max_num_batched_tokens": (8192, 2048)}
    d = Decision(time=T0, diagnosis=Diagnosis.TPOT_BOUND, action=Action.CHANGE, reason="test", change=change)
    out = build_report(d, History().record(d, applied=True)).dump()
    assert out["lastDecision"]["change"] == {
        "maxNumSeqs": [64, 48], "maxModelLen": [2048, 1024], "replicas": [1, 2],
        "numSpeculativeTokens": [4, 2], "maxNumBatchedTokens": [8192, 2048]}
    (back,) = history_from_status(out).entries
    assert back.decision.change == change
