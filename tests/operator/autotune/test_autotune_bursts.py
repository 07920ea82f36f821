"""Bursty traffic (the Azure code trace: bursts of prompts between idle seconds) and the
user's TTFT objective: TPOT p95 is per request, so a window with a pause in it still moves
the chunk budget; a queue whose wait stays well inside the TTFT objective is no reason for
a replica, and does not keep one that is not needed."""

from __future__ import annotations

from dataclasses import replace

from kvpilot.operator.autotune import Action, Decision, Diagnosis, History, decide
from kvpilot.operator.autotune.decision import Thresholds

from test_autotune_no_harm import BOUNDS, CUR, T0, run_intervals, snap

TPOT = Thresholds(tpot_objective_s=0.05, cooldown_s=60.0)
SLO = Thresholds(tpot_objective_s=0.05, ttft_objective_s=2.0, cooldown_s=60.0)
# A burst of long prompts inside a window that also held idle seconds: the running and
# waiting means are diluted by the pause, TPOT p95 (each request's own) is not.
BURST = dict(running_min=0.0, tpot_p95_s=0.19, tpot_mean_s=0.12, prompt_tokens_per_s=20000.0,
             generation_tokens_per_s=150.0, num_running=9.0, request_rate_per_s=8.0)


def test_a_window_with_a_pause_still_lowers_the_chunk_budget_on_tpot():
    d = decide(snap(**BURST), CUR, BOUNDS, History(), T0, thresholds=TPOT)
    assert d.diagnosis is Diagnosis.TPOT_BOUND and d.action is Action.CHANGE
    assert d.change == {"max_num_batched_tokens": (8192, 2048)} and d.target == "tpot_p95_s"


def test_too_few_requests_in_a_paused_window_hold():
    few = snap(**dict(BURST, request_rate_per_s=0.5))  # 30 requests in the 60 s window
    d = decide(few, CUR, BOUNDS, History(), T0, thresholds=TPOT)
    assert d.action is Action.HOLD and "steady load" in d.reason


def test_a_paused_window_never_narrows_the_batch():
    # Decode-heavy: the TPOT rule would narrow max_num_seqs from the running mean, which the
    # pause dilutes; that waits for a window of steady load.
    decode_heavy = snap(**dict(BURST, prompt_tokens_per_s=500.0, generation_tokens_per_s=3000.0))
    d = decide(decode_heavy, CUR, BOUNDS, History(), T0, thresholds=TPOT)
    assert d.action is Action.HOLD and "steady load" in d.reason
    assert not d.change


def _queued(**kw):
    base = dict(queue_time_p95_s=0.8, num_waiting=20.0, num_waiting_now=28.0, ttft_p95_s=1.9,
                num_running=20.0, running_min=5.0, kv_usage_mean=0.05, kv_usage_max=0.1, tpot_p95_s=0.03,
                prompt_tokens_per_s=500.0, generation_tokens_per_s=3000.0)  # decode-heavy: no chunk move
    base.update(kw)
    return snap(**base)


def test_a_queue_inside_the_ttft_objective_adds_no_replica():
    hardware = Thresholds(tpot_objective_s=0.05, cooldown_s=60.0)
    cur = CUR  # 20 running against max_num_seqs 256: neither setting binds (HardwareBound)
    decisions, after = run_intervals([_queued()] * 4, cur, t=replace(hardware, ttft_objective_s=2.0))
    assert after.replicas == 1 and all(d.diagnosis is Diagnosis.HEALTHY for d in decisions)
    assert "costs no objective" in decisions[0].reason
    # Without the objective the same queue is pressure, and so it is once the wait nears it
    # (TTFT p95 1.9 s above is mostly prefill, which no replica shortens).
    assert run_intervals([_queued()] * 4, cur, t=hardware)[1].replicas > 1
    assert run_intervals([_queued(queue_time_p95_s=1.6)] * 4, cur, t=replace(hardware, ttft_objective_s=2.0))[1].replicas > 1


def test_a_replica_goes_back_when_bursts_queue_inside_the_ttft_objective():
    # Three replicas on bursty traffic: every window holds a short queue (0.6 s p95), well
    # inside the 2 s TTFT objective; two replicas would wait about 0.9 s.
    cur = replace(CUR, replicas=3)
    bursty = snap(queue_time_p95_s=0.6, num_waiting=3.0, num_waiting_now=0.0, ttft_p95_s=0.4, num_running=6.0,
                  tpot_p95_s=0.02)
    decisions, after = run_intervals([bursty] * 10, cur, t=SLO)
    assert after.replicas < 3, [d.reason for d in decisions]
    # Without the objective, the same queue keeps all three.
    assert run_intervals([bursty] * 10, cur, t=TPOT)[1].replicas == 3
    # With a wait of 0.8 s, one fewer replica would put it past half the objective.
    slow = replace(bursty, queue_time_p95_s=0.8)
    decisions, after = run_intervals([slow] * 10, cur, t=SLO)
    assert after.replicas == 3 and "queue p95 0.80s x 1.50" in decisions[-1].reason


