"""The contest's parts: scenarios and their traces, scoring per GPU-hour, the replica-only
autoscalers' algorithms, Prometheus staleness for gone pods, the deployment model's fit,
and short virtual-time runs of the field guide's cases asserting the direction of Auto."""

from __future__ import annotations

import json
import math

import pytest

from kvpilot.engine.fleet.fleet import Fleet
from kvpilot.engine.fleet.scenarios import DAY, SCENARIOS, Slo, scenario
from kvpilot.engine.fleet.fleet import SimRequest
from kvpilot.engine.fleet.scoring import RecordedRun, percentile, score
from kvpilot.operator.autotune.virtual.contest import Contender, auto_settings, run_contender
from kvpilot.operator.autotune.history import History, Observation
from kvpilot.operator.autotune.planner import PlannerSettings, StepModel, fit, plan
from kvpilot.operator.autotune.decision import Bounds, Range, Settings, Thresholds
from kvpilot.operator.autotune.virtual.promql_lite import TSDB
from kvpilot.operator.autotune.virtual.rivals import Hpa, WvaSaturation
from kvpilot.operator.autotune.signals import MetricsSnapshot


def test_day_has_the_phases_the_issue_names_and_is_seeded():
    assert [p.name for p in DAY.phases] == ["chat", "rag", "burst", "quiet", "batch"]
    chat, rag, burst, quiet, batch = DAY.phases
    assert burst.rate == 3 * chat.rate and quiet.rate < 0.01 * chat.rate
    assert rag.input_lengths.sample(0.0) >= 4096 and rag.input_lengths.sample(0.999) <= 16384
    assert DAY.slos[-1] == Slo(None, None) and DAY.slos[0] == Slo(2.0, 0.05)
    short = DAY.scaled(0.02)
    a, b = short.trace(), short.trace()
    assert a == b and a  # the same seed, the same requests
    # Arrivals fall in their phases at their rates (Poisson: within a loose band).
    for k, (name, start, end) in enumerate(short.boundaries()):
        n = sum(1 for r in a if start <= r.arrival < end)
        expected = short.phases[k].rate * (end - start)
        assert abs(n - expected) <= 4 * math.sqrt(expected) + 2, name
    rag_reqs = [r for r in a if short.phase_index(r.arrival) == 1]
    assert any(r.prefix_id for r in rag_reqs) and all(r.prompt_len >= 4096 for r in rag_reqs)


def test_scenario_lookup_names_the_choices():
    assert set(SCENARIOS) == {"day", "preemption", "long-max-model-len", "scheduler-bound"}
    with pytest.raises(ValueError, match="scenario must be one of"):
        scenario("nope")
    with pytest.raises(ValueError, match="time_factor"):
        DAY.scaled(0)


def test_slo_judges_each_request():
    slo = Slo(2.0, 0.05)
    assert slo.met(1.0, 0.04, True) and not slo.met(3.0, 0.01, True) and not slo.met(1.0, 0.06, True)
    assert slo.met(1.0, None, True)  # a one-token answer has no TPOT to judge
    assert not slo.met(1.0, 0.01, False) and Slo(None, None).met(500.0, 9.0, True)


def test_gpu_seconds_count_starting_and_draining_replicas():
    scen = scenario("scheduler-bound")
    fleet = Fleet(scen.engine_config(), replicas=1, scrape_interval=15.0)
    fleet.run_until(10.0)
    fleet.add_replica(ready_in=60.0)  # held from the request, not from readiness
    fleet.run_until(100.0)
    assert fleet.num_replicas == 2
    fleet.remove_replica()  # idle: drains at once
    fleet.run_until(130.0)
    assert fleet.gpu_seconds(0.0, 130.0) == pytest.approx(130.0 + 90.0, abs=1.0)
    assert fleet.gpu_seconds(0.0, 10.0) == pytest.approx(10.0)


