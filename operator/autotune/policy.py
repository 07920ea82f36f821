"""The autotuner's decision: a pure function of (snapshot, settings, bounds, history,
now) -> Decision with a reason. No I/O, no clock, no globals.

Order of business each interval:
1. a setting outside the spec's bounds is clamped back (always, whatever the data);
2. missing or stale data -> NoData, no decision;
3. the diagnosis, with hysteresis (enter/exit levels chosen by the last diagnosis);
4. the last applied change is verified once a whole window after it is in (verify.py):
   if the signal it targeted got worse, or it cost throughput, the answer is its revert; a
   scale-out that made fewer good requests per replica goes back first (payoff.py);
5. holds: still verifying, pods not yet reporting the settings, cooldown, a window that
   is not all under load (ramp-up); neither that nor a scale-out's verification or cooldown
   holds a smaller chunk for TPOT (chunk.py);
6. speculation that costs more than it earns is turned down first (speculation.py): its drafts
   are compute spent for nothing, and undoing it moves no memory;
7. the rule for the diagnosis (how far each move goes: steps.py), in the order a person
   would diagnose: idle, preemption, length refusals, TPOT over the user's objective,
   then queueing split by what binds (the max_num_seqs cap, a long max_model_len, the
   hardware). With Thresholds.planner (autotune.controller Model) a fitted model of the
   deployment (planner.py, planned.py) sizes replicas and max_num_seqs for TPOT, scheduler, hardware
   and healthy intervals instead of the fixed-ratio steps;
8. when that rule changes nothing, speculation that would earn more is turned up a step;
9. a scale-out for what the window shows adds only the replicas that can pay (payoff.py).
"""

from __future__ import annotations

import math

from .capacity import CapacityPlan
from .chunk import beside_scale_out, chunk_change, room_for_width, tpot_sampled
from .decision import DEFAULT_THRESHOLDS, Action, Bounds, Decision, Diagnosis, Settings, Thresholds
from .forecast import ahead_of_load, holds_capacity
from .history import History
from .memory import PRESSURE, QUEUE_BOUND, blocked_move, broken_width, cap_in_window
from .payoff import Payoff, fleet_unjudged, payoff_of, unpaid_scale_out
from .planned import PLANNED, plan_from_history, planned_change, scale_out_in_cooldown
from .scale_in import scale_in_when_calm, scale_in_when_idle
from .signals import MetricsSnapshot
from .speculation import speculation_change
from .steps import (len_target, lower_seqs, lower_seqs_for_tpot, raise_seqs, round_up, seqs_ceiling,
                    steps_from_running, tpot_blocks_raise)
from .verify import ago, fmt_change, judge_last_change, signal, throughput_baseline, widened_under_verification