def test_a_scale_in_waits_while_requests_wait_now():
    cur = replace(CUR, replicas=2)
    waiting = snap(queue_time_p95_s=0.6, num_waiting=3.0, num_waiting_now=5.0, ttft_p95_s=0.3, num_running=4.0)
    h = History()
    for k in range(5):
        h = h.record(Decision(T0 - 90 + 15 * k, Diagnosis.HEALTHY, Action.HOLD, "calm"), applied=False)
    d = decide(waiting, cur, BOUNDS, h, T0, thresholds=SLO)
    assert "replicas" not in d.change and "5 requests wait now" in d.reason


def test_a_scale_out_just_made_does_not_hold_a_smaller_chunk():
    # The conversation trace at x4: a replica was added 15 s ago for a queue with TPOT over
    # the objective; it is not reverted for its signal, so its verification and cooldown need
    # not hold the smaller chunk that TPOT asks for (the new pod starts a minute later).
    added = Decision(T0 - 15, Diagnosis.TPOT_BOUND, Action.CHANGE, "queue", change={"replicas": (1, 2)},
                     target="queue_time_p95_s", baseline=1.5)
    h = History().record(added, applied=True)
    cur = replace(CUR, replicas=2, max_num_batched_tokens=4096)
    over = snap(tpot_p95_s=0.056, tpot_mean_s=0.04, num_running=255.0, running_min=200.0, prompt_tokens_per_s=20000.0,
                generation_tokens_per_s=4000.0, queue_time_p95_s=1.8, num_waiting=12.0, num_waiting_now=10.0,
                ttft_p95_s=2.3)
    d = decide(over, cur, BOUNDS, h, T0, thresholds=TPOT)
    assert d.change == {"max_num_batched_tokens": (4096, 2048)}, d.reason
    assert "a scale-out is not reverted for its signal" in d.reason
    # A settings change just made still holds the next one for its verification.
    chunk = Decision(T0 - 15, Diagnosis.TPOT_BOUND, Action.CHANGE, "tpot", change={"max_num_batched_tokens": (8192, 4096)},
                     target="tpot_p95_s", baseline=0.06)
    d = decide(replace(over, num_waiting_now=0.0), cur, BOUNDS, History().record(chunk, applied=True), T0, thresholds=TPOT)
    assert d.action is Action.HOLD and "verifying" in d.reason


def test_an_urgent_scale_out_weighs_the_queue_by_the_ttft_objective():
    # The code trace's first minutes: TPOT over the objective from before a chunk change,
    # four requests waiting, and a queue p95 of 0.45 s against a 2 s TTFT objective.
    chunk = Decision(T0 - 30, Diagnosis.TPOT_BOUND, Action.CHANGE, "tpot", change={"max_num_batched_tokens": (4096, 2048)},
                     target="tpot_p95_s", baseline=0.079)
    h = History().record(chunk, applied=True)
    cur = replace(CUR, max_num_batched_tokens=2048)
    queued = snap(**dict(BURST, running_min=2.0, tpot_p95_s=0.09, queue_time_p95_s=0.45, num_waiting=4.0,
                         num_waiting_now=12.0, ttft_p95_s=0.5))
    assert decide(queued, cur, BOUNDS, h, T0, thresholds=TPOT).change == {"replicas": (1, 2)}
    d = decide(queued, cur, BOUNDS, h, T0, thresholds=SLO)
    assert d.action is Action.HOLD and "verifying" in d.reason