def test_score_splits_by_phase_and_uses_each_phase_objective():
    scen = scenario("scheduler-bound").scaled(0.05)
    fleet = Fleet(scen.engine_config(max_num_seqs=256), scrape_interval=15.0)
    fleet.run(scen.trace())
    s = score(fleet, scen)
    assert s["overall"]["requests"] == len(fleet.requests) == s["phases"][0]["requests"]
    assert s["overall"]["failed"] == 0 and s["overall"]["good"] == s["overall"]["requests"]
    assert s["overall"]["goodput_per_gpu_hour"] == pytest.approx(s["overall"]["good"] / (s["end"] / 3600))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 95) is None


def test_a_recorded_real_time_run_is_judged_as_a_simulated_one():
    scen = scenario("scheduler-bound").scaled(0.05)
    fleet = Fleet(scen.engine_config(max_num_seqs=256), scrape_interval=15.0)
    fleet.run(scen.trace())
    recorded = RecordedRun(list(fleet.requests), list(fleet.gpu_timeline))
    assert score(recorded, scen) == score(fleet, scen)
    # what the cluster run records per request: arrival, first token and end on the trace's
    # clock (a refused request has neither)
    late = RecordedRun([SimRequest(0, 0, arrival=1.0, prompt_len=10, output_tokens=11, first_token=4.0,
                                   finished=4.5),
                        SimRequest(1, 0, arrival=2.0, prompt_len=10, output_tokens=11, first_token=2.5,
                                   finished=3.0),
                        SimRequest(2, 0, arrival=2.5, prompt_len=10, error="HTTP 400")], [(0.0, 2)])
    s = score(late, scen)["overall"]
    assert (s["good"], s["failed"], s["gpu_hours"]) == (1, 1, pytest.approx(2 * 4.5 / 3600))  # TTFT 3 s > 2 s


def test_hpa_follows_the_kubernetes_algorithm():
    hpa = Hpa("t", target=5.0, metric=None)
    assert hpa.desired(current=2, ready=2, value=10.5, kind="total") == 2  # within 10 % tolerance
    assert hpa.desired(current=2, ready=2, value=31.0, kind="total") == 7  # ceil(31 / 5)
    kv = Hpa("kv", target=0.5, metric=None)
    assert kv.desired(current=3, ready=3, value=0.9, kind="average") == 6  # ceil(3 x 0.9 / 0.5)
    assert kv.desired(current=3, ready=3, value=0.52, kind="average") == 3


def test_hpa_scales_up_at_most_double_or_four_and_down_after_stabilization():
    class FakeFleet:
        num_replicas = 1
        replicas: list = []

    values = iter([100.0, 100.0, 0.0, 0.0])
    hpa = Hpa("t", target=5.0, metric=lambda t, f, p: (next(values), "total"), max_replicas=20)
    moves = []
    import kvpilot.operator.autotune.virtual.rivals as rivals

    def fake_set(fleet, n, startup):
        moves.append(n)
        fleet.num_replicas = n

    orig = rivals.set_replicas
    rivals.set_replicas = fake_set
    try:
        f = FakeFleet()
        hpa.tick(15.0, f, None)  # 1 -> min(20, max(2, 1 + 4)) = 5
        hpa.tick(30.0, f, None)  # 5 -> 10
        hpa.tick(45.0, f, None)  # wants 1, but 20 was recommended within 300 s
        hpa.tick(400.0, f, None)  # the high recommendations have aged out
    finally:
        rivals.set_replicas = orig
    assert moves == [5, 10, 1]


def test_wva_saturation_rules():
    w = WvaSaturation()
    assert w.target({"a": 0.9}, {"a": 0.0}, 1) == 2  # every replica saturated
    assert w.target({"a": 0.75, "b": 0.75}, {"a": 0, "b": 0}, 2) == 3  # spare KV 0.05 < 0.1
    assert w.target({"a": 0.1, "b": 0.1}, {"a": 0, "b": 0}, 2) == 1  # one fewer still leaves room
    assert w.target({"a": 0.5, "b": 0.5}, {"a": 0, "b": 0}, 2) == 2
    assert w.target({"a": 0.1}, {"a": 0}, 3) == 3  # a scale-up still starting is kept