def decide(
    snapshot: MetricsSnapshot,
    current: Settings,
    bounds: Bounds,
    history: History,
    now: float,
    *,
    capacity: CapacityPlan | None = None,
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
) -> Decision:
    """The decision for this interval. `capacity` (from plan_capacity at the observed p99
    length) lets a preemption step go straight toward the number of sequences that fit."""
    clamp = bounds.clamp_settings(current)
    no_data = snapshot.no_data_reason()
    if clamp:
        reason = "outside the spec's bounds: " + ", ".join(
            f"{k} {old} -> {new} (bounds [{bounds.of(k).min}, {bounds.of(k).max}])"
            for k, (old, new) in clamp.items())
        diagnosis = Diagnosis.NO_DATA if no_data else _diagnose(snapshot, current, bounds, history, thresholds)[0]
        return Decision(now, diagnosis, Action.CHANGE, reason, change=clamp)
    if no_data:
        return Decision(now, Diagnosis.NO_DATA, Action.HOLD, f"no decision: {no_data}")

    diagnosis, evidence = _diagnose(snapshot, current, bounds, history, thresholds)

    verdict = judge_last_change(snapshot, current, bounds, history, now, thresholds)
    widened = widened_under_verification(history) if verdict.wait and diagnosis is Diagnosis.TPOT_BOUND else None
    urgent = None if widened else _urgent_scale_out(diagnosis, snapshot, current, bounds, history, thresholds)
    payoff = payoff_of(snapshot, current, history, thresholds, queueing=urgent is not None)
    # Replicas a rise seen a period ago will need (forecast.py): they start now, a pod's
    # start-up ahead of it; like a scale-out for a queue, nothing else holds them back.
    ahead = ahead_of_load(snapshot, current, bounds, history, now, thresholds)
    # A smaller chunk for TPOT right after a scale-out, which is not reverted for its signal (chunk.py).
    beside = beside_scale_out(diagnosis, snapshot, current, bounds, history, now, thresholds)
    unpaid = None if payoff.outpaced else unpaid_scale_out(snapshot, current, history, thresholds)
    if unpaid is not None:  # a replica that did not pay goes back whatever else is under way
        (change, why, (good, finished)) = unpaid
        return Decision(now, diagnosis, Action.REVERT, f"{evidence}; {why}", change=change,
                        good_per_replica=good, finished_per_replica=finished)
    if verdict.wait:
        if urgent is not None:  # judging a setting never keeps capacity from a building queue
            return _change(now, snapshot, thresholds, urgent, f"{evidence}; {verdict.wait}, but requests queue",
                           payoff=payoff)
        if ahead is not None:
            return _change(now, snapshot, thresholds, ahead[:3] + (diagnosis,), f"{evidence}; {verdict.wait}",
                           forecast=True)
        if beside is not None:
            return _change(now, snapshot, thresholds, beside,
                           f"{evidence}; {verdict.wait}, but a scale-out is not reverted for its signal")
        undo = f"; {widened} widened each step: it goes back before a replica comes" if widened else ""
        return Decision(now, diagnosis, Action.HOLD, f"{evidence}; {verdict.wait}{undo}")
    if verdict.revert:
        return Decision(now, diagnosis, Action.REVERT, verdict.note, change=verdict.revert,
                        verifies=verdict.verifies, verified=False)
    verifies, verified = verdict.verifies, verdict.verified
    if verdict.note:
        evidence = f"{evidence}; {verdict.note}"

    def hold(reason: str, planned: int | None = None) -> Decision:
        return Decision(now, diagnosis, Action.HOLD, reason, verifies=verifies, verified=verified,
                        planned_replicas=planned)

    live = ("max_num_seqs", "max_model_len") + (
        ("num_speculative_tokens",) if current.num_speculative_tokens is not None else ())
    unconfirmed = [f"{k}={sorted(snapshot.reported(k))} (expected {getattr(current, k)})"
                   for k in live if snapshot.reported(k) and snapshot.reported(k) != {getattr(current, k)}]
    if unconfirmed:
        return hold(f"{evidence}; waiting for the pods to report " + ", ".join(unconfirmed))
    if ahead is not None:
        return _change(now, snapshot, thresholds, ahead[:3] + (diagnosis,), evidence, verifies, verified,
                       forecast=True)
    model_plan, model_note = plan_from_history(snapshot, current, bounds, history, now, thresholds)
    if model_note and diagnosis in PLANNED:
        evidence = f"{evidence}; {model_note}"
    last = history.last_applied()
    if last is not None and now - last.decision.time < thresholds.cooldown_s and not scale_out_in_cooldown(
            diagnosis, current, model_plan, last, now, thresholds):
        left = thresholds.cooldown_s - (now - last.decision.time)
        if urgent is not None and "replicas" not in last.decision.change:
            return _change(now, snapshot, thresholds, urgent, f"{evidence}; cooldown after "
                           f"{fmt_change(last.decision.change)}, but requests queue", verifies, verified,
                           payoff=payoff)
        if beside is not None:
            return _change(now, snapshot, thresholds, beside, f"{evidence}; cooldown after "
                           f"{fmt_change(last.decision.change)}, but a scale-out is not reverted for its signal",
                           verifies, verified)
        return hold(f"{evidence}; cooldown after {fmt_change(last.decision.change)}: {left:.0f}s left")
    planned, proposal = None, None
    if diagnosis in PRESSURE and snapshot.running_min is not None and snapshot.running_min < 0.5:
        # A window that starts idle (load ramping up, or a pause) is no baseline: a change
        # made on it would be judged against a fully loaded window and look like harm. TPOT
        # p95 is per request, so the chunk budget may still move on it (chunk.py).
        if diagnosis is Diagnosis.TPOT_BOUND and tpot_sampled(snapshot, thresholds):
            proposal = chunk_change(diagnosis, snapshot, current, bounds, history, now, thresholds)
        if proposal is None:
            return hold(f"{evidence}; no request was running at some point in the window (load began "
                        f"or paused within it): waiting for a whole window of steady load")
    else:
        proposal = speculation_change(diagnosis, snapshot, current, bounds, history, now, thresholds, -1)
    if proposal is None and diagnosis in PLANNED and model_plan is not None:
        proposal = planned_change(diagnosis, snapshot, current, model_plan, history, now, thresholds)
        if proposal is not None:
            proposal, planned = proposal[:4], proposal[4]
    if proposal is None or not proposal[0]:
        # The chunk budget before the batch width or replicas: a live, cheap move that the
        # fixed-ratio rules would otherwise spend on a narrower batch.
        proposal = chunk_change(diagnosis, snapshot, current, bounds, history, now, thresholds) or proposal
    if proposal is None:
        proposal = _act(diagnosis, snapshot, current, bounds, history, now, capacity, thresholds)
    if proposal is None or not proposal[0]:
        up = speculation_change(diagnosis, snapshot, current, bounds, history, now, thresholds, +1)
        if up is not None:  # the other rule's note (and diagnosis, e.g. HardwareBound) stay
            note = proposal[2] if proposal is not None else ""
            proposal = (up[0], up[1], f"{note}; {up[2]}" if note else up[2],
                        proposal[3] if proposal is not None else up[3])
    if proposal is None:
        return hold(evidence)
    change, target, extra, diagnosis = proposal
    if not change:
        return hold(f"{evidence}; {extra}", planned)
    old, new = change.get("replicas", (0, 0))
    kept = holds_capacity(history, now, thresholds, new) if new < old else None
    if kept:
        return hold(f"{evidence}; {kept}", planned)
    return _change(now, snapshot, thresholds, (change, target, extra, diagnosis), evidence, verifies, verified,
                   planned, payoff=payoff)


