"""The autotuner's pure decision over hand-built snapshots: every rule, bounds,
hysteresis, cooldown, verification and revert, NoData, HPA-owned scale."""

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from kvpilot.operator.autotune import (
    TINY_FLOAT32, Action, Bounds, Decision, Diagnosis, History, PodSettings, Range, Settings,
    MetricsSnapshot, Thresholds, decide, plan_capacity, prefix_cache_warning,
)

T0 = 1_700_000_000.0
WINDOW = 60.0
BOUNDS = Bounds(max_num_seqs=Range(4, 256), max_model_len=Range(256, 8192), replicas=Range(1, 3))
CUR = Settings(max_num_seqs=64, max_model_len=2048, replicas=1, block_size=16, max_num_batched_tokens=2048)


def snap(t=T0, **kw) -> MetricsSnapshot:
    base = dict(time=t, window_s=WINDOW, kv_usage_mean=0.40, kv_usage_max=0.55, preemptions_per_s=0.0,
                queue_time_p95_s=0.05, ttft_p95_s=0.1, num_waiting=0.0, num_running=4.0,
                request_rate_per_s=2.0, request_len_p99=300.0, prefix_hit_rate=0.5, length_refusals_per_s=None)
    base.update(kw)
    return MetricsSnapshot(**base)


PREEMPTING = dict(preemptions_per_s=0.5, kv_usage_mean=0.97, kv_usage_max=1.0, num_waiting=10.0, queue_time_p95_s=3.0,
                  num_running=60.0)
SCHED = dict(queue_time_p95_s=2.0, num_waiting=8.0, kv_usage_mean=0.15, kv_usage_max=0.20)


def sched(cur: Settings, t=T0, **kw) -> MetricsSnapshot:
    """Queueing with a cool cache while the pods run as many sequences as the cap allows."""
    return snap(t=t, **{**SCHED, "num_running": float(cur.max_num_seqs), **kw})
KVFULL = dict(queue_time_p95_s=2.0, num_waiting=8.0, kv_usage_mean=0.95, kv_usage_max=0.99, request_len_p99=300.0)
IDLE = dict(request_rate_per_s=0.0, num_running=0.0, num_waiting=0.0, queue_time_p95_s=None,
            ttft_p95_s=None, kv_usage_mean=0.0, kv_usage_max=0.0)


def past(*diagnoses, end=T0 - 30.0, step=30.0) -> History:
    """A history whose last intervals had these diagnoses (holds, no changes)."""
    h = History()
    n = len(diagnoses)
    for i, d in enumerate(diagnoses):
        h = h.record(Decision(end - (n - 1 - i) * step, d, Action.HOLD, "earlier"), applied=False)
    return h


def run(s, cur=CUR, history=History(), now=None, **kw) -> Decision:
    return decide(s, cur, BOUNDS, history, s.time if now is None else now, **kw)


# --- rules ------------------------------------------------------------------------------

def test_healthy_holds():
    d = run(snap())
    assert d.diagnosis is Diagnosis.HEALTHY
    assert d.action is Action.HOLD and d.change == {}
    assert "healthy" in d.reason


def test_preemption_lowers_max_num_seqs_by_a_bounded_step():
    d = run(snap(**PREEMPTING))
    assert d.diagnosis is Diagnosis.PREEMPTION_BOUND
    assert d.action is Action.CHANGE
    assert d.change == {"max_num_seqs": (64, 48)}
    assert d.target == "preemptions_per_s" and d.baseline == 0.5
    assert "0.50/s" in d.reason and "64 -> 48" in d.reason


def test_preemption_steps_toward_the_capacity_bound_but_at_most_halves():
    plan32 = plan_capacity(TINY_FLOAT32, seq_len=512, max_num_seqs=64, kv_cache_memory="64Mi")
    d = run(snap(**PREEMPTING), capacity=plan32)
    assert d.change == {"max_num_seqs": (64, 32)}
    assert "32 sequences that fit" in d.reason
    plan8 = plan_capacity(TINY_FLOAT32, seq_len=2048, max_num_seqs=64, kv_cache_memory="64Mi")
    assert plan8.max_concurrent_seqs == 8
    assert run(snap(**PREEMPTING), capacity=plan8).change == {"max_num_seqs": (64, 32)}
    plan60 = plan_capacity(TINY_FLOAT32, seq_len=2048, max_num_seqs=64, kv_cache_memory=60 * 2048 * 4096)
    assert run(snap(**PREEMPTING), capacity=plan60).change == {"max_num_seqs": (64, 48)}  # x0.75 is lower