def test_gone_pods_go_stale_for_instant_queries():
    db = TSDB()
    for t in (15.0, 30.0):
        db.add("vllm:num_requests_waiting", {"pod": "a"}, t, 1.0)
        db.add("vllm:num_requests_waiting", {"pod": "b"}, t, 2.0)
    db.mark_stale({"pod": "b"}, 45.0)
    assert float(db.query("sum(vllm:num_requests_waiting)", 40.0)[0]["value"][1]) == 3.0
    assert float(db.query("sum(vllm:num_requests_waiting)", 50.0)[0]["value"][1]) == 1.0
    assert len(db.query("timestamp(vllm:num_requests_waiting)", 50.0)) == 1


def test_fit_recovers_a_known_deployment_model():
    truth = StepModel(a=0.006, b=0.0001, c=2e-5, windows=0)
    obs, t = [], 0.0
    for x, p in [(200, 10000), (100, 10000), (150, 3000), (60, 20000), (220, 1000), (120, 15000)]:
        t += 30
        obs.append(Observation(t, x, p, truth.tpot(x, p)))
    model = fit(History(observations=tuple(obs)), t, PlannerSettings(prior_weight=1e-3))
    for x, p in [(80, 5000), (250, 12000)]:
        assert model.tpot(x, p) == pytest.approx(truth.tpot(x, p), rel=0.03)
    assert model.width_for(0.05, 10000) == pytest.approx(truth.width_for(0.05, 10000), rel=0.05)


def test_plan_sizes_replicas_to_the_demand_within_the_objective():
    model = StepModel(a=0.006, b=0.0001, c=1e-5, windows=10)
    s = MetricsSnapshot(time=0, window_s=60, generation_tokens_per_s=9000, request_rate_per_s=45,
                 prompt_tokens_per_s=36000, num_waiting=0, num_waiting_now=0, tpot_mean_s=0.03,
                 tpot_p95_s=0.03)
    cur = Settings(max_num_seqs=256, max_model_len=32768, replicas=1)
    bounds = Bounds(Range(1, 1024), Range(1024, 32768), Range(1, 8))
    p = plan(s, cur, bounds, model, Thresholds(tpot_objective_s=0.05))
    x = model.width_for(0.045, 36000 / p.replicas)
    assert p.replicas * x / 0.045 >= 9000 * 1.25  # carries the demand with headroom ...
    x_fewer = model.width_for(0.045, 36000 / (p.replicas - 1))
    assert (p.replicas - 1) * x_fewer / 0.045 < 9000 * 1.25  # ... and fewer would not
    assert "replica" in p.reason and "TPOT" in p.reason


def test_plan_with_min_replicas_zero_never_plans_zero():
    """Zero is the idle rule's (scale_to_zero.py); the plan's search starts at one (it
    divided the prompt rate by zero replicas before)."""
    model = StepModel(a=0.006, b=0.0001, c=1e-5, windows=10)
    s = MetricsSnapshot(time=0, window_s=60, generation_tokens_per_s=10, request_rate_per_s=0.05,
                 prompt_tokens_per_s=40, num_waiting=0, num_waiting_now=0, tpot_mean_s=0.01,
                 tpot_p95_s=0.01)
    cur = Settings(max_num_seqs=16, max_model_len=512, replicas=1)
    p = plan(s, cur, Bounds(Range(1, 64), Range(512, 512), Range(0, 1)), model,
             Thresholds(tpot_objective_s=0.05))
    assert p.replicas == 1


