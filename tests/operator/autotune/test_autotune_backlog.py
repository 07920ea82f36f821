"""No replica for a backlog already served: every rule that scales out on queueing evidence
(HardwareBound, SchedulerBound and KVCacheBound with no move left, PreemptionBound at its
minimum) needs requests still waiting at the window's end. Queue p95 is recorded as requests
leave the queue, so a window's p95 still counts the waits of a backlog the fleet has just
served (the held-out Mooncake window added a fifth replica on queue p95 1.64 s with nothing
waiting). TPOT over its objective is other evidence and still scales out. The deployment
model's plan counts arrivals, not the completions of a backlog served in the window."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpilot.operator.autotune import Action, Bounds, Decision, Diagnosis, History, MetricsSnapshot, Range, Settings, decide
from kvpilot.operator.autotune.decision import Thresholds

T0 = 1_700_000_000.0
BOUNDS = Bounds(Range(4, 256), Range(1024, 32768), Range(1, 8))
CUR = Settings(max_num_seqs=64, max_model_len=32768, replicas=1)
RULES = Thresholds(tpot_objective_s=0.05)

# The queue-based routes to a scale-out, each as (diagnosis, settings, window of queueing).
QUEUED = dict(queue_time_p95_s=1.64, num_waiting=3.0, num_waiting_now=4.0)
ROUTES = {
    # running below the cap, cache cool: neither setting helps (the Mooncake window's)
    "hardware": (Diagnosis.HARDWARE_BOUND, CUR, dict(num_running=20.0, kv_usage_mean=0.24, kv_usage_max=0.52)),
    # the cap binds but max_num_seqs is at its bound
    "scheduler": (Diagnosis.SCHEDULER_BOUND, replace(CUR, max_num_seqs=256),
                  dict(num_running=256.0, kv_usage_mean=0.15, kv_usage_max=0.2)),
    # preempting at max_num_seqs' minimum
    "preemption": (Diagnosis.PREEMPTION_BOUND, replace(CUR, max_num_seqs=4),
                   dict(num_running=4.0, kv_usage_mean=0.97, kv_usage_max=1.0, preemptions_per_s=0.5)),
}


def snap(**kw) -> MetricsSnapshot:
    base = dict(time=T0, window_s=60.0, kv_usage_mean=0.3, kv_usage_max=0.5, preemptions_per_s=0.0,
                queue_time_p95_s=0.02, ttft_p95_s=0.3, tpot_p95_s=0.03, tpot_mean_s=0.02, num_waiting=0.0,
                num_waiting_now=0.0, num_running=20.0, running_min=5.0, request_rate_per_s=3.0,
                generation_tokens_per_s=600.0, prompt_tokens_per_s=9000.0, request_len_p99=4000.0)
    base.update(kw)
    return MetricsSnapshot(**base)


def past(*diagnoses, step=15.0) -> History:
    h = History()
    for k, d in enumerate(diagnoses):
        h = h.record(Decision(T0 - step * (len(diagnoses) - k), d, Action.HOLD, "earlier"), applied=False)
    return h


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("t", [RULES, replace(RULES, planner=True)], ids=["rules", "model-untrusted"])
def test_a_served_backlog_adds_no_replica_whatever_the_rule(route, t):
    earlier, cur, load = ROUTES[route]
    history = past(earlier, earlier)
    queueing = snap(**load, **QUEUED)
    d = decide(queueing, cur, BOUNDS, history, T0, thresholds=t)
    assert d.change == {"replicas": (1, 2)}, d.reason  # the route scales out on a queue there now
    served = replace(queueing, num_waiting_now=0.0)
    d = decide(served, cur, BOUNDS, history, T0, thresholds=t)
    assert d.action is Action.HOLD and "replicas" not in d.change, d.reason
    assert "0.0 waiting now: the backlog has been served" in d.reason
    # a queue still there, however small the window's mean, is queueing now
    still = replace(queueing, num_waiting=0.2, num_waiting_now=1.0)
    assert decide(still, cur, BOUNDS, history, T0, thresholds=t).change == {"replicas": (1, 2)}
    # pods that do not say what waits now: the window's own queue decides, as before
    unknown = replace(served, num_waiting_now=None)
    assert decide(unknown, cur, BOUNDS, history, T0, thresholds=t).change == {"replicas": (1, 2)}


def test_the_mooncake_window_holds_its_replicas():
    # 405 s into Mooncake's 10-20 min window: 4 replicas, queue p95 1.64 s, nothing waiting
    # on average or now, KV 24 % (the model distrusted, so the rules decided): it added a fifth.
    cur = replace(CUR, max_num_seqs=37, replicas=4, max_num_batched_tokens=4096)
    s = snap(num_running=11.0, kv_usage_mean=0.24, kv_usage_max=0.52, queue_time_p95_s=1.64, num_waiting=0.0,
             num_waiting_now=0.0, tpot_p95_s=0.045, length_refusals_per_s=0.27)
    d = decide(s, cur, BOUNDS, past(Diagnosis.HARDWARE_BOUND, Diagnosis.HARDWARE_BOUND), T0,
               thresholds=replace(RULES, planner=True))
    # Nothing waits on average or now: queue p95 reads the waits of a few requests, no queue.
    assert d.diagnosis is Diagnosis.HEALTHY and "replicas" not in d.change, d.reason


def test_tpot_over_its_objective_still_scales_out_with_nothing_waiting():
    # TPOT is the evidence, not the queue: at the narrowest batch only more replicas help.
    cur = replace(CUR, max_num_seqs=4)
    s = snap(num_running=4.0, tpot_p95_s=0.08, queue_time_p95_s=1.0, num_waiting_now=0.0)
    history = past(Diagnosis.TPOT_BOUND, Diagnosis.TPOT_BOUND)
    d = decide(s, cur, BOUNDS, history, T0, thresholds=RULES)
    assert d.change == {"replicas": (1, 2)}, d.reason


def test_the_served_window_still_counts_toward_a_sustained_queue():
    # Held once on a served backlog, the next window with a queue there now scales out: the
    # served window was pressure too, so the scale-out does not start counting again.
    cur, load = ROUTES["hardware"][1:]
    history = past(Diagnosis.HARDWARE_BOUND)
    served = snap(**load, **dict(QUEUED, num_waiting_now=0.0))
    d = decide(served, cur, BOUNDS, history, T0, thresholds=RULES)
    assert "replicas" not in d.change
    history = history.record(d, applied=False)
    again = snap(time=T0 + 15.0, **load, **QUEUED)
    assert decide(again, cur, BOUNDS, history, T0 + 15.0, thresholds=RULES).change == {"replicas": (1, 2)}


def test_a_full_cache_with_max_model_len_held_adds_no_replica_for_a_served_backlog():
    # KVCacheBound whose move (lower max_model_len) is blocked right after a raise for refusals.
    raised = Decision(T0 - 300.0, Diagnosis.LENGTH_BOUND, Action.CHANGE, "refusals",
                      change={"max_model_len": (16384, 32768)}, target="length_refusals_per_s", baseline=0.5)
    history = History().record(raised, applied=True)
    for k in range(2):
        history = history.record(Decision(T0 - 30.0 + 15 * k, Diagnosis.KV_CACHE_BOUND, Action.HOLD, "earlier"),
                                 applied=False)
    s = snap(kv_usage_mean=0.95, kv_usage_max=0.99, request_len_p99=3000.0, num_running=30.0, **QUEUED)
    d = decide(s, CUR, BOUNDS, history, T0, thresholds=RULES)
    assert d.diagnosis is Diagnosis.HARDWARE_BOUND and d.change == {"replicas": (1, 2)}, d.reason
    d = decide(replace(s, num_waiting_now=0.0), CUR, BOUNDS, history, T0, thresholds=RULES)
    assert "replicas" not in d.change and "backlog has been served" in d.reason, d.reason


def test_the_model_plans_for_arrivals_not_for_a_backlog_served_in_the_window():
    # 67.5 requests/s finished, 22.5/s of them a backlog of 1350 served within the window (675
    # waiting on average, none now): 45/s arrive. The day's batch phase planned a third
    # replica from the served rate while its queue shrank.
    from kvpilot.operator.autotune.planner import StepModel, plan
    model = StepModel(a=0.006, b=0.0001, c=1e-5, windows=10)
    cur = Settings(max_num_seqs=256, max_model_len=32768, replicas=2)
    bounds = Bounds(Range(1, 1024), Range(1024, 32768), Range(1, 8))
    served = MetricsSnapshot(time=T0, window_s=60.0, generation_tokens_per_s=13500.0, request_rate_per_s=67.5,
                             prompt_tokens_per_s=54000.0, num_waiting=675.0, num_waiting_now=0.0,
                             tpot_mean_s=0.03, tpot_p95_s=0.03)
    steady = replace(served, generation_tokens_per_s=9000.0, request_rate_per_s=45.0, prompt_tokens_per_s=36000.0,
                     num_waiting=0.0)
    served_plan, steady_plan = plan(served, cur, bounds, model, RULES), plan(steady, cur, bounds, model, RULES)
    assert served_plan.replicas == steady_plan.replicas == 2, (served_plan.reason, steady_plan.reason)
    assert "demand 45.0 req/s arriving + 0 queued" in served_plan.reason
    # a queue that grows is demand the served rate does not show, as before
    growing = replace(steady, num_waiting=100.0, num_waiting_now=400.0)
    assert plan(growing, cur, bounds, model, RULES).replicas > steady_plan.replicas


# The settings the queue-bound diagnoses move, each as (diagnosis, settings, window, the move).
MOVES = {
    # the cap binds with the cache cool: raise max_num_seqs
    "cap": (Diagnosis.SCHEDULER_BOUND, CUR, dict(num_running=64.0, kv_usage_mean=0.15, kv_usage_max=0.2),
            "max_num_seqs"),
    # a full cache with the p99 request far below max_model_len: lower it
    "length": (Diagnosis.KV_CACHE_BOUND, CUR, dict(num_running=30.0, kv_usage_mean=0.95, kv_usage_max=0.99,
                                                   request_len_p99=3000.0), "max_model_len"),
    # prompts wait for chunks while TPOT has room: raise the chunk budget
    "chunk": (Diagnosis.HARDWARE_BOUND, replace(CUR, max_num_batched_tokens=1024),
              dict(num_running=20.0, prompt_tokens_per_s=20000.0, generation_tokens_per_s=150.0, tpot_p95_s=0.02),
              "max_num_batched_tokens"),
}


@pytest.mark.parametrize("move", sorted(MOVES))
def test_a_served_backlog_moves_no_setting_either(move):
    # The same class as the replica: a move for a queue that is gone would be verified on a
    # queue that is gone, and its verification would hold everything else (on the day, the
    # chunk budget raised after the burst held six idle replicas for a minute).
    earlier, cur, load, setting = MOVES[move]
    history = past(earlier, earlier)
    t = replace(RULES, cooldown_s=60.0)
    bounds = replace(BOUNDS, max_num_batched_tokens=Range(512, 8192))
    queueing = snap(**load, **QUEUED)
    d = decide(queueing, cur, bounds, history, T0, thresholds=t)
    assert d.diagnosis is earlier and setting in d.change, d.reason
    d = decide(replace(queueing, num_waiting_now=0.0), cur, bounds, history, T0, thresholds=t)
    assert setting not in d.change and "backlog has been served" in d.reason, d.reason


def test_queue_p95_with_nobody_waiting_is_no_queue():
    # Mooncake's conversation trace at a quarter of its rate: queue p95 0.7-1.4 s from a few
    # requests behind long prefills, with nothing waiting on average or now. Read as a queue,
    # every window was HardwareBound, never calm, and the replicas added stayed for an hour.
    cur = replace(CUR, replicas=3)
    few = snap(queue_time_p95_s=1.37, num_waiting=0.0, num_waiting_now=0.0, num_running=3.0)
    d = decide(few, cur, BOUNDS, past(Diagnosis.HARDWARE_BOUND), T0, thresholds=RULES)
    assert d.diagnosis is Diagnosis.HEALTHY and "not a queue" in d.reason, d.reason
    # Half a request or more waiting, on average or now, is a queue as before.
    for waiting in (dict(num_waiting=0.5), dict(num_waiting_now=1.0)):
        d = decide(replace(few, **waiting), cur, BOUNDS, past(Diagnosis.HARDWARE_BOUND), T0, thresholds=RULES)
        assert d.diagnosis is Diagnosis.HARDWARE_BOUND, d.reason