def test_preemption_with_few_running_steps_from_the_running_count():
    """64 allowed but ~8 running: the cache limits admission, so a cap anywhere above 8 binds
    nothing; the step is taken from the 8 that run (a cap of 8 itself would change nothing,
    and its verification would judge noise)."""
    d = run(snap(**dict(PREEMPTING, num_running=7.8)))
    assert d.change == {"max_num_seqs": (64, 6)} and "only 7.8 run at once" in d.reason
    plan = plan_capacity(seq_len=208, max_num_seqs=64, kv_cache_memory=2 * 2**20, bytes_per_token=4096)
    assert plan.max_concurrent_seqs == 2
    # toward the 2 that fit, at most halving the 8 that run
    assert run(snap(**dict(PREEMPTING, num_running=7.8)), capacity=plan).change == {"max_num_seqs": (64, 4)}
    plan10 = plan_capacity(seq_len=208, max_num_seqs=64, kv_cache_memory=10 * 208 * 4096, bytes_per_token=4096)
    assert run(snap(**dict(PREEMPTING, num_running=7.8)), capacity=plan10).change == {"max_num_seqs": (64, 6)}
    d = run(snap(**dict(PREEMPTING, num_running=3.8)), cur=replace(CUR, max_num_seqs=4))
    assert "max_num_seqs" not in d.change  # at the bound: nothing to lower


def test_preemption_never_goes_below_the_minimum():
    d = run(snap(**PREEMPTING), cur=replace(CUR, max_num_seqs=5))
    assert d.change == {"max_num_seqs": (5, 4)}


def test_preemption_at_the_minimum_is_hardware_bound_and_scales_out_when_sustained():
    cur = replace(CUR, max_num_seqs=4)
    first = run(snap(**PREEMPTING), cur=cur)
    assert first.diagnosis is Diagnosis.HARDWARE_BOUND and first.action is Action.HOLD
    assert "minimum 4" in first.reason and "once this lasts 2 intervals" in first.reason
    d = run(snap(**PREEMPTING), cur=cur, history=past(Diagnosis.PREEMPTION_BOUND))
    assert d.diagnosis is Diagnosis.HARDWARE_BOUND and d.change == {"replicas": (1, 2)}
    calm = dict(PREEMPTING, num_waiting=0.0, queue_time_p95_s=0.0)
    d = run(snap(**calm), cur=cur, history=past(Diagnosis.PREEMPTION_BOUND))
    assert d.diagnosis is Diagnosis.HARDWARE_BOUND and d.action is Action.HOLD
    assert "too small" in d.reason


def test_queueing_with_a_cool_cache_raises_max_num_seqs():
    cur = replace(CUR, max_num_seqs=16)
    d = run(sched(cur), cur=cur)
    assert d.diagnosis is Diagnosis.SCHEDULER_BOUND
    assert d.change == {"max_num_seqs": (16, 24)}
    # judged by the number waiting: a raise flushes the backlog, whose long queue times
    # then fill the next window's queue-time histogram
    assert d.target == "num_waiting" and d.baseline == 8.0
    assert "max_num_seqs=16 binds" in d.reason


def test_raise_is_capped_by_the_projected_kv_peak():
    # kv peak 0.6 only counts as "low" when already SchedulerBound (exit level 0.65);
    # 16 x 0.85 / 0.6 = 22.7 -> 22, below the x1.5 step of 24.
    cur = replace(CUR, max_num_seqs=16)
    d = run(sched(cur, kv_usage_max=0.6), cur=cur, history=past(Diagnosis.SCHEDULER_BOUND))
    assert d.change == {"max_num_seqs": (16, 22)}


def test_queueing_below_the_cap_is_not_the_caps_fault():
    # 8 wait while 20 of the 64 allowed run (a burst waiting for the token budget):
    # raising max_num_seqs would change nothing.
    d = run(snap(**dict(SCHED, num_running=20.0)))
    assert d.diagnosis is Diagnosis.HARDWARE_BOUND and "max_num_seqs" not in d.change