def test_a_flex_only_window_plans_the_widest_batch_and_no_headroom():
    model = StepModel(a=0.006, b=0.0002, c=1e-5, windows=10)
    kv = dict(kv_cache_bytes=200 * 2000 * 131072 / 0.9, kv_bytes_per_token=131072,
              prompt_len_mean=1600.0, generation_len_mean=400.0)  # 200 sequences of 2000 tokens fit
    s = MetricsSnapshot(time=0, window_s=60, generation_tokens_per_s=9600, request_rate_per_s=24,
                 prompt_tokens_per_s=38400, num_waiting=0, num_waiting_now=0, tpot_mean_s=0.03,
                 tpot_p95_s=None, flex_share=1.0, **kv)
    cur = Settings(max_num_seqs=256, max_model_len=32768, replicas=1)
    bounds = Bounds(Range(1, 1024), Range(1024, 32768), Range(1, 8))
    t = Thresholds(tpot_objective_s=0.05)
    p = plan(s, cur, bounds, model, t)
    assert p.max_num_seqs == 200  # as wide as the cache holds, whatever its TPOT
    per_replica = lambda r: 200 / model.tpot(200, 38400 / r)  # noqa: E731
    assert p.replicas * per_replica(p.replicas) >= 9600 > (p.replicas - 1) * per_replica(p.replicas - 1)
    assert "service_tier flex" in p.reason and "no TPOT objective" in p.reason
    # The same demand with latency-sensitive requests in it is held to the objective.
    strict = plan(MetricsSnapshot(**{**s.__dict__, "tpot_p95_s": 0.03, "flex_share": 0.5}), cur, bounds, model, t)
    assert strict.replicas > p.replicas and strict.max_num_seqs < 200


def _auto(name: str, scale: float) -> dict:
    scen = scenario(name).scaled(scale)
    return run_contender(scen, Contender("auto", scen.max_num_seqs, scen.max_model_len, scen.replicas))


def test_scheduler_bound_case_raises_max_num_seqs():
    r = _auto("scheduler-bound", 0.3)
    first = r["decisions"][0]
    assert first["diagnosis"] == "SchedulerBound"
    old, new = first["change"]["max_num_seqs"]
    assert new > old
    assert r["overall"]["failed"] == 0


def test_preemption_case_lowers_max_num_seqs():
    r = _auto("preemption", 0.3)
    moves = [d for d in r["decisions"] if d["diagnosis"] == "PreemptionBound"]
    assert moves and moves[0]["change"]["max_num_seqs"][1] < 256


# --- the model inside the policy (Thresholds.planner) ------------------------------------

from kvpilot.operator.autotune.decision import Decision as _Decision, Diagnosis  # noqa: E402
from kvpilot.operator.autotune.planner import observation  # noqa: E402
from kvpilot.operator.autotune.policy import decide  # noqa: E402

T0 = 1_700_000_000.0
PLANNED = Thresholds(tpot_objective_s=0.05, planner=True, cooldown_s=60.0)
BOUNDS8 = Bounds(Range(1, 1024), Range(1024, 32768), Range(1, 8))


def _snap(**kw) -> MetricsSnapshot:
    base = dict(time=T0, window_s=60.0, kv_usage_mean=0.3, kv_usage_max=0.4, preemptions_per_s=0.0,
                queue_time_p95_s=0.05, ttft_p95_s=0.2, tpot_p95_s=0.07, tpot_mean_s=0.05,
                generation_tokens_per_s=5000.0, num_waiting=0.0, num_waiting_now=0.0, num_running=240.0,
                running_min=200.0, request_rate_per_s=24.0, prompt_tokens_per_s=19000.0,
                request_len_p99=4000.0, length_refusals_per_s=None, kv_cache_bytes=55e9,
                kv_bytes_per_token=131072.0)
    base.update(kw)
    return MetricsSnapshot(**base)


def _known_history(n: int = 10) -> History:
    """Windows measured on a deployment with TPOT = (10ms + 0.1ms x running) / (1 - 20us x
    prompt tok/s) at varied operating points: enough data for the model to be trusted."""
    from kvpilot.operator.autotune.history import Observation

    h = History()
    for k in range(n):
        x, p = 20.0 + 25.0 * (k % 5), 2000.0 + 3000.0 * (k % 3)
        h = h.observe(Observation(T0 - 15.0 * (n - k), x, p, (0.010 + 0.0001 * x) / (1 - 20e-6 * p)))
    return h


