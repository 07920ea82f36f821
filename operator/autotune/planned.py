"""The deployment model's plan (planner.py) turned into the policy's moves, behind the
same safety rules as the fixed-ratio steps: a scale-in waits for calm plans, the width
moves only the way the diagnosis points, a reverted move is not retried."""

from __future__ import annotations

from .decision import Bounds, Diagnosis, Settings, Thresholds
from .history import History, HistoryEntry
from .memory import PRESSURE, blocked_move, cap_in_window
from .planner import Plan, fit, plan
from .signals import Snapshot

# Where the fitted deployment model sizes replicas and batch width; the other diagnoses
# keep their rules (preemption, length refusals, a full cache, idle).
PLANNED = (Diagnosis.TPOT_BOUND, Diagnosis.SCHEDULER_BOUND, Diagnosis.HARDWARE_BOUND, Diagnosis.HEALTHY)


def plan_from_history(s: Snapshot, cur: Settings, bounds: Bounds, history: History, now: float,
                      t: Thresholds) -> Plan | None:
    """This interval's plan, or None (the model is off, not fitted yet, or has no demand)."""
    if not t.planner:
        return None
    model = fit(history, now)
    return plan(s, cur, bounds, model, t) if model is not None else None


def scale_out_in_cooldown(diagnosis: Diagnosis, cur: Settings, p: Plan | None, last: HistoryEntry,
                          now: float, t: Thresholds) -> bool:
    """A planned scale-out may follow an earlier scale-out inside the cooldown once that one's
    replicas had time to start: adding capacity is never reverted, so it needs no verifying
    window, and a burst does not wait."""
    if p is None or diagnosis not in PRESSURE or "replicas" not in last.decision.change:
        return False
    old, new = last.decision.change["replicas"]
    return new > old and now - last.decision.time >= t.scale_out_cooldown_s and p.replicas > cur.replicas


def planned_change(diagnosis: Diagnosis, s: Snapshot, cur: Settings, p: Plan, history: History,
                   now: float, t: Thresholds):
    """(change, target signal, sentence, diagnosis, planned replicas) for the policy."""
    change = {}
    if p.replicas > cur.replicas:
        change["replicas"] = (cur.replicas, p.replicas)
    elif p.replicas < cur.replicas:
        # Scale in only after scale_in_windows calm intervals that all planned fewer, and
        # only as far as the highest of those plans (the HPA's stabilization, shortened).
        calm = history.recent_diagnoses(t.scale_in_windows - 1)
        earlier = history.recent_plans(t.scale_in_windows - 1)
        if (len(calm) == len(earlier) == t.scale_in_windows - 1 and all(d not in PRESSURE for d in calm)
                and all(n < cur.replicas for n in earlier)):
            change["replicas"] = (cur.replicas, max([p.replicas, *earlier]))
    # The width moves only the way the diagnosis points: narrower for TPOT, wider when the
    # cap binds; a healthy deployment keeps its batch (noise is no reason to move it), and
    # a queue is the replica count's to fix (a narrower batch would only lengthen it: TTFT
    # is half the objective too).
    direction = (p.max_num_seqs > cur.max_num_seqs) - (p.max_num_seqs < cur.max_num_seqs)
    serving = len(s.pods) or cur.replicas  # pods reporting: replicas still starting run nothing
    at_cap = s.num_running / serving >= t.running_at_cap * cap_in_window(s, cur, history)
    queueing = (s.queue_time_p95_s or 0.0) >= t.queue_enter_s or s.num_waiting >= t.waiting_enter
    wanted = {-1} if diagnosis is Diagnosis.TPOT_BOUND and not queueing else set()
    if diagnosis in PRESSURE and at_cap and queueing:
        wanted.add(1)  # the cap holds back a queue the plan says the replicas can serve wider
    if direction in wanted and not blocked_move(history, "max_num_seqs", direction, now, t):
        change["max_num_seqs"] = (cur.max_num_seqs, p.max_num_seqs)
    if not change:
        return {}, None, f"plan: hold ({p.reason})", diagnosis, p.replicas
    # A width change alone is verified as the rules' are; one with replicas is not (a
    # scale-out is never reverted, a scale-in has waited for calm plans already).
    target = None
    if "replicas" not in change:
        target = "tpot_p95_s" if change["max_num_seqs"][1] < cur.max_num_seqs else "num_waiting"
    what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in change.items())
    return change, target, f"plan: {what} ({p.reason})", diagnosis, p.replicas
