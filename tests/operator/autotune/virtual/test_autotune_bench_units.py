"""The pure parts of `make autotune-bench` and `make demo` (e2e/timeline.py): goodput,
percentiles, convergence time, the results table and the timeline PNG. No cluster."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "e2e"))

from timeline import (Change, Sample, Slo, convergence_time, format_table, goodput,  # noqa: E402
                      meets_slo, percentile, ratio, table_header, table_row, write_timeline_png)

SLO = Slo(ttft_ms=3000, tpot_ms=50)


def test_meets_slo_needs_both_bounds_and_a_first_token():
    assert meets_slo(2.9, 0.049, SLO)
    assert meets_slo(3.0, 0.050, SLO)  # bounds are inclusive
    assert not meets_slo(3.01, 0.01, SLO)
    assert not meets_slo(0.1, 0.051, SLO)
    assert not meets_slo(None, None, SLO)  # failed request
    assert meets_slo(0.5, None, SLO)  # a one-token answer has no TPOT to miss


def test_goodput_counts_only_requests_meeting_the_objective():
    reqs = [(1.0, 0.02), (4.0, 0.02), (1.0, 0.08), (None, None), (0.2, 0.01)]
    assert goodput(reqs, 10.0, SLO) == pytest.approx(0.2)
    assert goodput(reqs, 0.0, SLO) == 0.0
    assert goodput([], 5.0, SLO) == 0.0


def test_percentile_interpolates_like_numpy():
    assert percentile([], 95) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile(list(range(1, 11)), 95) == pytest.approx(9.55)


def test_convergence_is_the_last_applied_change():
    changes = [Change(12.0, {"maxNumSeqs": [64, 32]}), Change(40.5, {"maxNumSeqs": [32, 16]}),
               Change(70.0, {}), Change(33.0, {"replicas": [1, 2]})]
    assert convergence_time(changes) == 40.5
    assert convergence_time(changes, run_start=10.0) == 30.5
    assert convergence_time([]) == 0.0  # never changed: converged from the start
    assert convergence_time([Change(5.0, {})]) == 0.0


def test_change_labels():
    assert Change(1, {"maxNumSeqs": [64, 32]}).label() == "seqs 64->32"
    assert Change(1, {"maxNumSeqs": [16, 32]}, action="revert").label() == "revert: seqs 16->32"


def _run(goodput_, thr, **kw):
    return {"settings": "seqs=8 len=1024", "goodput": goodput_, "throughput": thr, "output_tok_s": 200.0,
            "ttft_p95_s": 2.5, "tpot_p95_s": 0.031, "preemptions": 12.0, "completed": 150, "duration_s": 80.2, **kw}


def test_table_rows_line_up_and_show_ratios():
    rows = [("default", _run(0.5, 1.0)), ("best static", _run(1.0, 1.6)), ("Auto", _run(1.2, 1.6))]
    text = format_table(rows, SLO, auto_key="Auto", default_key="default", best_key="best static",
                        converge_s=42.0)
    lines = text.splitlines()
    assert "TTFT <= 3 s and TPOT <= 50 ms" in lines[0]
    assert lines[1] == table_header()
    assert len(lines[2]) == len(lines[3]) == len(lines[1])
    assert "31ms" in lines[2] and "2.50s" in lines[2] and "0.500" in lines[2]
    assert "autotuned / default    : goodput x2.40, throughput x1.60" in text
    assert "autotuned / best static: goodput x1.20, throughput x1.00" in text
    assert "converged 42s" in text


def test_table_tolerates_missing_numbers():
    row = table_row("Auto", {"settings": "x", "goodput": 0.0, "throughput": 0.0, "ttft_p95_s": None,
                             "tpot_p95_s": None, "preemptions": None, "completed": 0, "duration_s": 1.0})
    assert row.split()[4:7] == ["-", "-", "-"]
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None
    text = format_table([("d", _run(0.0, 1.0)), ("A", _run(1.0, 1.0))], SLO, auto_key="A", default_key="d")
    assert "goodput x-" in text and "convergence: unknown" in text


def test_timeline_png_from_synthetic_samples(tmp_path):
    samples = [Sample(t=5.0 * i, kv_pct=min(100, 20 + 8 * i), preempt_per_s=max(0.0, 1.0 - 0.1 * i),
                      queue_p95_s=None if i == 0 else 0.5, max_num_seqs=64 if i < 6 else 16,
                      max_model_len=2048, replicas=1 if i < 12 else 2, diagnosis="PreemptionBound")
               for i in range(20)]
    changes = [Change(30.0, {"maxNumSeqs": [64, 16]}), Change(60.0, {"replicas": [1, 2]})]
    out = write_timeline_png(samples, changes, tmp_path / "sub" / "t.png", phases=[(0.0, "load")])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    empty = write_timeline_png([], [], tmp_path / "empty.png")  # no data yet: still a figure
    assert empty.exists()


def test_observed_changes_fill_in_what_the_history_missed():
    from timeline import observed_changes
    samples = [Sample(t=float(t), max_num_seqs=s, max_model_len=2048, replicas=r)
               for t, s, r in [(0, 64, 1), (5, 64, 1), (10, 5, 1), (15, 5, 1), (20, 5, 2), (25, 5, 2)]]
    recorded = [Change(9.0, {"maxNumSeqs": [64, 5]})]
    seen = observed_changes(samples, recorded)
    assert [(c.t, c.change, c.action) for c in seen] == [(20.0, {"replicas": [1, 2]}, "observed")]
    assert convergence_time(recorded + seen) == 20.0
    assert observed_changes([], recorded) == []


def test_goodput_after_counts_requests_sent_from_then_over_the_time_left():
    from timeline import goodput_after
    # (sent_at, ttft, tpot): two early requests miss, three later ones meet the objective, one fails.
    run = {"duration_s": 40.0, "outcomes": [[1.0, 9.0, 0.02], [5.0, 1.0, 0.09], [10.0, 1.0, 0.02],
                                            [20.0, 0.5, 0.03], [30.0, 2.0, 0.04], [35.0, None, None]]}
    assert goodput_after(run, 10.0, SLO) == pytest.approx(3 / 30)
    assert goodput_after(run, None, SLO) is None
    assert goodput_after(run, 40.0, SLO) is None  # nothing left after convergence
    assert goodput_after({"duration_s": 40.0}, 10.0, SLO) is None  # no per-request outcomes