def _decide(s: MetricsSnapshot, cur: Settings) -> _Decision:
    history = _known_history().observe(observation(s, cur.replicas))
    return decide(s, cur, BOUNDS8, history, s.time, thresholds=PLANNED)


def test_planned_scale_out_names_the_model_and_the_demand():
    cur = Settings(max_num_seqs=256, max_model_len=32768, replicas=1)
    d = _decide(_snap(), cur)
    assert d.diagnosis is Diagnosis.TPOT_BOUND
    assert d.change["replicas"][1] > 1
    assert "TPOT ~=" in d.reason and "demand" in d.reason and d.planned_replicas == d.change["replicas"][1]


def test_no_narrowing_while_requests_queue():
    cur = Settings(max_num_seqs=256, max_model_len=32768, replicas=8)
    queued = _snap(queue_time_p95_s=20.0, num_waiting=2000.0, num_waiting_now=3000.0,
                   num_running=2000.0, running_min=1500.0)
    d = _decide(queued, cur)
    assert "max_num_seqs" not in d.change or d.change["max_num_seqs"][1] >= 256


def test_scale_in_waits_for_calm_plans():
    cur = Settings(max_num_seqs=256, max_model_len=32768, replicas=4)
    calm = _snap(tpot_p95_s=0.015, tpot_mean_s=0.012, num_running=20.0, running_min=10.0,
                 generation_tokens_per_s=800.0, request_rate_per_s=4.0, prompt_tokens_per_s=3200.0)
    first = _decide(calm, cur)
    assert "replicas" not in first.change and first.planned_replicas < 4


def test_a_compressed_day_compresses_every_control_loop_with_it():
    scen = scenario("scheduler-bound").scaled(0.05)
    fast = auto_settings(scen, 8, control_scale=1 / 3)
    slow = auto_settings(scen, 8)
    assert (fast.interval_s, fast.window_s, fast.thresholds.cooldown_s, fast.replica_startup_s) == \
        pytest.approx((slow.interval_s / 3, slow.window_s / 3, slow.thresholds.cooldown_s / 3,
                       slow.replica_startup_s / 3))
    keda = run_contender(scen, Contender("keda", 32, 32768), control_scale=0.5)
    assert keda["overall"]["requests"] > 0
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="control_scale"):
            run_contender(scen, Contender("static", 32, 32768), control_scale=bad)


# --- the command -----------------------------------------------------------------------

def test_contest_command_prints_the_table_and_writes_json_and_pngs(tmp_path, capsys):
    from kvpilot.engine.cli import main

    code = main(["autotune", "contest", "--scenario", "scheduler-bound", "--time-scale", "0.05",
                 "--scale-controls", "--workers", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "SIMULATED accelerator" in out and "kvpilot Auto" in out and "Auto / defaults" in out
    data = json.loads((tmp_path / "contest-scheduler-bound.json").read_text())
    assert data["simulated"] and {r["kind"] for r in data["results"]} == {"static", "keda", "wva", "hpa-kv", "dynamo",
                                                                           "auto"}
    assert data["control_scale"] == 0.05
    assert len(list(tmp_path.glob("contest-scheduler-bound-*.png"))) == 6


def test_contest_command_names_the_bad_flag(capsys):
    from kvpilot.engine.cli import main

    for argv, word in ((["--scenario", "nope"], "scenario"), (["--time-scale", "0"], "time_factor"),
                       (["--sweep", "--sweep-seqs", "12x"], "sweep_seqs"), (["--workers", "0"], "workers"),
                       (["--time-scale", "2", "--scale-controls"], "--scale-controls"),
                       (["--attainment", "1.5"], "attainment"), (["--attainment", "0"], "attainment")):
        assert main(["autotune", "contest", *argv]) == 2, argv
        assert word in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse's own choices there
        main(["sim", "run", "--scenario", "nope", "--simulate", "h100-80gb"])
    assert refused.value.code == 2 and "argument --scenario: invalid choice: 'nope'" in capsys.readouterr().err