# --- diagnosis --------------------------------------------------------------------------

def _diagnose(s: MetricsSnapshot, cur: Settings, bounds: Bounds, history: History,
              t: Thresholds) -> tuple[Diagnosis, str]:
    prev = history.last_diagnosis()
    preempt_level = t.preempt_exit_per_s if prev is Diagnosis.PREEMPTION_BOUND else t.preempt_enter_per_s
    kv = f"KV usage mean {s.kv_usage_mean:.0%} max {s.kv_usage_max:.0%}"
    if s.request_rate_per_s < t.idle_rate_per_s and s.num_running + s.num_waiting < t.idle_inflight:
        return Diagnosis.IDLE, (f"idle: {s.request_rate_per_s:.3f} req/s, "
                                f"{s.num_running + s.num_waiting:.2f} in flight")
    per_request_level = (t.preempt_per_request_exit if prev is Diagnosis.PREEMPTION_BOUND
                         else t.preempt_per_request_enter)
    per_request = s.preemptions_per_request
    if s.preemptions_per_s >= preempt_level and per_request >= per_request_level:
        per = "" if math.isinf(per_request) else f", {per_request:.2f} per finished request"
        return Diagnosis.PREEMPTION_BOUND, (
            f"preemptions {s.preemptions_per_s:.2f}/s{per} (>= {preempt_level:g}/s and "
            f"{per_request_level:g}) with {kv}: the engine recomputes evicted sequences instead of serving")
    refusals = s.length_refusals_per_s or 0.0
    share = refusals / (refusals + (s.request_rate_per_s or 0.0)) if refusals > 0 else 0.0
    if refusals > t.refusal_enter_per_s and share >= t.refusal_enter_share:
        refused = (f"{refusals:.2f} requests/s ({share:.1%} of traffic) refused for length at "
                   f"max_model_len={cur.max_model_len}")
        if cur.max_model_len < bounds.max_model_len.max:
            return Diagnosis.LENGTH_BOUND, refused
        # At its bound there is nothing to raise: the refusals are the traffic's, and the
        # rest of the deployment (its queue, TPOT, capacity) still needs diagnosing.
        diagnosis, evidence = _diagnose_load(s, cur, bounds, history, t)
        return diagnosis, f"{evidence}; {refused} (its bound: nothing to raise)"
    return _diagnose_load(s, cur, bounds, history, t)


