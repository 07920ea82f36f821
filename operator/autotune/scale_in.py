"""Capacity comes back when demand falls, by rule, without the deployment model. After
`idle_windows` idle intervals one replica goes (never to zero by this rule). Otherwise the fewest
replicas that would carry the load, in one move, once the deployment has been calm for as
long as a replica was seen to take to start (`calm_needed`: the stabilization, as the HPA's,
whose default policy also goes to its recommendation at once) and the load of the replicas
left would still sit well inside every limit it shows today.

The projection is the plain share: with R replicas serving, R - k carry R / (R - k) of
each pod's running sequences, KV cache and prompt tokens, and TPOT p95 is projected to grow
in proportion too (it must stay under `scale_in_tpot_ratio` x the objective); a fitted
deployment model whose windows determine its terms, trusted or not, may veto the move where
it projects TPOT higher (never make it: vetoing costs a GPU for a while, a wrong scale-in a
backlog). A scale-in that the load then
contradicts (a scale-out for pressure soon after) is not repeated for `flip_backoff_s`,
and a replica added for pressure stays while the load is above `scale_in_load_margin` x
the load the smaller fleet was short of: the hysteresis holds a needed replica, and a
mistaken one goes within minutes of the load falling (or at once, if it was never needed)."""

from __future__ import annotations

import math

from .decision import Bounds, Diagnosis, Settings, Thresholds
from .history import History
from .memory import PRESSURE
from .planner import _p95_after, fit
from .signals import MetricsSnapshot
from .verify import ago

CALM = (Diagnosis.HEALTHY, Diagnosis.IDLE)


def calm_needed(history: History, window_s: float, t: Thresholds) -> tuple[int, str]:
    """(the calm intervals a scale-in waits for, why that many). A replica given back and
    needed again costs a start-up of missing capacity; holding one that is not needed costs
    its GPU. Waiting as long as getting it back takes is the ski-rental rule: counting a
    second of a replica idle as dear as a second of one missing, it never costs more than
    twice the best wait in hindsight, whatever the load does next. So the calm
    intervals cover a replica's start-up as seen here (`History.startup_s`: a minute in the
    simulator, minutes on GPUs that load a model), at least `scale_in_min_windows` (one
    window's calm is no trend) and at most the intervals the history keeps;
    `scale_in_windows` until a start-up has been seen."""
    if history.startup_s is None or len(history.diagnoses) < 2:
        return t.scale_in_windows, ""
    interval = max(history.diagnoses[-1][0] - history.diagnoses[-2][0], 1.0)
    # n calm intervals see (n - 1) x interval + window_s seconds of calm
    cover = 1 + math.ceil(max(history.startup_s - window_s, 0.0) / interval)
    n = min(max(t.scale_in_min_windows, cover), history.limit)
    return n, f" (a replica took {history.startup_s:.0f}s to start here)"


def flipped(history: History, now: float, t: Thresholds, target: int) -> str | None:
    """Why scaling in to `target` replicas is not allowed now: a scale-in to that many or
    fewer was followed by a scale-out for pressure within flip_backoff_s (so few were seen
    to fall short; more may still go)."""
    recent = history.applied_since(now - t.flip_backoff_s)
    for k, entry in enumerate(recent):
        old, new = entry.decision.change.get("replicas", (0, 0))
        if new >= old or new < target:
            continue
        for later in recent[k + 1:]:
            o, n = later.decision.change.get("replicas", (0, 0))
            if n > o and later.decision.diagnosis in PRESSURE:
                return (f"a scale-in to {new} {ago(now, entry.decision.time)} was followed by a scale-out for "
                        f"{later.decision.diagnosis.value}; not going to {target} again yet")
    return None


def load_when_added(history: History, replicas: int, now: float, t: Thresholds) -> tuple[float, float] | None:
    """(prompt tokens/s, running sequences), deployment-wide, that `replicas - 1` replicas
    were under pressure at when the last scale-out to `replicas` was made for it (within
    scale_in_memory_s), from the model's observations; None when there is none."""
    for entry in reversed(history.applied_since(now - t.scale_in_memory_s)):
        d = entry.decision
        old, new = d.change.get("replicas", (0, 0))
        if not old < replicas <= new or d.diagnosis not in PRESSURE:
            continue
        before = [o for o in history.observations if o.time <= d.time]
        if before:
            o = before[-1]
            return o.prompt_tokens_per_s * old, o.running * old
    return None