def test_counts_are_per_serving_pod_not_per_replica_asked_for():
    """Running and waiting are summed over the pods that report. A replica still starting
    reports nothing and runs nothing: with one of two serving, 64 running is the cap of 64
    binding on that one, so the cap is raised rather than the queue called hardware's."""
    cur = replace(CUR, replicas=2)
    one_serving = (PodSettings("tiny-0", 64, 2048),)
    d = run(sched(CUR, pods=one_serving), cur=cur)
    assert d.diagnosis is Diagnosis.SCHEDULER_BOUND and d.change == {"max_num_seqs": (64, 96)}
    both = one_serving + (PodSettings("tiny-1", 64, 2048),)
    d = run(sched(CUR, pods=both), cur=cur)  # 32 of 64 on each: the cap does not bind
    assert d.diagnosis is Diagnosis.HARDWARE_BOUND and "max_num_seqs" not in d.change
    # A preemption step is taken from what runs on a pod: 2 x 7.8 over two pods.
    d = run(snap(pods=both, **dict(PREEMPTING, num_running=15.6)), cur=cur)
    assert d.change == {"max_num_seqs": (64, 6)} and "only 7.8 run at once per pod" in d.reason


def test_a_backlog_on_one_pod_binds_its_cap_while_a_new_pod_idles():
    """Each pod queues its own requests: after a scale-out, the first pod still runs its cap
    over its backlog while the new one serves only its share of new arrivals. The mean per
    pod (40 of 64) hides that; the busiest pod's count shows the cap binding there."""
    cur = replace(CUR, replicas=2)
    both = (PodSettings("tiny-0", 64, 2048), PodSettings("tiny-1", 64, 2048))
    uneven = sched(CUR, pods=both, num_running=80.0)
    d = run(uneven, cur=cur)  # stock vLLM labels no busiest pod: the mean is all there is
    assert d.diagnosis is Diagnosis.HARDWARE_BOUND and "max_num_seqs" not in d.change
    d = run(replace(uneven, running_busiest_pod=64.0), cur=cur)
    assert d.diagnosis is Diagnosis.SCHEDULER_BOUND and d.change == {"max_num_seqs": (64, 96)}
    assert "64.0 run on the busiest pod" in d.reason
    # The TPOT p95 comes from the busiest pod too: a cut is scaled from its 64, not the mean
    # 40 (at most half in one step: 32, where the mean would give 20).
    t = Thresholds(tpot_objective_s=0.05)
    tpot = replace(uneven, running_busiest_pod=64.0, tpot_p95_s=0.1, num_waiting=0.0, queue_time_p95_s=0.0)
    assert run(tpot, cur=cur, thresholds=t).change == {"max_num_seqs": (64, 32)}


def test_raise_never_exceeds_the_bound_or_max_num_batched_tokens():
    cur = replace(CUR, max_num_seqs=200)
    assert run(sched(cur), cur=cur).change == {"max_num_seqs": (200, 256)}
    cur = replace(CUR, max_num_seqs=100, max_num_batched_tokens=128)
    assert run(sched(cur), cur=cur).change == {"max_num_seqs": (100, 128)}


def test_scheduler_bound_at_the_ceiling_adds_a_replica_when_sustained():
    cur = replace(CUR, max_num_seqs=256)
    first = run(sched(cur), cur=cur)
    assert first.diagnosis is Diagnosis.SCHEDULER_BOUND and first.action is Action.HOLD
    assert "at its limit 256" in first.reason
    d = run(sched(cur), cur=cur, history=past(Diagnosis.SCHEDULER_BOUND))
    assert d.change == {"replicas": (1, 2)}


def test_full_cache_with_short_requests_lowers_max_model_len():
    # p99 300 x 1.25 = 375 -> 384 (whole blocks); one step lowers at most to 2048 / 4 = 512.
    d = run(snap(**KVFULL))
    assert d.diagnosis is Diagnosis.KV_CACHE_BOUND
    assert d.change == {"max_model_len": (2048, 512)}
    assert "p99 request length 300" in d.reason
    d = run(snap(**KVFULL), cur=replace(CUR, max_model_len=1024))
    assert d.change == {"max_model_len": (1024, 384)}


def test_max_model_len_respects_its_minimum():
    d = run(snap(**dict(KVFULL, request_len_p99=50.0)), cur=replace(CUR, max_model_len=600))
    assert d.change == {"max_model_len": (600, 256)}


def test_full_cache_with_long_requests_is_hardware_bound():
    # 384 is not <= 512 x 0.5: lengths are not far below max_model_len.
    d = run(snap(**KVFULL), cur=replace(CUR, max_model_len=512))
    assert d.diagnosis is Diagnosis.HARDWARE_BOUND
    assert "no tuning headroom" in d.reason
    d = run(snap(**dict(KVFULL, request_len_p99=None)))
    assert d.diagnosis is Diagnosis.HARDWARE_BOUND