def test_tpot_broken_while_a_wider_step_is_verified_is_undone_before_a_replica_is_added():
    # Mooncake's conversation trace at half its rate (30-50 min): the chunk went 1024 -> 2048
    # for a queue of prompt chunks; TPOT p95 is now 64 ms and the queue is still there. The
    # raise is the likely cause, and lowering the chunk again is headroom: no replica yet.
    raised = Decision(T0 - 30, Diagnosis.HARDWARE_BOUND, Action.CHANGE, "queue",
                      change={"max_num_batched_tokens": (1024, 2048)}, target="num_waiting", baseline=2.7)
    cur = replace(CUR, max_num_batched_tokens=2048)
    queued = snap(**dict(BURST, running_min=2.0, tpot_p95_s=0.064, queue_time_p95_s=3.2, num_waiting=2.7,
                         num_waiting_now=7.0, ttft_p95_s=4.8))
    d = decide(queued, cur, BOUNDS, History().record(raised, applied=True), T0, thresholds=SLO)
    assert d.action is Action.HOLD and "replicas" not in d.change, d.reason
    assert "verifying max_num_batched_tokens 1024 -> 2048" in d.reason
    assert "widened each step: it goes back before a replica comes" in d.reason
    # Its window in, the chunk goes back down, still without a replica.
    later = decide(queued, cur, BOUNDS, History().record(replace(raised, time=T0 - 60), applied=True), T0,
                   thresholds=SLO)
    assert later.change == {"max_num_batched_tokens": (2048, 1024)}, later.reason
    # A wider batch is the same; a narrower chunk under verification did not break TPOT, and
    # the queue gets its replica without waiting for the verdict.
    seqs = replace(raised, change={"max_num_seqs": (64, 128)})
    d = decide(queued, replace(cur, max_num_seqs=128), BOUNDS, History().record(seqs, applied=True), T0,
               thresholds=SLO)
    assert "replicas" not in d.change, d.reason
    lowered = replace(raised, change={"max_num_batched_tokens": (4096, 2048)}, target="tpot_p95_s", baseline=0.08)
    d = decide(queued, cur, BOUNDS, History().record(lowered, applied=True), T0, thresholds=SLO)
    assert d.change == {"replicas": (1, 2)}, d.reason


def test_an_idle_lull_between_bursts_does_not_repeat_a_scale_in_that_failed():
    # The code trace at x2: a scale-in to one replica in a lull, a scale-out for the next
    # burst; the next idle stretch must not take the replica away again within 10 minutes.
    cur = replace(CUR, replicas=2)
    h = History()
    h = h.record(Decision(T0 - 200, Diagnosis.HEALTHY, Action.CHANGE, "calm", change={"replicas": (2, 1)}), applied=True)
    h = h.record(Decision(T0 - 110, Diagnosis.HARDWARE_BOUND, Action.CHANGE, "queue", change={"replicas": (1, 2)}),
                 applied=True)
    idle = dict(request_rate_per_s=0.0, num_running=0.0, num_waiting=0.0, num_waiting_now=0.0,
                queue_time_p95_s=None, tpot_p95_s=None, kv_usage_mean=0.0, kv_usage_max=0.0, running_min=0.0)
    for k in range(2):
        h = h.record(Decision(T0 - 30 + 15 * k, Diagnosis.IDLE, Action.HOLD, "idle"), applied=False)
    d = decide(snap(**idle), cur, BOUNDS, h, T0, thresholds=SLO)
    assert d.diagnosis is Diagnosis.IDLE and "replicas" not in d.change
    assert "not going to 1 again yet" in d.reason
    later = decide(snap(t=T0 + 600, **idle), cur, BOUNDS, h, T0 + 600, thresholds=SLO)
    assert later.change == {"replicas": (2, 1)}


def test_a_smaller_chunk_is_not_reverted_for_tpot_that_more_load_raised():
    # Mooncake, 20-30 min: the chunk went 8192 -> 4096 with requests waiting; a window later
    # TPOT p95 is higher, but output rose by half with requests still waiting: the load
    # grew (a second replica came up and more arrived), which says nothing against the chunk.
    t = TPOT
    cur = replace(CUR, replicas=2, max_num_batched_tokens=8192)
    before = snap(tpot_p95_s=0.054, tpot_mean_s=0.04, num_running=42.0, running_min=20.0, prompt_tokens_per_s=20000.0,
                  generation_tokens_per_s=1000.0, queue_time_p95_s=3.0, num_waiting=12.0, num_waiting_now=12.0)
    lowered = decide(before, cur, BOUNDS, History(), T0, thresholds=t)
    assert lowered.change == {"max_num_batched_tokens": (8192, 4096)}
    assert lowered.throughput_baseline == 1000.0  # it measures more load apart from harm
    h = History().record(lowered, applied=True)
    cur = replace(cur, max_num_batched_tokens=4096)
    busier = replace(before, time=T0 + 150, tpot_p95_s=0.0715, generation_tokens_per_s=1500.0)
    d = decide(busier, cur, BOUNDS, h, T0 + 150, thresholds=t)
    assert d.action is not Action.REVERT and "more load, not the change" in d.reason, d.reason
    # The same TPOT with output flat is the change's doing: reverted.
    flat = replace(busier, generation_tokens_per_s=1000.0)
    assert decide(flat, cur, BOUNDS, h, T0 + 150, thresholds=t).action is Action.REVERT
    # Output down with TPOT better is the trade a chunk change is for: kept.
    traded = replace(busier, tpot_p95_s=0.04, generation_tokens_per_s=700.0)
    assert decide(traded, cur, BOUNDS, h, T0 + 150, thresholds=t).action is not Action.REVERT