def scale_in_when_calm(s: MetricsSnapshot, cur: Settings, bounds: Bounds, history: History, now: float,
                       t: Thresholds):
    """(change, target, sentence, diagnosis) removing replicas, an explanation of why not
    yet ({} change), or None when there is nothing to remove. Several go at once when the
    load would sit inside every limit with that many fewer (a burst's replicas come back in
    one step, not one a cooldown)."""
    floor = max(bounds.replicas.min, 1)
    if cur.replicas <= floor or cur.hpa_owns_scale:
        return None
    serving = s.serving(cur.replicas)
    if serving < cur.replicas:
        return {}, None, "replicas are still starting: no scale-in", Diagnosis.HEALTHY
    windows, why = calm_needed(history, s.window_s, t)
    earlier = history.recent_diagnoses(windows - 1)
    if len(earlier) < windows - 1 or any(d not in CALM for d in earlier):
        return {}, None, f"removing a replica once calm for {windows} intervals{why}", Diagnosis.HEALTHY
    # A fitted model too uncertain to size capacity may still veto giving it back: its TPOT
    # with fewer replicas grows with the prompt load's share of each step.
    model = fit(history, now) if len(history.observations) >= 3 else None
    lowest = floor
    for target in range(lowest, cur.replicas):  # the fewest replicas that carry the load
        if not limits_at(s, cur, history, now, t, target, serving, model):
            k = cur.replicas / target
            running = (s.num_running or 0.0) / serving * k
            return ({"replicas": (cur.replicas, target)}, None,
                    f"remove {'a replica' if target == cur.replicas - 1 else 'replicas'} {cur.replicas} -> {target}: "
                    f"calm for {windows} intervals{why}, and {target} would carry {running:.1f} running each, "
                    f"KV peak ~{(s.kv_usage_max or 0) * k:.0%}", Diagnosis.HEALTHY)
    limits = limits_at(s, cur, history, now, t, cur.replicas - 1, serving, model)
    return {}, None, "keeping the replicas: with one fewer " + "; ".join(limits), Diagnosis.HEALTHY


def limits_at(s: MetricsSnapshot, cur: Settings, history: History, now: float, t: Thresholds, target: int,
              serving: int, model) -> list[str]:
    """What would break with `target` replicas instead of cur.replicas ([] when nothing)."""
    blocked = flipped(history, now, t, target)
    if blocked:
        return [blocked]
    k = cur.replicas / target
    limits = []
    # Hysteresis on demand: a replica added because the smaller fleet was under pressure
    # goes only once the load is well below what that fleet could not carry.
    for r in range(cur.replicas, target, -1):
        added_at = load_when_added(history, r, now, t)
        if added_at is not None:
            prompt0, running0 = added_at
            m = t.scale_in_load_margin
            if (s.prompt_tokens_per_s or 0.0) > m * prompt0 or (s.num_running or 0.0) > m * running0:
                limits.append(f"the load ({s.prompt_tokens_per_s or 0:.0f} prompt tok/s, {s.num_running or 0:.0f} "
                              f"running) is above {m:g} x what {r - 1} replica(s) were short of ({prompt0:.0f}, "
                              f"{running0:.0f})")
                break
    if (s.kv_usage_max or 0.0) * k > t.kv_low_exit:
        limits.append(f"KV usage peak {s.kv_usage_max:.0%} x {k:.2f} > {t.kv_low_exit:.0%}")
    running = (s.num_running or 0.0) / serving * k
    if running > t.scale_in_load * t.running_at_cap * cur.max_num_seqs:
        limits.append(f"{running:.1f} running per replica would near max_num_seqs={cur.max_num_seqs}")
    # TPOT projected in proportion to the load (steps carry k x the prompt chunks and
    # sequences): an over-estimate at light load, where a replica is most likely spare.
    if t.tpot_objective_s is not None and (s.tpot_p95_s or 0.0) * k > t.scale_in_tpot_ratio * t.tpot_objective_s:
        limits.append(f"TPOT p95 {1000 * s.tpot_p95_s:.0f}ms x {k:.2f} > {t.scale_in_tpot_ratio:g} x the objective")
    if t.ttft_objective_s is not None:
        # The queue measured by what it costs the first token, grown with the load (queueing
        # grows faster than that near saturation, hence the margin), and nothing waiting now.
        wait = s.queue_time_p95_s or 0.0
        if wait * k > t.ttft_scale_in_ratio * t.ttft_objective_s:
            limits.append(f"queue p95 {wait:.2f}s x {k:.2f} > {t.ttft_scale_in_ratio:g} x the "
                          f"{t.ttft_objective_s:g}s TTFT objective")
        if (s.num_waiting_now or 0.0) >= t.waiting_enter:
            limits.append(f"{s.num_waiting_now:.0f} requests wait now")
    elif (s.queue_time_p95_s or 0.0) >= t.queue_exit_s or (s.num_waiting or 0.0) >= t.waiting_exit:
        limits.append("requests queue")
    if model is not None and model.cov is not None and t.tpot_objective_s is not None:
        after = _p95_after(s, cur, target, model)
        if after > t.scale_in_tpot_ratio * t.tpot_objective_s:
            limits.append(f"the fitted model puts TPOT p95 at ~{1000 * after:.0f}ms")
    return limits


def scale_in_when_idle(cur: Settings, bounds: Bounds, history: History, now: float, t: Thresholds):
    """(change, target, sentence, diagnosis) removing one replica after idle_windows idle
    intervals, an explanation of why not yet ({} change), or None at the floor."""
    floor = max(bounds.replicas.min, 1)  # at zero pods nothing reports load to scale back up
    if cur.replicas <= floor:
        return None
    if cur.hpa_owns_scale:
        return {}, None, "an HPA owns the replica count, so replicas are left to it", Diagnosis.IDLE
    earlier = history.recent_diagnoses(t.idle_windows - 1)
    if len(earlier) < t.idle_windows - 1 or any(d is not Diagnosis.IDLE for d in earlier):
        return {}, None, f"removing a replica once idle for {t.idle_windows} intervals", Diagnosis.IDLE
    if blocked := flipped(history, now, t, cur.replicas - 1):  # a lull between bursts, seen before
        return {}, None, blocked, Diagnosis.IDLE
    return ({"replicas": (cur.replicas, cur.replicas - 1)}, None,
            f"remove a replica {cur.replicas} -> {cur.replicas - 1}", Diagnosis.IDLE)
