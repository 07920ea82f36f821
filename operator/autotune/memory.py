"""The autotuner's memory of its earlier moves, read from History: which widths broke
an objective, which moves were just reverted, what cap was in effect during a window.
Shared by the rules (policy.py) and the model's moves (planned.py)."""

from __future__ import annotations

from .decision import Action, Diagnosis, Settings, Thresholds
from .history import History
from .signals import MetricsSnapshot
from .verify import ago

QUEUE_BOUND = (Diagnosis.SCHEDULER_BOUND, Diagnosis.KV_CACHE_BOUND, Diagnosis.HARDWARE_BOUND)
PRESSURE = QUEUE_BOUND + (Diagnosis.PREEMPTION_BOUND, Diagnosis.TPOT_BOUND)


def broken_width(history: History, now: float, t: Thresholds) -> tuple[int, float] | None:
    """(max_num_seqs, time): the smallest value the autotuner had to lower max_num_seqs from,
    for TPOT or preemptions, within flip_backoff_s. Raises stay below it: measured noise
    must not walk the batch back up to a width that was already seen to fail."""
    worst = None
    for entry in history.applied_since(now - t.flip_backoff_s):
        d = entry.decision
        if "max_num_seqs" not in d.change or d.diagnosis not in (Diagnosis.TPOT_BOUND, Diagnosis.PREEMPTION_BOUND):
            continue
        old, new = d.change["max_num_seqs"]
        if new < old and (worst is None or old <= worst[0]):
            worst = (old, d.time)
    return worst


def blocked_move(history: History, setting: str, direction: int, now: float, t: Thresholds) -> str | None:
    """Why moving `setting` in `direction` is not allowed now: it would retry a move that
    was just reverted, lower max_model_len right after it was raised for refusals, or raise
    num_speculative_tokens right after it was lowered (a load that swings around the point
    where drafts stop paying must not flip K every cooldown)."""
    for entry in reversed(history.applied_since(now - t.flip_backoff_s)):
        d = entry.decision
        if setting not in d.change:
            continue
        old, new = d.change[setting]
        moved = (new > old) - (new < old)
        if d.action is Action.REVERT and moved == -direction:
            return f"{setting} was reverted {ago(now, d.time)}; not retrying that move yet"
        if setting == "max_model_len" and direction < 0 and moved > 0:
            return f"max_model_len was raised {ago(now, d.time)}; not lowering it again yet"
        if setting == "max_num_batched_tokens" and direction > 0 and moved < 0:
            return f"max_num_batched_tokens was lowered {ago(now, d.time)}; not raising it again yet"
        if setting == "num_speculative_tokens" and direction > 0 and moved < 0:
            return f"num_speculative_tokens was lowered {ago(now, d.time)}; not raising it again yet"
    return None



def cap_in_window(s: MetricsSnapshot, cur: Settings, history: History) -> int:
    """The lowest max_num_seqs in effect during the window: right after a raise, the
    window's mean running count still reflects the old cap."""
    last = history.last_applied()
    if last is not None and s.time - last.decision.time < s.window_s and "max_num_seqs" in last.decision.change:
        return min(cur.max_num_seqs, *last.decision.change["max_num_seqs"])
    return cur.max_num_seqs