def _diagnose_load(s: MetricsSnapshot, cur: Settings, bounds: Bounds, history: History,
                   t: Thresholds) -> tuple[Diagnosis, str]:
    """TPOT, then queueing split by what binds (the rest of _diagnose)."""
    prev = history.last_diagnosis()
    in_queue = prev in QUEUE_BOUND
    queue_level = t.queue_exit_s if in_queue else t.queue_enter_s
    waiting_level = t.waiting_exit if in_queue else t.waiting_enter
    full_level = t.kv_full_exit if prev in (Diagnosis.KV_CACHE_BOUND, Diagnosis.HARDWARE_BOUND) else t.kv_full_enter
    low_level = t.kv_low_exit if prev is Diagnosis.SCHEDULER_BOUND else t.kv_low_enter
    queue_p95 = s.queue_time_p95_s or 0.0
    kv = f"KV usage mean {s.kv_usage_mean:.0%} max {s.kv_usage_max:.0%}"
    queue = f"queue p95 {queue_p95:.2f}s, {s.num_waiting:.1f} waiting"
    objective = t.tpot_objective_s
    if objective is not None and s.tpot_p95_s is not None and s.tpot_p95_s > objective:
        return Diagnosis.TPOT_BOUND, (
            f"TPOT p95 {1000 * s.tpot_p95_s:.0f}ms > the {1000 * objective:.0f}ms objective with "
            f"{s.num_running:.1f} running: each decode step serves too wide a batch")
    queueing = queue_p95 >= queue_level or s.num_waiting >= waiting_level
    if not queueing:
        return Diagnosis.HEALTHY, f"healthy: {queue}, {kv}, {s.preemptions_per_s:.2f} preemptions/s"
    # Queue p95 with under half a request waiting, on average and now: a few requests' waits
    # (behind a long prefill, or a backlog served in the window), not a queue; read as one, it
    # kept a lightly loaded fleet under "pressure" for an hour, and no replica went back.
    if s.num_waiting < t.waiting_exit and s.backlog_served(t.waiting_exit):
        return Diagnosis.HEALTHY, (f"healthy: {queue} on average and {s.num_waiting_now:.0f} now: queue p95 reads "
                                   f"the waits of a few requests, not a queue; {kv}")
    ttft_level = t.ttft_pressure_level(in_queue)
    if ttft_level is not None and queue_p95 < ttft_level:
        return Diagnosis.HEALTHY, (f"healthy: {queue}, a wait under {ttft_level:.2f}s of the {t.ttft_objective_s:g}s "
                                   f"TTFT objective: the queue costs no objective; {kv}")
    # The cap binds only when a pod runs about as many sequences as it allows (the busiest:
    # each pod queues its own): queueing with the cache and the cap both to spare (a burst
    # of prompts waiting for the token budget) is no reason to raise it.
    at_cap = (width := s.batch_width(cur.replicas)) >= t.running_at_cap * cap_in_window(s, cur, history)
    if s.kv_usage_max < low_level and at_cap:
        return Diagnosis.SCHEDULER_BOUND, (
            f"{queue} while {kv} (peak < {low_level:.0%}) and {width:.1f} run on the busiest pod: "
            f"max_num_seqs={cur.max_num_seqs} binds")
    if at_cap and s.kv_usage_mean < t.kv_full_exit:
        return Diagnosis.SCHEDULER_BOUND, (
            f"{queue} while {width:.1f} run on the busiest pod (max_num_seqs={cur.max_num_seqs}) and {kv}: "
            f"the cap binds before the cache does")
    if s.kv_usage_mean >= full_level and len_target(s, cur, bounds, t) is not None:
        return Diagnosis.KV_CACHE_BOUND, (
            f"{queue} with the cache full ({kv}) and p99 request length {s.request_len_p99:.0f} "
            f"far below max_model_len={cur.max_model_len}")
    return Diagnosis.HARDWARE_BOUND, f"{queue} with {kv} and no tuning headroom"