def test_hardware_bound_adds_a_replica_only_when_sustained_and_below_max():
    hw = dict(KVFULL, request_len_p99=1900.0)
    first = run(snap(**hw))
    assert first.diagnosis is Diagnosis.HARDWARE_BOUND and first.change == {}
    d = run(snap(**hw), history=past(Diagnosis.HARDWARE_BOUND))
    assert d.action is Action.CHANGE and d.change == {"replicas": (1, 2)}
    assert d.target == "queue_time_p95_s"
    d = run(snap(**hw), cur=replace(CUR, replicas=3), history=past(Diagnosis.HARDWARE_BOUND))
    assert d.change == {} and "maximum 3" in d.reason


def test_hpa_owned_scale_is_left_alone():
    hw = dict(KVFULL, request_len_p99=1900.0)
    cur = replace(CUR, hpa_owns_scale=True, replicas=2)
    d = run(snap(**hw), cur=cur, history=past(Diagnosis.HARDWARE_BOUND, Diagnosis.HARDWARE_BOUND))
    assert d.change == {} and "HPA" in d.reason
    idle = run(snap(**IDLE), cur=cur, history=past(Diagnosis.IDLE, Diagnosis.IDLE))
    assert idle.change == {} and "HPA" in idle.reason
    # Replicas outside the bounds are the HPA's business too; the other settings still move.
    preempting = {**PREEMPTING, "num_running": 9 * PREEMPTING["num_running"]}  # on each of the 9
    assert run(snap(**preempting), cur=replace(cur, replicas=9)).change == {"max_num_seqs": (64, 48)}
    refused = run(snap(length_refusals_per_s=0.5), cur=replace(cur, max_model_len=512))
    assert refused.change == {"max_model_len": (512, 1024)}


def test_sustained_idle_removes_one_replica_down_to_the_minimum():
    cur = replace(CUR, replicas=3)
    d = run(snap(**IDLE), cur=cur, history=past(Diagnosis.IDLE))
    assert d.diagnosis is Diagnosis.IDLE and d.change == {} and "idle for 3 intervals" in d.reason
    d = run(snap(**IDLE), cur=cur, history=past(Diagnosis.HEALTHY, Diagnosis.IDLE))
    assert d.change == {}
    d = run(snap(**IDLE), cur=cur, history=past(Diagnosis.IDLE, Diagnosis.IDLE))
    assert d.change == {"replicas": (3, 2)} and d.target is None
    d = run(snap(**IDLE), history=past(Diagnosis.IDLE, Diagnosis.IDLE))
    assert d.diagnosis is Diagnosis.IDLE and d.change == {}


def test_idle_never_scales_to_zero():
    bounds = replace(BOUNDS, replicas=Range(0, 3))
    d = decide(snap(**IDLE), CUR, bounds, past(Diagnosis.IDLE, Diagnosis.IDLE), T0)
    assert d.change == {}


def test_length_refusals_raise_max_model_len():
    d = run(snap(length_refusals_per_s=0.5), cur=replace(CUR, max_model_len=512))
    assert d.diagnosis is Diagnosis.LENGTH_BOUND
    assert d.change == {"max_model_len": (512, 1024)}
    assert d.target == "length_refusals_per_s"
    d = run(snap(length_refusals_per_s=0.5), cur=replace(CUR, max_model_len=8000))
    assert d.change == {"max_model_len": (8000, 8192)}
    # At its bound nothing can be raised: the diagnosis falls through to the load's own.
    d = run(snap(length_refusals_per_s=0.5), cur=replace(CUR, max_model_len=8192))
    assert d.action is Action.HOLD and d.diagnosis is Diagnosis.HEALTHY and "its bound" in d.reason


def test_refusals_stop_max_model_len_from_being_lowered():
    d = run(snap(**dict(KVFULL, length_refusals_per_s=0.2)))
    assert d.diagnosis is Diagnosis.LENGTH_BOUND and d.change == {"max_model_len": (2048, 4096)}


# --- bounds -----------------------------------------------------------------------------

