"""The speculation rule (operator/autotune/speculation.py) on its own and inside the pure
policy: K turned down or off when the drafts cost more than they earn at the running batch,
left where it pays, raised a step when the batch narrows, within bounds, after cooldown and
verification, and reverted when TPOT got worse."""

from dataclasses import replace

import pytest

from kvpilot.operator.autotune import Action, Bounds, Decision, Diagnosis, History, PodSettings, Range, Settings, \
    MetricsSnapshot, Thresholds, decide
from kvpilot.operator.autotune.report import build_report, history_from_status
from kvpilot.operator.autotune.speculation import (acceptance_from_mean_len, best_k, step_cost,
                                                   tokens_per_verification, value)

T0 = 1_700_000_000.0
WINDOW = 60.0
SPEC_RANGE = Range(0, 4)
BOUNDS = Bounds(max_num_seqs=Range(4, 256), max_model_len=Range(256, 8192), replicas=Range(1, 3),
                num_speculative_tokens=SPEC_RANGE)
CUR = Settings(max_num_seqs=256, max_model_len=2048, replicas=1, block_size=16, max_num_batched_tokens=4096,
               num_speculative_tokens=4)
T = Thresholds()  # spec_compute_rows 128, spec_gain_margin 0.1


def snap(t=T0, **kw) -> MetricsSnapshot:
    """Healthy, no queue; speculating at K=4 with 1.6 tokens per verification."""
    base = dict(time=t, window_s=WINDOW, kv_usage_mean=0.40, kv_usage_max=0.55, preemptions_per_s=0.0,
                queue_time_p95_s=0.05, ttft_p95_s=0.1, num_waiting=0.0, num_running=64.0, running_min=50.0,
                request_rate_per_s=2.0, request_len_p99=300.0, prefix_hit_rate=0.5, tpot_mean_s=0.020,
                tpot_p95_s=0.030, generation_tokens_per_s=2000.0, spec_acceptance_rate=0.15,
                spec_mean_accepted_len=1.6, spec_drafts_per_s=1000.0, num_speculative_tokens=4.0)
    base.update(kw)
    return MetricsSnapshot(**base)


def run(s, cur=CUR, history=History(), bounds=BOUNDS, now=None) -> Decision:
    return decide(s, cur, bounds, history, s.time if now is None else now, thresholds=T)


def k_change(k_old, k_new, t, diagnosis=Diagnosis.HEALTHY, action=Action.CHANGE, target="tpot_mean_s",
             baseline=0.020) -> History:
    d = Decision(t, diagnosis, action, "earlier", change={"num_speculative_tokens": (k_old, k_new)},
                 target=target if action is Action.CHANGE else None, baseline=baseline)
    return History().record(d, applied=True)


# --- the model --------------------------------------------------------------------------

