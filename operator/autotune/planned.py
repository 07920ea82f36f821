"""The deployment model's plan (planner.py) turned into the policy's moves, behind the
same safety rules as the fixed-ratio steps: a scale-in waits for calm plans, the width
moves only the way the diagnosis points, a reverted move is not retried."""

from __future__ import annotations

import math

from .decision import Bounds, Diagnosis, Settings, Thresholds
from .history import History, HistoryEntry
from .memory import PRESSURE, blocked_move, cap_in_window
from .planner import Plan, StepModel, fit, plan
from .scale_in import calm_needed
from .signals import MetricsSnapshot

# Where the fitted deployment model sizes replicas and batch width; the other diagnoses
# keep their rules (preemption, length refusals, a full cache, idle).
PLANNED = (Diagnosis.TPOT_BOUND, Diagnosis.SCHEDULER_BOUND, Diagnosis.HARDWARE_BOUND, Diagnosis.HEALTHY)


def plan_from_history(s: MetricsSnapshot, cur: Settings, bounds: Bounds, history: History, now: float,
                      t: Thresholds) -> tuple[Plan | None, str]:
    """(this interval's plan, or None when the rules decide instead; why the model is not
    used, or ""). The model drives only once it is supported by enough windows, fits them,
    agrees with the TPOT the deployment shows now, and is certain where it plans to go."""
    if not t.planner:
        return None, ""
    model = fit(history, now)
    if model is None:
        return None, ""
    why_not = distrust(model, s, cur, t)
    p = plan(s, cur, bounds, model, t) if not why_not else None
    if p is not None and p.replicas != cur.replicas and not p.uncertainty <= t.model_max_uncertainty:
        err = f"+/-{100 * p.uncertainty:.0f}%" if p.uncertainty < math.inf else "unknown"
        why_not = (f"its TPOT at the {p.replicas} replicas it plans is uncertain ({err} > "
                   f"{100 * t.model_max_uncertainty:.0f}%)")
        p = None
    if why_not:
        return None, f"rules decide: the model ({model}) {why_not}"
    return p, ""


def distrust(model: StepModel, s: MetricsSnapshot, cur: Settings, t: Thresholds | None = None) -> str:
    """Why the fitted model must not size capacity yet ("" when it may)."""
    t = t or Thresholds()
    if model.windows < t.model_min_windows:
        return f"is fitted on {model.windows} windows (< {t.model_min_windows})"
    if model.cov is None:
        return "has windows too alike to tell its three terms apart"
    if model.residual > t.model_max_residual:
        return f"fits its own windows only to +/-{100 * model.residual:.0f}%"
    pods = s.serving(cur.replicas)
    if s.tpot_mean_s and s.num_running and s.prompt_tokens_per_s is not None and pods:
        predicted = model.tpot(s.num_running / pods, s.prompt_tokens_per_s / pods)
        if not abs(predicted / s.tpot_mean_s - 1.0) <= t.model_max_disagreement:
            return (f"predicts a mean TPOT of {1000 * predicted:.1f}ms where the deployment shows "
                    f"{1000 * s.tpot_mean_s:.1f}ms")
    return ""


def scale_out_in_cooldown(diagnosis: Diagnosis, cur: Settings, p: Plan | None, last: HistoryEntry,
                          now: float, t: Thresholds) -> bool:
    """A planned scale-out may follow an earlier scale-out inside the cooldown once that one's
    replicas had time to start: adding capacity is not reverted for its signal, so it needs no
    verifying window, and a burst does not wait."""
    if p is None or diagnosis not in PRESSURE or "replicas" not in last.decision.change:
        return False
    old, new = last.decision.change["replicas"]
    return new > old and now - last.decision.time >= t.scale_out_cooldown_s and p.replicas > cur.replicas


def planned_change(diagnosis: Diagnosis, s: MetricsSnapshot, cur: Settings, p: Plan, history: History,
                   now: float, t: Thresholds):
    """(change, target signal, sentence, diagnosis, planned replicas) for the policy."""
    change, note = {}, ""
    if p.replicas > cur.replicas and diagnosis is Diagnosis.HEALTHY:
        # The deployment carries its load within the objectives now; a model that says it
        # cannot disagrees with what the deployment shows, and a replica is no test of that.
        note = f"the plan's {p.replicas} replicas wait for pressure (the deployment is healthy at {cur.replicas}); "
    elif p.replicas > cur.replicas:
        change["replicas"] = (cur.replicas, p.replicas)
    elif p.replicas < cur.replicas:
        # Scale in only after calm intervals covering a replica's start-up (calm_needed) that
        # all planned fewer, and only as far as the highest of those plans.
        windows = calm_needed(history, s.window_s, t)[0]
        calm = history.recent_diagnoses(windows - 1)
        earlier = history.recent_plans(windows - 1)
        if (len(calm) == len(earlier) == windows - 1 and all(d not in PRESSURE for d in calm)
                and all(n < cur.replicas for n in earlier)):
            change["replicas"] = (cur.replicas, max([p.replicas, *earlier]))
    # The width moves only the way the diagnosis points: narrower for TPOT, wider when the
    # cap binds; a healthy deployment keeps its batch (noise is no reason to move it), and
    # a queue is the replica count's to fix (a narrower batch would only lengthen it: TTFT
    # is half the objective too).
    direction = (p.max_num_seqs > cur.max_num_seqs) - (p.max_num_seqs < cur.max_num_seqs)
    at_cap = s.batch_width(cur.replicas) >= t.running_at_cap * cap_in_window(s, cur, history)
    queueing = (s.queue_time_p95_s or 0.0) >= t.queue_enter_s or s.num_waiting >= t.waiting_enter
    wanted = {-1} if diagnosis is Diagnosis.TPOT_BOUND and not queueing else set()
    if diagnosis in PRESSURE and at_cap and queueing and not s.backlog_served(t.waiting_exit):
        wanted.add(1)  # the cap holds back a queue the plan says the replicas can serve wider
    if direction in wanted and not blocked_move(history, "max_num_seqs", direction, now, t):
        change["max_num_seqs"] = (cur.max_num_seqs, p.max_num_seqs)
    if not change:
        return {}, None, f"plan: hold ({note}{p.reason})", diagnosis, p.replicas
    # A width change alone is verified as the rules' are; one with replicas is not (a
    # scale-out is not reverted for its signal, a scale-in has waited for calm plans already).
    target = None
    if "replicas" not in change:
        target = "tpot_p95_s" if change["max_num_seqs"][1] < cur.max_num_seqs else "num_waiting"
    what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in change.items())
    return change, target, f"plan: {what} ({p.reason})", diagnosis, p.replicas