def test_settings_outside_the_bounds_are_clamped_first():
    cur = replace(CUR, max_num_seqs=512, max_model_len=100, replicas=5)
    d = run(snap(), cur=cur)
    assert d.action is Action.CHANGE
    assert d.change == {"max_num_seqs": (512, 256), "max_model_len": (100, 256), "replicas": (5, 3)}
    assert "outside the spec's bounds" in d.reason
    nodata = run(snap(missing=("kv_usage_mean",)), cur=cur)
    assert nodata.diagnosis is Diagnosis.NO_DATA and nodata.change == d.change


_opt = st.one_of(st.none(), st.floats(0, 5))


@hsettings(max_examples=200, deadline=None)
@given(
    seqs=st.integers(4, 256), mlen=st.integers(256, 8192), replicas=st.integers(1, 3),
    kv_mean=st.floats(0, 1), kv_extra=st.floats(0, 1), preempt=st.floats(0, 3), queue=_opt,
    waiting=st.floats(0, 50), running=st.floats(0, 50), rate=st.floats(0, 20),
    p99=st.one_of(st.none(), st.floats(1, 20000)), refusals=st.one_of(st.none(), st.floats(0, 2)),
    prev=st.lists(st.sampled_from(list(Diagnosis)), max_size=4),
    cap=st.one_of(st.none(), st.integers(0, 600)),
)
def test_no_decision_leaves_the_bounds(seqs, mlen, replicas, kv_mean, kv_extra, preempt, queue, waiting,
                                      running, rate, p99, refusals, prev, cap):
    cur = replace(CUR, max_num_seqs=seqs, max_model_len=mlen, replicas=replicas)
    s = snap(kv_usage_mean=kv_mean, kv_usage_max=min(1.0, kv_mean + kv_extra), preemptions_per_s=preempt,
             queue_time_p95_s=queue, num_waiting=waiting, num_running=running, request_rate_per_s=rate,
             request_len_p99=p99, length_refusals_per_s=refusals)
    capacity = None
    if cap is not None:
        capacity = replace(plan_capacity(TINY_FLOAT32, seq_len=512, max_num_seqs=seqs, kv_cache_memory="64Mi"),
                           max_concurrent_seqs=cap)
    d = decide(s, cur, BOUNDS, past(*prev), T0, capacity=capacity)
    assert d.reason
    for k, (old, new) in d.change.items():
        assert old == getattr(cur, k) and old != new
        assert BOUNDS.of(k).min <= new <= BOUNDS.of(k).max
    if d.change.get("replicas"):
        assert abs(d.change["replicas"][1] - replicas) == 1
    if "max_num_seqs" in d.change:
        old, new = d.change["max_num_seqs"]
        # at most halved, from the cap or from the running count (per pod) below it
        assert new >= min(old * 0.5 - 1, math.ceil(running / replicas) * 0.5 - 1) and new <= max(old + 1, old * 1.5 + 1)


# --- hysteresis -------------------------------------------------------------------------

def test_preemption_hysteresis_enter_and_exit_levels():
    # between exit 0.02/s and enter 0.1/s (0.2 per finished request: above both of those levels)
    mild = snap(**dict(PREEMPTING, preemptions_per_s=0.05, request_rate_per_s=0.25))
    assert run(mild).diagnosis is not Diagnosis.PREEMPTION_BOUND
    assert run(mild, history=past(Diagnosis.PREEMPTION_BOUND)).diagnosis is Diagnosis.PREEMPTION_BOUND
    low = snap(**dict(PREEMPTING, preemptions_per_s=0.01, request_rate_per_s=0.25))
    assert run(low, history=past(Diagnosis.PREEMPTION_BOUND)).diagnosis is not Diagnosis.PREEMPTION_BOUND


def test_queue_hysteresis_enter_and_exit_levels():
    cur = replace(CUR, max_num_seqs=16)
    mild = sched(cur, queue_time_p95_s=0.3, num_waiting=1.0)  # between exit and enter levels
    assert run(mild, cur=cur).diagnosis is Diagnosis.HEALTHY
    assert run(mild, cur=cur, history=past(Diagnosis.SCHEDULER_BOUND)).diagnosis is Diagnosis.SCHEDULER_BOUND
    calm = sched(cur, queue_time_p95_s=0.1, num_waiting=0.2)
    assert run(calm, cur=cur, history=past(Diagnosis.SCHEDULER_BOUND)).diagnosis is Diagnosis.HEALTHY