def test_the_model_numbers():
    assert tokens_per_verification(0.5, 0) == 1.0
    assert tokens_per_verification(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert tokens_per_verification(1.0, 3) == 4.0
    for a in (0.1, 0.4, 0.8, 0.95):
        for k in (1, 3, 8):
            assert acceptance_from_mean_len(tokens_per_verification(a, k), k) == pytest.approx(a, abs=1e-6)
    assert acceptance_from_mean_len(1.0, 4) == 0.0 and acceptance_from_mean_len(5.0, 4) == 1.0
    # Free below the compute threshold, in proportion to the rows above it.
    assert step_cost(20, 4, 128) == 1.0
    assert step_cost(64, 4, 128) == pytest.approx(2.5)
    assert step_cost(256, 3, 128) == pytest.approx(4.0)
    # At a batch past the threshold no K pays (E(K) <= K + 1); below it every accepted token is gain.
    assert best_k(0.9, 256, 0, 8, 128) == 0
    assert best_k(0.7, 10, 0, 8, 128) == 8
    assert value(0.0, 4, 10, 128) == 1.0


# --- turning it down --------------------------------------------------------------------

def test_large_batch_and_low_acceptance_halves_k_toward_the_best():
    d = run(snap())  # 64 running x (1 + 4) = 320 rows: 2.5x a plain step for 1.6 tokens
    assert d.action is Action.CHANGE and d.change == {"num_speculative_tokens": (4, 2)}
    assert d.diagnosis is Diagnosis.HEALTHY
    assert d.target == "tpot_mean_s" and d.baseline == 0.020
    assert "speculation costs more than it earns" in d.reason
    assert "64.0 running per replica x (1 + 4) = 320 rows a step" in d.reason
    assert "2.50x a plain one past the ~128-row compute threshold" in d.reason
    assert "1.60 tokens per verification at K=4, 15% of draft tokens accepted" in d.reason
    assert "lower num_speculative_tokens 4 -> 2" in d.reason and "(off" not in d.reason


def test_no_k_pays_at_a_very_large_batch_so_it_goes_off():
    d = run(snap(num_running=200.0, running_min=150.0, spec_mean_accepted_len=2.5, spec_acceptance_rate=0.38))
    assert d.change == {"num_speculative_tokens": (4, 0)}
    assert "lower num_speculative_tokens 4 -> 0 (off: no K pays at this batch)" in d.reason


def test_rows_are_per_replica():
    two = replace(CUR, replicas=2)
    bounds = replace(BOUNDS, replicas=Range(1, 3))
    d = run(snap(num_running=128.0), cur=two, bounds=bounds)  # 64 per replica: as the single-pod case
    assert d.change == {"num_speculative_tokens": (4, 2)}


def test_leaves_k_where_it_pays():
    d = run(snap(num_running=8.0, running_min=5.0, spec_mean_accepted_len=2.5))  # 40 rows: drafts are free
    assert d.action is Action.HOLD and d.change == {}


def test_a_small_predicted_gain_is_no_move():
    # 10 running: K=5 would be free too, but at acceptance 0.17 its fifth draft adds ~0.01% (< 10%).
    d = run(snap(num_running=10.0, spec_mean_accepted_len=1.2), bounds=replace(BOUNDS, num_speculative_tokens=Range(0, 5)))
    assert d.action is Action.HOLD


def test_the_lower_bound_holds_and_is_not_called_off():
    bounds = replace(BOUNDS, num_speculative_tokens=Range(2, 4))
    d = run(snap(num_running=200.0, running_min=150.0), bounds=bounds)
    assert d.change == {"num_speculative_tokens": (4, 2)} and "(off" not in d.reason
    assert run(snap(num_running=200.0), cur=replace(CUR, num_speculative_tokens=2), bounds=bounds).action \
        is Action.HOLD


def test_a_k_outside_the_bounds_is_clamped_whatever_the_data():
    d = run(snap(missing=("kv_usage_mean",)), cur=replace(CUR, num_speculative_tokens=6))
    assert d.action is Action.CHANGE and d.change == {"num_speculative_tokens": (6, 4)}
    assert "outside the spec's bounds: num_speculative_tokens 6 -> 4 (bounds [0, 4])" in d.reason


def test_turning_it_down_goes_before_the_diagnosis_rule():
    sched = dict(queue_time_p95_s=2.0, num_waiting=8.0, kv_usage_mean=0.15, kv_usage_max=0.20)
    cur = replace(CUR, max_num_seqs=64)
    d = run(snap(**sched), cur=cur)
    assert d.diagnosis is Diagnosis.SCHEDULER_BOUND and d.change == {"num_speculative_tokens": (4, 2)}
    assert d.throughput_baseline == 2000.0  # requests wait: the throughput guard applies too


# --- turning it up ----------------------------------------------------------------------

def test_raises_one_step_when_the_batch_narrows_and_acceptance_is_good():
    cur = replace(CUR, num_speculative_tokens=2)
    d = run(snap(num_running=10.0, running_min=6.0, spec_mean_accepted_len=2.2, spec_acceptance_rate=0.6,
                 num_speculative_tokens=2.0), cur=cur)
    assert d.change == {"num_speculative_tokens": (2, 3)} and d.target == "tpot_mean_s"
    assert "speculation would earn more" in d.reason and "raise num_speculative_tokens 2 -> 3" in d.reason
    # Up to the bound and no further.
    top = replace(CUR, num_speculative_tokens=4)
    assert run(snap(num_running=10.0, spec_mean_accepted_len=3.5), cur=top).action is Action.HOLD


def test_poor_acceptance_does_not_raise():
    cur = replace(CUR, num_speculative_tokens=2)
    d = run(snap(num_running=10.0, spec_mean_accepted_len=1.05, num_speculative_tokens=2.0), cur=cur)
    assert d.action is Action.HOLD


def test_off_tries_one_draft_only_where_it_is_free():
    off = replace(CUR, num_speculative_tokens=0)
    gone = dict(spec_acceptance_rate=None, spec_mean_accepted_len=None, spec_drafts_per_s=None,
                num_speculative_tokens=0.0)
    d = run(snap(num_running=20.0, **gone), cur=off)
    assert d.change == {"num_speculative_tokens": (0, 1)}
    assert "speculation is off and 20.0 running per replica x (1 + 1 draft) = 40 rows" in d.reason
    assert "try num_speculative_tokens 0 -> 1" in d.reason
    assert run(snap(num_running=100.0, **gone), cur=off).action is Action.HOLD  # 200 rows: not free
    no_room = replace(BOUNDS, num_speculative_tokens=Range(0, 0))
    assert run(snap(num_running=20.0, **gone), cur=off, bounds=no_room).action is Action.HOLD


def test_no_raise_under_preemption_or_while_another_rule_changes_something():
    preempting = dict(preemptions_per_s=0.5, kv_usage_mean=0.97, kv_usage_max=1.0, num_waiting=10.0,
                      queue_time_p95_s=3.0, num_running=20.0, running_min=15.0)
    off = replace(CUR, num_speculative_tokens=0, max_num_seqs=64)
    d = run(snap(**preempting, spec_mean_accepted_len=None, num_speculative_tokens=0.0), cur=off)
    assert d.diagnosis is Diagnosis.PREEMPTION_BOUND and "num_speculative_tokens" not in d.change


def test_the_other_rules_note_is_kept_when_k_is_raised():
    hardware = dict(queue_time_p95_s=2.0, num_waiting=8.0, kv_usage_mean=0.85, kv_usage_max=0.9,
                    num_running=20.0, running_min=15.0)
    off = replace(CUR, num_speculative_tokens=0, max_num_seqs=64)
    d = run(snap(**hardware, spec_mean_accepted_len=None, num_speculative_tokens=0.0), cur=off)
    assert d.change == {"num_speculative_tokens": (0, 1)}
    assert "adding a replica once this lasts" in d.reason and "try num_speculative_tokens 0 -> 1" in d.reason
    assert d.diagnosis is Diagnosis.HARDWARE_BOUND


# --- what else must hold ----------------------------------------------------------------

def test_no_evidence_no_move():
    assert run(snap(spec_mean_accepted_len=None)).action is Action.HOLD  # nothing drafted in the window
    assert run(snap(tpot_mean_s=None, tpot_p95_s=None)).action is Action.HOLD  # nothing to verify it by
    assert run(snap(), cur=replace(CUR, num_speculative_tokens=None),
               bounds=replace(BOUNDS, num_speculative_tokens=None)).action is Action.HOLD  # not configured


def test_no_move_on_a_window_in_which_load_began_or_paused():
    # Its running mean is diluted, and the window the move is judged against is not: in a
    # closed-loop ramp K went 4 -> 0 on a window reading 112 running per replica (247 once
    # steady), and the next window's TPOT looked worse, so the move was reverted.
    assert run(snap(running_min=0.0)).action is Action.HOLD
    assert run(snap(running_min=1.0)).change == {"num_speculative_tokens": (4, 2)}


def test_the_p95_is_the_target_when_the_mean_is_unknown():
    d = run(snap(tpot_mean_s=None))
    assert d.target == "tpot_p95_s" and d.throughput_baseline is None


def test_idle_is_left_alone():
    idle = dict(request_rate_per_s=0.0, num_running=0.0, num_waiting=0.0, queue_time_p95_s=None,
                kv_usage_mean=0.0, kv_usage_max=0.0, running_min=0.0)
    d = run(snap(**idle), cur=replace(CUR, num_speculative_tokens=0))
    assert d.diagnosis is Diagnosis.IDLE and d.action is Action.HOLD


def test_cooldown_after_any_change():
    seqs = Decision(T0 - 30, Diagnosis.SCHEDULER_BOUND, Action.CHANGE, "earlier",
                    change={"max_num_seqs": (128, 256)}, target=None)
    d = run(snap(), history=History().record(seqs, applied=True))
    assert d.action is Action.HOLD and "cooldown after max_num_seqs 128 -> 256" in d.reason


def test_pods_must_report_the_k_in_effect_first():
    pods = (PodSettings("a", 256, 2048, 4), PodSettings("b", 256, 2048, 2))
    d = run(snap(pods=pods), cur=replace(CUR, num_speculative_tokens=2))
    assert d.action is Action.HOLD and "num_speculative_tokens=[2, 4] (expected 2)" in d.reason


def test_a_change_that_made_tpot_worse_is_reverted():
    history = k_change(4, 2, T0)
    waiting = run(snap(t=T0 + 30, num_speculative_tokens=2.0), cur=replace(CUR, num_speculative_tokens=2),
                  history=history)
    assert waiting.action is Action.HOLD and "verifying num_speculative_tokens 4 -> 2" in waiting.reason
    later = T0 + WINDOW + 10
    d = run(snap(t=later, tpot_mean_s=0.030, num_speculative_tokens=2.0, spec_mean_accepted_len=1.5),
            cur=replace(CUR, num_speculative_tokens=2), history=history)
    assert d.action is Action.REVERT and d.change == {"num_speculative_tokens": (2, 4)}
    assert "tpot_mean_s 20.0ms -> 30.0ms after num_speculative_tokens 4 -> 2 got worse" in d.reason
    assert "reverting num_speculative_tokens 2 -> 4" in d.reason


def test_a_change_that_helped_is_kept():
    history = k_change(4, 2, T0)
    later = T0 + WINDOW + 10
    d = run(snap(t=later, tpot_mean_s=0.015, num_running=40.0, num_speculative_tokens=2.0,
                 spec_mean_accepted_len=1.5), cur=replace(CUR, num_speculative_tokens=2), history=history)
    assert d.verified is True and "verified: tpot_mean_s 20.0ms -> 15.0ms" in d.reason


def test_a_lost_throughput_reverts_too():
    history = History().record(Decision(T0, Diagnosis.SCHEDULER_BOUND, Action.CHANGE, "earlier",
                                        change={"num_speculative_tokens": (4, 2)}, target="tpot_mean_s",
                                        baseline=0.020, throughput_baseline=2000.0), applied=True)
    d = run(snap(t=T0 + WINDOW + 10, num_waiting=8.0, generation_tokens_per_s=1500.0, num_speculative_tokens=2.0),
            cur=replace(CUR, num_speculative_tokens=2), history=history)
    assert d.action is Action.REVERT and "output fell 2000 -> 1500 tokens/s" in d.reason


def test_a_reverted_move_and_a_recent_lowering_are_not_retried():
    revert = k_change(2, 4, T0 - 200, action=Action.REVERT)
    d = run(snap(), history=revert)
    assert d.action is Action.HOLD  # lowering was just undone: not again within flip_backoff_s
    lowered = k_change(4, 0, T0 - 300)
    lowered = lowered.record(Decision(T0 - 230, Diagnosis.HEALTHY, Action.HOLD, "ok", verifies=T0 - 300,
                                      verified=True), applied=False)
    off = replace(CUR, num_speculative_tokens=0)
    gone = dict(spec_mean_accepted_len=None, spec_acceptance_rate=None, num_speculative_tokens=0.0)
    assert run(snap(num_running=20.0, **gone), cur=off, history=lowered).action is Action.HOLD
    later = T0 + T.flip_backoff_s
    assert run(snap(t=later, num_running=20.0, **gone), cur=off, history=lowered).change == \
        {"num_speculative_tokens": (0, 1)}


def test_k_changes_survive_the_status_round_trip():
    d = run(snap())
    history = History().record(d, applied=True)
    report = build_report(d, history, snap()).dump()
    assert report["lastDecision"]["change"] == {"numSpeculativeTokens": [4, 2]}
    assert report["snapshot"]["specMeanAcceptedLen"] == 1.6 and report["snapshot"]["numSpeculativeTokens"] == 4
    back = history_from_status(report)
    assert back.entries[-1].decision.change == {"num_speculative_tokens": (4, 2)}
    assert back.entries[-1].decision.target == "tpot_mean_s"