# --- actions ----------------------------------------------------------------------------

def _act(diagnosis: Diagnosis, s: MetricsSnapshot, cur: Settings, bounds: Bounds, history: History,
         now: float, capacity: CapacityPlan | None, t: Thresholds):
    """(change, target signal, sentence, diagnosis) for the diagnosis, or None to hold."""
    if diagnosis is Diagnosis.IDLE:
        return scale_in_when_idle(cur, bounds, history, now, t)
    if diagnosis is Diagnosis.PREEMPTION_BOUND:
        new = lower_seqs(cur, bounds, capacity, t, running := s.running_per_pod(cur.replicas))
        blocked = blocked_move(history, "max_num_seqs", -1, now, t)
        if new is not None and not blocked:
            why = (f" toward the {capacity.max_concurrent_seqs} sequences that fit"
                   if capacity is not None and capacity.max_concurrent_seqs < cur.max_num_seqs else "")
            if steps_from_running(cur.max_num_seqs, capacity, t, running):
                why += (f" (only {running:.1f} run at once per pod: the cache, not max_num_seqs, "
                        f"limits admission, so the step is taken from the running count)")
            return ({"max_num_seqs": (cur.max_num_seqs, new)}, "preemptions_per_s",
                    f"lower max_num_seqs {cur.max_num_seqs} -> {new}{why}", diagnosis)
        note = blocked or f"max_num_seqs already at its minimum {bounds.max_num_seqs.min}"
        queueing = (s.queue_time_p95_s or 0.0) >= t.queue_enter_s or s.num_waiting >= t.waiting_enter
        if not queueing:
            return {}, None, f"{note}; the cache is too small for the load", Diagnosis.HARDWARE_BOUND
        return _scale_out(cur, bounds, history, s, t, note, Diagnosis.HARDWARE_BOUND)
    if diagnosis is Diagnosis.LENGTH_BOUND:
        if cur.max_model_len >= bounds.max_model_len.max:
            return {}, None, f"max_model_len already at its maximum {bounds.max_model_len.max}", diagnosis
        want = max(cur.max_model_len * t.len_increase,
                   (s.request_len_p99 or 0) * t.len_headroom)
        new = bounds.max_model_len.clamp(round_up(want, cur.block_size))
        return ({"max_model_len": (cur.max_model_len, new)}, "length_refusals_per_s",
                f"raise max_model_len {cur.max_model_len} -> {new}", diagnosis)
    if diagnosis is Diagnosis.TPOT_BOUND:
        new = lower_seqs_for_tpot(s, cur, bounds, t)
        blocked = blocked_move(history, "max_num_seqs", -1, now, t)
        if new is not None and not blocked:
            return ({"max_num_seqs": (cur.max_num_seqs, new)}, "tpot_p95_s",
                    f"lower max_num_seqs {cur.max_num_seqs} -> {new} (the batch width scaled "
                    f"to aim at {t.tpot_target_ratio:g} x the objective)", diagnosis)
        note = blocked or f"max_num_seqs cannot go lower usefully (at {cur.max_num_seqs}, bound {bounds.max_num_seqs.min})"
        return _scale_out(cur, bounds, history, s, t, note, Diagnosis.HARDWARE_BOUND, on_queue=False)
    # A queue already served (queue p95 still reads it) is no reason to move a setting for it:
    # the move would be verified on a queue that is gone.
    served = s.backlog_served(t.waiting_exit)
    if diagnosis is Diagnosis.SCHEDULER_BOUND:
        new = raise_seqs(s, cur, bounds, t)
        tpot_block = tpot_blocks_raise(s, cur, t)
        blocked = blocked_move(history, "max_num_seqs", +1, now, t) or tpot_block
        ceiling = broken_width(history, now, t)
        if new is not None and ceiling is not None and new >= ceiling[0]:
            new = ceiling[0] - 1 if ceiling[0] - 1 > cur.max_num_seqs else None
            if new is None and not blocked:
                blocked = (f"max_num_seqs {ceiling[0]} broke the TPOT objective or caused preemptions "
                           f"{ago(now, ceiling[1])}; not raising to it again yet")
        if new is not None and not blocked and not served:
            # Judged by the number waiting, not queue p95: queue time is recorded when a
            # request leaves the queue, so right after a raise the whole backlog is admitted
            # at once and the window's p95 jumps because the change worked.
            return ({"max_num_seqs": (cur.max_num_seqs, new)}, "num_waiting",
                    f"raise max_num_seqs {cur.max_num_seqs} -> {new}", diagnosis)
        if tpot_block and not served and (room := room_for_width(s, cur, bounds, history, now, t, tpot_block)):
            return room  # the chunk's room for a wider batch before a replica (chunk.py)
        # (_scale_out says so when the backlog has been served)
        note = blocked or ("" if served else f"max_num_seqs already at its limit {seqs_ceiling(cur, bounds)}")
        # Too slow per step for a wider batch: the hardware, not the cap, is what binds.
        return _scale_out(cur, bounds, history, s, t, note, Diagnosis.HARDWARE_BOUND if tpot_block else diagnosis)
    if diagnosis is Diagnosis.KV_CACHE_BOUND:
        new = len_target(s, cur, bounds, t)
        blocked = blocked_move(history, "max_model_len", -1, now, t)
        if not blocked and not served:
            target = "queue_time_p95_s" if s.queue_time_p95_s is not None else "num_waiting"
            return ({"max_model_len": (cur.max_model_len, new)}, target,
                    f"lower max_model_len {cur.max_model_len} -> {new} "
                    f"(p99 {s.request_len_p99:.0f} x {t.len_headroom:g}, whole blocks)", diagnosis)
        return _scale_out(cur, bounds, history, s, t, blocked, Diagnosis.HARDWARE_BOUND)
    if diagnosis is Diagnosis.HARDWARE_BOUND:
        return _scale_out(cur, bounds, history, s, t, "", diagnosis)
    if diagnosis is Diagnosis.HEALTHY:
        return scale_in_when_calm(s, cur, bounds, history, now, t)
    return None


