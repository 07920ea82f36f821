"""Verification of the autotuner's last applied change, once a whole metrics window after
it is in: did the signal it targeted get worse, did it cost throughput, did a raise of
max_num_seqs bring preemptions? Pure, like the policy that calls it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .decision import Bounds, Settings, Thresholds
from .history import History
from .signals import MetricsSnapshot


@dataclass(frozen=True)
class Verdict:
    """What the policy learns about its last change this interval."""

    verifies: float | None = None  # time of the change judged (None: nothing judged)
    verified: bool | None = None  # True kept, False got worse, None inconclusive
    wait: str | None = None  # still inside its verification window: hold, saying this
    revert: dict = field(default_factory=dict)  # setting -> (now, back): undo it
    note: str = ""  # the judgement, for the reason


def judge_last_change(s: MetricsSnapshot, cur: Settings, bounds: Bounds, history: History, now: float,
                      t: Thresholds) -> Verdict:
    pending = history.pending_verification()
    if pending is None:
        return Verdict()
    d = pending.decision
    settle = settle_time(s)
    if s.time - s.window_s < d.time + settle:
        wait = d.time + settle + s.window_s - s.time
        after = f" and {settle:.0f}s for the requests it found in flight to finish" if settle >= 1 else ""
        return Verdict(wait=f"verifying {fmt_change(d.change)} of {ago(now, d.time)}: "
                            f"a full window after it{after} in {wait:.0f}s")
    value = signal(s, d.target)
    judged = f"{d.target} {fmt(d.target, d.baseline)} -> {fmt(d.target, value)} after {fmt_change(d.change)}"
    problems, notes = [], []
    worse_rel = t.spec_worse_rel if "num_speculative_tokens" in d.change else t.worse_rel
    if value > d.baseline * (1 + worse_rel) + t.worse_abs.get(d.target, 0.0):
        gained = _throughput_gained(s, d.throughput_baseline, t)
        if gained:  # an open-loop overload: the backlog grows whatever the setting does
            notes.append(f"{judged}, but {gained}: more load, not the change")
        else:
            problems.append(f"{judged} got worse")
    # Trading throughput for TPOT is what a change aimed at TPOT is for; its baseline only
    # tells more load (output up with requests waiting) from harm.
    lost = None if d.target == "tpot_p95_s" else _throughput_lost(s, d.throughput_baseline, t)
    if lost:
        problems.append(f"{lost} after {fmt_change(d.change)}")
    raised = d.change.get("max_num_seqs")
    if raised and raised[1] > raised[0] and _preempting(s, t):
        problems.append(f"preemptions rose to {s.preemptions_per_s:.2f}/s after {fmt_change(d.change)}")

    undo = {k: (new, old) for k, (old, new) in d.change.items()
            if getattr(cur, k) == new and (k != "replicas" or t.revert_replicas)}
    undo = {k: (a, bounds.of(k).clamp(b)) for k, (a, b) in undo.items() if a != bounds.of(k).clamp(b)}
    if problems and undo and not (cur.hpa_owns_scale and "replicas" in undo):
        return Verdict(d.time, False, revert=undo,
                       note=f"verification failed: {'; '.join(problems)}; reverting {fmt_change(undo)}")
    still_in = all(getattr(cur, k) == new for k, (_, new) in d.change.items())
    verified = (not problems) if still_in else None
    if problems:
        return Verdict(d.time, verified, note=f"verification: {'; '.join(problems)} (not reverted)")
    return Verdict(d.time, verified, note=f"verified: {notes[0] if notes else judged}" if verified else "")


def widened_under_verification(history: History) -> str | None:
    """The change still under verification that widened each engine step (a larger chunk
    budget or batch), named; None if there is none. TPOT broken inside its window is the
    change's doing until shown otherwise, and undoing it is headroom (policy's urgent scale-out)."""
    pending = history.pending_verification()
    if pending is None:
        return None
    change = pending.decision.change
    wider = [k for k in ("max_num_batched_tokens", "max_num_seqs") if k in change and change[k][1] > change[k][0]]
    return fmt_change({k: change[k] for k in wider}) if wider else None


def settle_time(s: MetricsSnapshot) -> float:
    """How long after a change its window must start. Latencies (TPOT, queue time) are
    observed when a request finishes, so for a while after a change the histograms still
    fill with requests that ran mostly before it. Twice the mean request latency covers
    most of them; at most one window; 0 when the latency is unknown."""
    if not s.request_latency_mean_s:
        return 0.0
    return min(s.window_s, 2 * s.request_latency_mean_s)


def throughput_baseline(s: MetricsSnapshot, t: Thresholds) -> float | None:
    """Output tokens/s to guard a change with, when they measure capacity: only while
    requests wait (otherwise tokens/s follow the offered load, not the settings)."""
    if s.generation_tokens_per_s is None or s.generation_tokens_per_s <= 0:
        return None
    return s.generation_tokens_per_s if s.num_waiting >= t.waiting_exit else None


def _throughput_ratio(s: MetricsSnapshot, baseline: float | None, t: Thresholds) -> float | None:
    """Output tokens/s now over the baseline, judged only while requests still wait: with
    an empty queue tokens/s follow the offered load, not the settings."""
    if baseline is None or s.generation_tokens_per_s is None or s.num_waiting < t.waiting_exit:
        return None
    return s.generation_tokens_per_s / baseline


def _throughput_lost(s: MetricsSnapshot, baseline: float | None, t: Thresholds) -> str | None:
    ratio = _throughput_ratio(s, baseline, t)
    if ratio is None or ratio >= 1 - t.throughput_drop_rel:
        return None
    return (f"output fell {baseline:.0f} -> {s.generation_tokens_per_s:.0f} tokens/s (-{1 - ratio:.0%}, "
            f"more than {t.throughput_drop_rel:.0%}) with requests still waiting")


def _throughput_gained(s: MetricsSnapshot, baseline: float | None, t: Thresholds) -> str | None:
    """Output tokens/s rose by more than throughput_gain_rel while requests still wait."""
    ratio = _throughput_ratio(s, baseline, t)
    if ratio is None or ratio <= 1 + t.throughput_gain_rel:
        return None
    return f"output rose {baseline:.0f} -> {s.generation_tokens_per_s:.0f} tokens/s with requests waiting"


def _preempting(s: MetricsSnapshot, t: Thresholds) -> bool:
    return (s.preemptions_per_s >= t.preempt_enter_per_s
            and s.preemptions_per_request >= t.preempt_per_request_enter)


# --- formatting shared with the policy ----------------------------------------------------

def signal(s: MetricsSnapshot, name: str) -> float:
    v = getattr(s, name)
    return 0.0 if v is None else float(v)  # an empty quantile means nothing waited


def fmt(name: str, v: float) -> str:
    if name.startswith("tpot"):  # tens of milliseconds: seconds to two places would hide a change
        return f"{1000 * v:.1f}ms"
    if name.endswith("_s") and not name.endswith("per_s"):
        return f"{v:.2f}s"
    if name.endswith("per_s"):
        return f"{v:.2f}/s"
    return f"{v:.1f}"


def fmt_change(change: dict) -> str:
    return ", ".join(f"{k} {a} -> {b}" for k, (a, b) in change.items())


def ago(now: float, then: float) -> str:
    return f"{now - then:.0f}s ago"