def test_kv_full_hysteresis():
    nearly = snap(**dict(KVFULL, kv_usage_mean=0.85))  # between exit 0.80 and enter 0.90
    assert run(nearly).diagnosis is Diagnosis.HARDWARE_BOUND
    assert run(nearly, history=past(Diagnosis.KV_CACHE_BOUND)).diagnosis is Diagnosis.KV_CACHE_BOUND


# --- cooldown, verification, revert ------------------------------------------------------

def applied(decision: Decision, history: History = History()) -> History:
    return history.record(decision, applied=True)


def test_a_change_waits_for_a_full_window_before_it_is_judged():
    lowered = run(snap(**PREEMPTING))
    h = applied(lowered)
    cur = replace(CUR, max_num_seqs=48)
    d = run(snap(t=T0 + 30, **PREEMPTING), cur=cur, history=h)
    assert d.action is Action.HOLD and "verifying max_num_seqs 64 -> 48" in d.reason
    assert d.verifies is None


def test_cooldown_holds_after_a_verified_change_then_allows_the_next():
    lowered = run(snap(**PREEMPTING))
    h = applied(lowered)
    cur = replace(CUR, max_num_seqs=48)
    better = dict(PREEMPTING, preemptions_per_s=0.3)
    d = run(snap(t=T0 + 90, **better), cur=cur, history=h)
    assert d.action is Action.HOLD and "cooldown" in d.reason and "30s left" in d.reason
    assert d.verifies == lowered.time and d.verified is True
    h2 = h.record(d, applied=False)
    assert h2.entries[-1].checked and h2.entries[-1].verified is True
    d2 = run(snap(t=T0 + 130, **better), cur=cur, history=h2)
    assert d2.change == {"max_num_seqs": (48, 36)}


def test_recommendations_do_not_start_a_cooldown():
    rec = run(snap(**PREEMPTING))
    h = History().record(rec, applied=False)
    d = run(snap(t=T0 + 30, **PREEMPTING), history=h)
    assert d.change == {"max_num_seqs": (64, 48)}


def test_a_change_that_made_its_signal_worse_is_reverted():
    lowered = run(snap(**PREEMPTING))
    h = applied(lowered)
    cur = replace(CUR, max_num_seqs=48)
    d = run(snap(t=T0 + 70, **dict(PREEMPTING, preemptions_per_s=1.0)), cur=cur, history=h)
    assert d.action is Action.REVERT
    assert d.change == {"max_num_seqs": (48, 64)}
    assert d.verifies == lowered.time and d.verified is False
    assert "got worse" in d.reason and "0.50/s -> 1.00/s" in d.reason
    h2 = h.record(d, applied=True)
    assert h2.entries[0].verified is False and h2.entries[-1].decision.action is Action.REVERT
    # The revert is not itself verified, starts a cooldown, and blocks retrying the move.
    assert h2.pending_verification() is None
    cooled = run(snap(t=T0 + 100, **PREEMPTING), cur=CUR, history=h2)
    assert cooled.action is Action.HOLD and "cooldown" in cooled.reason
    later = run(snap(t=T0 + 300, **PREEMPTING), cur=CUR, history=h2)
    # Lowering again is blocked; with a queue too, the remaining move is a replica.
    assert "max_num_seqs" not in later.change and "reverted" in later.reason
    much_later = run(snap(t=T0 + 1000, **PREEMPTING), cur=CUR, history=h2)
    assert much_later.change == {"max_num_seqs": (64, 48)}


def test_small_wobbles_are_not_worse():
    lowered = run(snap(**PREEMPTING))  # baseline 0.5: worse means > 0.5 x 1.2 + 0.05 = 0.65
    cur = replace(CUR, max_num_seqs=48)
    d = run(snap(t=T0 + 200, **dict(PREEMPTING, preemptions_per_s=0.64)), cur=cur, history=applied(lowered))
    assert d.action is not Action.REVERT and d.verified is True


def test_a_raise_that_lengthened_the_queue_is_reverted():
    cur = replace(CUR, max_num_seqs=16)
    raised = run(sched(cur), cur=cur)
    d = run(sched(replace(cur, max_num_seqs=24), t=T0 + 200, num_waiting=14.0), cur=replace(cur, max_num_seqs=24),
            history=applied(raised))
    assert d.action is Action.REVERT and d.change == {"max_num_seqs": (24, 16)}