def _urgent_scale_out(diagnosis: Diagnosis, s: MetricsSnapshot, cur: Settings, bounds: Bounds, history: History,
                      t: Thresholds):
    """A scale-out for requests queueing (at the enter levels) for scale_out_windows intervals
    while TPOT is over its objective, no setting has headroom left (a narrower batch or smaller
    chunks would only lengthen the queue) or a full cache preempts (a narrower batch stops the
    recompute, not the shortage, and queues requests by itself: they must wait now too). Not
    reverted for its signal, it waits for no verification (but that of a wider step, when TPOT
    breaks: `decide`), nor for a settings change's cooldown."""
    queueing = (s.queue_time_p95_s or 0.0) >= t.queue_enter_s or (s.num_waiting or 0.0) >= t.waiting_enter
    ttft_level = t.ttft_pressure_level(False)  # a queue the TTFT objective absorbs is no emergency
    queueing = queueing and (ttft_level is None or (s.queue_time_p95_s or 0.0) >= ttft_level)
    # A queue draining (fewer waiting now than on average, or next to none: queue p95 still
    # counts a backlog just served) is served by the capacity there is: none on top of it.
    draining = s.num_waiting_now is not None and (s.num_waiting_now < (s.num_waiting or 0.0)
                                                  or s.num_waiting_now < t.waiting_exit)
    short = diagnosis is Diagnosis.PREEMPTION_BOUND and (s.num_waiting_now or 0.0) >= t.waiting_enter
    if (not (short or diagnosis in (Diagnosis.TPOT_BOUND, Diagnosis.HARDWARE_BOUND)) or not queueing or draining
            or (s.pods and len(s.pods) < cur.replicas)):
        return None
    out = _scale_out(cur, bounds, history, s, t, "", diagnosis)
    return out if out[0] else None


