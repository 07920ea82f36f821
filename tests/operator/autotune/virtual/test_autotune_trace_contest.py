"""The contest on a user's own trace: the split evaluation (a static point chosen on the
first part, judged beside Auto on the rest), clients that give up, the grid's exact
pruning, the Dynamo-style contender, and the command end to end on a fixture."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvpilot.engine.fleet.fleet import Fleet
from kvpilot.engine.fleet.scenarios import from_trace
from kvpilot.engine.fleet.trace import Phase, generate
from kvpilot.operator.autotune.virtual.contest import Contender, run_contender, run_many, sweep_grid
from kvpilot.operator.autotune.virtual.contest_cli import ratios
from kvpilot.operator.autotune.virtual.contest_grid import chosen_on_first, run_grid

FIX = Path(__file__).resolve().parents[3] / "engine" / "fleet" / "trace_fixtures"


def _scen(duration=40.0, rate=3.0, prompts="uniform:200:800", **kw):
    reqs = list(generate([Phase(duration=duration, rate=rate, input=prompts, output="uniform:20:80")],
                         seed=3, max_len=8192))
    return replace(from_trace("t", reqs), **kw)


def test_the_split_judges_each_part_on_its_own_requests_and_gpus():
    scen = _scen()
    r = run_contender(scen, Contender("static", 64, 32768, 2), split=0.5)
    first, rest = r["split"]["first"], r["split"]["rest"]
    assert first["requests"] + rest["requests"] == r["overall"]["requests"]
    assert first["gpu_hours"] + rest["gpu_hours"] == pytest.approx(r["overall"]["gpu_hours"])
    assert 0 < r["split"]["at"] < r["end"]


def _fake(name, kind, whole, first, rest):
    def stats(g):
        return {"goodput_per_gpu_hour": g}
    return {"name": name, "kind": kind, "overall": stats(whole), "phases": [],
            "split": {"first": stats(first), "rest": stats(rest)}}


def test_the_point_chosen_on_the_first_part_is_judged_on_the_rest():
    a = _fake("static a", "static", whole=100, first=90, rest=110)  # best in hindsight
    b = _fake("static b", "static", whole=95, first=120, rest=60)  # looks best early
    auto = _fake("kvpilot Auto", "auto", whole=99, first=95, rest=80)
    assert chosen_on_first([a, b])["name"] == "static b"
    out = ratios([a, b, auto])
    assert out["best_static"]["name"] == "static a"
    chosen = out["static_chosen_on_first"]
    assert chosen["name"] == "static b" and chosen["ratio"] == 80 / 60


def test_clients_that_give_up_count_as_failed():
    scen = _scen(duration=30.0, rate=40.0)  # far more than one narrow replica serves
    cfg = scen.engine_config(max_num_seqs=4)
    patient = Fleet(cfg, scrape_interval=15)
    patient.run(scen.trace())
    assert all(r.error is None for r in patient.requests)
    hasty = Fleet(cfg, scrape_interval=15, client_timeout=5.0)
    hasty.run(scen.trace())
    gave_up = [r for r in hasty.requests if r.error and "client timeout" in r.error]
    assert gave_up and all(r.finished - r.arrival >= 5.0 - 1e-9 for r in gave_up)
    assert all(r.output_tokens == 0 for r in gave_up)


def test_the_grid_prunes_exactly():
    scen = replace(_scen(duration=30.0, rate=2.0), max_replicas=3)
    grid = sweep_grid(scen, seqs=(8, 64), lens=(32768,))
    full = run_many(scen, grid, workers=1)
    pruned_run, pruned = run_grid(scen, grid, workers=1)
    best = max(r["overall"]["goodput_per_gpu_hour"] for r in full)
    assert pruned > 0 and len(pruned_run) + pruned == len(grid)
    assert max(r["overall"]["goodput_per_gpu_hour"] for r in pruned_run) == best


def test_the_dynamo_style_planner_adds_replicas_for_a_heavy_load():
    scen = replace(_scen(duration=62.0, rate=20.0, prompts="uniform:3000:5000"), max_replicas=4)
    r = run_contender(scen, Contender("dynamo", 256, 32768, 1, label="Dynamo-style SLA planner"))
    assert any(d["change"]["replicas"][1] > d["change"]["replicas"][0] for d in r["decisions"])
    assert all(d["reason"].startswith("predicted") for d in r["decisions"])


def test_contest_command_on_a_trace_file(tmp_path, capsys):
    from kvpilot.engine.cli import main

    rc = main(["autotune", "contest", "--trace", str(FIX / "mooncake.jsonl"), "--trace-format", "mooncake",
               "--split", "0.5", "--client-timeout", "30", "--trace-rate-scale", "2", "--workers", "1",
               "--no-plots", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "rate scaled x2" in out and "clients give up after 30 s" in out
    assert "Dynamo-style SLA planner" in out and "judged on the rest" in out and "SIMULATED" in out
    assert (tmp_path / "contest-mooncake-x2.json").exists()


def test_the_attainment_contender_is_auto_buying_that_share(tmp_path, capsys):
    from kvpilot.engine.cli import main
    from kvpilot.operator.autotune.virtual.contest import auto_settings

    assert auto_settings(_scen(), 4, attainment=0.95).thresholds.attainment == 0.95
    assert auto_settings(_scen(), 4).thresholds.attainment is None  # Auto's default: what pays
    rc = main(["autotune", "contest", "--trace", str(FIX / "mooncake.jsonl"), "--trace-format", "mooncake",
               "--contenders", "auto", "--attainment", "0.95", "--workers", "1", "--no-plots", "--out", str(tmp_path)])
    assert rc == 0 and "kvpilot Auto (attainment 0.95)" in capsys.readouterr().out
    data = json.loads((tmp_path / "contest-mooncake.json").read_text())
    assert [r["kind"] for r in data["results"]] == ["auto", "auto-attainment"]


def test_bench_table_merges_a_rerun_and_prints_before_and_now(tmp_path, capsys):
    from kvpilot.operator.autotune.virtual.bench_table import merge, print_rows, row

    def result(auto):
        rows = [_fake("defaults", "static", 100, 100, 100), _fake("WVA", "wva", 120, 120, 120),
                _fake("kvpilot Auto", "auto", auto, auto, auto)]
        for r in rows:
            r["overall"].update(good=9, requests=10)
        return {"scenario": "conv", "results": rows, "ratios": {}}

    merged = merge(result(90), {"scenario": "conv", "results": [result(150)["results"][2]]})
    assert [r["name"] for r in merged["results"]] == ["defaults", "WVA", "kvpilot Auto"]
    r = row(merged, {"conv": {"auto": 50}})
    assert (r["auto_before"], r["auto"], r["x_best_replica_only"], r["x_defaults"]) == (50, 150, 1.25, 1.5)
    print_rows([r])
    out = capsys.readouterr().out
    assert "Auto before" in out and "x1.25" in out and "SIMULATED" in out