def test_a_raise_is_not_reverted_for_the_backlog_it_flushes():
    """Right after a raise the long-waiting backlog is admitted at once, so queue p95 jumps
    while the number waiting falls: that is the change working."""
    cur = replace(CUR, max_num_seqs=16)
    raised = run(sched(cur), cur=cur)
    d = run(sched(replace(cur, max_num_seqs=24), t=T0 + 200, queue_time_p95_s=5.0, num_waiting=4.0),
            cur=replace(cur, max_num_seqs=24), history=applied(raised))
    assert d.action is not Action.REVERT and d.verified is True


def test_scale_out_is_verified_but_not_reverted_by_default():
    hw = dict(KVFULL, request_len_p99=1900.0)
    added = run(snap(**hw), history=past(Diagnosis.HARDWARE_BOUND))
    h = applied(added, past(Diagnosis.HARDWARE_BOUND))
    cur = replace(CUR, replicas=2)
    worse = snap(t=T0 + 200, **dict(hw, queue_time_p95_s=9.0))
    d = run(worse, cur=cur, history=h)
    assert d.action is not Action.REVERT and d.verified is False
    assert "not reverted" in d.reason
    t = Thresholds(revert_replicas=True)
    d = run(worse, cur=cur, history=h, thresholds=t)
    assert d.action is Action.REVERT and d.change == {"replicas": (2, 1)}


def test_verification_is_inconclusive_when_the_setting_was_changed_by_someone_else():
    lowered = run(snap(**PREEMPTING))
    d = run(snap(t=T0 + 200, **dict(PREEMPTING, preemptions_per_s=2.0)), cur=replace(CUR, max_num_seqs=40),
            history=applied(lowered))
    assert d.action is not Action.REVERT
    assert d.verifies == lowered.time and d.verified is None


def test_max_model_len_is_not_lowered_again_right_after_a_raise():
    raised = run(snap(length_refusals_per_s=0.5), cur=replace(CUR, max_model_len=512))
    h = applied(raised)
    cur = replace(CUR, max_model_len=1024)
    d = run(snap(t=T0 + 200, **dict(KVFULL, request_len_p99=100.0, length_refusals_per_s=0.0)),
            cur=cur, history=h)
    assert "max_model_len" not in d.change
    assert "not lowering it again yet" in d.reason


# --- no data, pods --------------------------------------------------------------------

@pytest.mark.parametrize("kw,word", [
    (dict(missing=("kv_usage_mean", "kv_usage_max")), "no series for kv_usage_mean"),
    (dict(stale=("preemptions_per_s",)), "stale samples for preemptions_per_s"),
    (dict(num_running=None), "no value for num_running"),
    (dict(missing=("queue_time_p95_s",)), "no series for queue_time_p95_s"),
])
def test_missing_or_stale_data_is_no_decision(kw, word):
    d = run(snap(**dict(PREEMPTING, **kw)))
    assert d.diagnosis is Diagnosis.NO_DATA and d.action is Action.HOLD and d.change == {}
    assert word in d.reason


def test_optional_signals_may_be_missing():
    d = run(snap(**dict(PREEMPTING, ttft_p95_s=None, prefix_hit_rate=None, request_len_p99=None,
                        missing=("ttft_p95_s", "prefix_hit_rate", "request_len_p99", "length_refusals_per_s"))))
    assert d.diagnosis is Diagnosis.PREEMPTION_BOUND


def test_an_empty_queue_quantile_means_nothing_waited():
    d = run(snap(queue_time_p95_s=None))
    assert d.diagnosis is Diagnosis.HEALTHY


def test_holds_until_the_pods_report_the_settings():
    pods = (PodSettings("tiny-0", 64, 2048), PodSettings("tiny-1", 48, 2048))
    d = run(snap(pods=pods, **PREEMPTING), cur=replace(CUR, max_num_seqs=48))
    assert d.action is Action.HOLD and "waiting for the pods" in d.reason and "[48, 64]" in d.reason
    ok = (PodSettings("tiny-0", 64, 2048), PodSettings("tiny-1", None, None))
    # Two pods report: 60 running on each is what the cap of 64 sees.
    assert run(snap(pods=ok, **{**PREEMPTING, "num_running": 120.0})).change == {"max_num_seqs": (64, 48)}


def test_decide_is_pure():
    h = past(Diagnosis.HARDWARE_BOUND)
    s = snap(**KVFULL)
    a, b = run(s, history=h), run(s, history=h)
    assert a == b
    assert h == past(Diagnosis.HARDWARE_BOUND)