def _change(now: float, s: MetricsSnapshot, t: Thresholds, proposal, evidence: str, verifies=None, verified=None,
            planned: int | None = None, forecast: bool = False, payoff: Payoff = Payoff()) -> Decision:
    """The Decision applying a proposal; a settings change keeps output tokens/s to be judged by.
    A scale-out for what the window shows adds only the replicas that can pay, and keeps what
    it is checked against (payoff.py); one a forecast asks for is judged by the load to come."""
    change, target, extra, diagnosis = proposal
    old, new = change.get("replicas", (0, 0))
    before = None
    if new > old and not forecast:
        allowed, note, before = payoff.judge(s, t, old, new)
        if allowed == old:
            return Decision(now, diagnosis, Action.HOLD, f"{evidence}; {extra}{note}",
                            verifies=verifies, verified=verified, planned_replicas=planned)
        change, extra = {**change, "replicas": (old, allowed)}, f"{extra}{note}"
    guarded = target is not None and "replicas" not in change
    return Decision(now, diagnosis, Action.CHANGE, f"{evidence}; {extra}", change=change, target=target,
                    baseline=signal(s, target) if target else None, verifies=verifies, verified=verified,
                    throughput_baseline=throughput_baseline(s, t) if guarded else None, planned_replicas=planned,
                    good_per_replica=before[0] if before else None, finished_per_replica=before[1] if before else None)


def _scale_out(cur: Settings, bounds: Bounds, history: History, s: MetricsSnapshot, t: Thresholds,
               note: str, diagnosis: Diagnosis, *, on_queue: bool = True):
    """A replica once pressure lasts; `on_queue`: the evidence is a queue, still there now."""
    prefix = f"{note}; " if note else ""
    if on_queue and (served := s.backlog_served(t.waiting_exit)):
        # Whether the fleet serves fast enough is for TPOT and the model's plan.
        return {}, None, f"{prefix}{served}, so no replica for it", diagnosis
    if cur.hpa_owns_scale:
        return {}, None, f"{prefix}an HPA owns the replica count, so replicas are left to it", diagnosis
    if cur.replicas >= bounds.replicas.max:
        return {}, None, f"{prefix}replicas already at the maximum {bounds.replicas.max}", diagnosis
    if (unjudged := fleet_unjudged(s, cur, history, t)) is not None:
        return {}, None, f"{prefix}{unjudged}: judging the fleet as it is before adding more", diagnosis
    earlier = history.recent_diagnoses(t.scale_out_windows - 1)
    if len(earlier) < t.scale_out_windows - 1 or any(d not in PRESSURE for d in earlier):
        return {}, None, (f"{prefix}adding a replica once this lasts "
                          f"{t.scale_out_windows} intervals"), diagnosis
    target = "queue_time_p95_s" if s.queue_time_p95_s is not None else "num_waiting"
    return ({"replicas": (cur.replicas, cur.replicas + 1)}, target,
            f"{prefix}add a replica {cur.replicas} -> {cur.replicas + 1}", diagnosis)