def test_history_keeps_the_last_n():
    h = History(limit=3)
    for i in range(5):
        h = h.record(Decision(T0 + i, Diagnosis.PREEMPTION_BOUND, Action.CHANGE, "x",
                              change={"max_num_seqs": (64 - i, 63 - i)}), applied=True)
    assert len(h.entries) == 3 and len(h.diagnoses) == 3
    assert h.entries[0].decision.time == T0 + 2


# --- closed loop ------------------------------------------------------------------------

def engine(seqs: int, t: float) -> MetricsSnapshot:
    """A toy deployment: the cache holds 24 sequences; 40 requests are always in flight."""
    fits, demand = 24, 40
    running = min(seqs, demand)
    over = max(0, running - fits)
    return snap(t=t, preemptions_per_s=0.2 * over, kv_usage_mean=min(1.0, running / fits) * 0.95,
                kv_usage_max=min(1.0, running / fits), num_running=float(running),
                num_waiting=float(demand - running), queue_time_p95_s=0.1 * (demand - running) + 0.05 * over)


@pytest.mark.parametrize("start", [128, 8])
def test_closed_loop_converges_and_stays_in_bounds(start):
    cur, h, t = replace(CUR, max_num_seqs=start), History(), T0
    for _ in range(40):
        d = decide(engine(cur.max_num_seqs, t), cur, BOUNDS, h, t)
        h = h.record(d, applied=d.changes_something)
        for k, (_, new) in d.change.items():
            cur = replace(cur, **{k: new})
        t += 30
    assert 18 <= cur.max_num_seqs <= 24  # no preemption, KV not wasted
    assert all(4 <= e.decision.change.get("max_num_seqs", (0, 4))[1] <= 256 for e in h.entries)
    assert engine(cur.max_num_seqs, t).preemptions_per_s == 0


def test_prefix_cache_warning_diagnoses_but_never_acts():
    low = snap(prefix_hit_rate=0.05)
    w = prefix_cache_warning(low, shared_prefix=True)
    assert w is not None and "5%" in w and "start of the prompt" in w
    assert prefix_cache_warning(low, shared_prefix=False) is None
    assert prefix_cache_warning(snap(prefix_hit_rate=0.6), shared_prefix=True) is None
    assert prefix_cache_warning(snap(prefix_hit_rate=None), shared_prefix=True) is None
    assert prefix_cache_warning(snap(**dict(IDLE, prefix_hit_rate=0.0)), shared_prefix=True) is None
    assert run(low).change == {}


def test_right_after_a_raise_the_cap_still_binds_at_the_old_width():
    # The window straddles a raise 16 -> 24: its mean running count (18) is the old cap's,
    # so the diagnosis stays SchedulerBound rather than blaming the hardware.
    cur = replace(CUR, max_num_seqs=16)
    raised = run(sched(cur), cur=cur)
    d = run(sched(replace(cur, max_num_seqs=24), t=T0 + 30, num_running=18.0),
            cur=replace(cur, max_num_seqs=24), history=applied(raised))
    assert d.diagnosis is Diagnosis.SCHEDULER_BOUND
    later = run(sched(replace(cur, max_num_seqs=24), t=T0 + 200, num_running=18.0),
                cur=replace(cur, max_num_seqs=24), history=applied(raised))
    assert later.diagnosis is Diagnosis.HARDWARE_BOUND  # a whole window at 24 with 18 running: not the cap


def test_a_raise_that_lifted_throughput_is_kept_though_the_backlog_grew():
    # An open-loop overload: the queue keeps growing after the raise, yet output rose 40 %.
    # Judging by the number waiting alone would revert the very change that helps.
    cur = replace(CUR, max_num_seqs=16)
    raised = run(sched(cur, generation_tokens_per_s=1000.0), cur=cur)
    assert raised.throughput_baseline == 1000.0
    after = sched(replace(cur, max_num_seqs=24), t=T0 + 200, num_waiting=30.0, generation_tokens_per_s=1400.0)
    d = run(after, cur=replace(cur, max_num_seqs=24), history=applied(raised))
    assert d.action is not Action.REVERT and d.verified is True
    assert "more load, not the change" in d.reason
    flat = sched(replace(cur, max_num_seqs=24), t=T0 + 200, num_waiting=30.0, generation_tokens_per_s=1050.0)
    d = run(flat, cur=replace(cur, max_num_seqs=24), history=applied(raised))
    assert d.action is Action.REVERT  # no gain: the longer queue is the change's
