"""How far one move goes: the new max_num_seqs or max_model_len for a diagnosis, bounded
per step and by the spec's bounds. Pure arithmetic on a MetricsSnapshot; the policy decides
whether to move at all."""

from __future__ import annotations

import math

from .capacity import CapacityPlan
from .decision import Bounds, Settings, Thresholds
from .signals import MetricsSnapshot


def preemption_step(width: int, capacity: CapacityPlan | None, t: Thresholds) -> int:
    """width x seq_decrease, or toward the capacity bound, but never below width x seq_max_decrease."""
    new = math.floor(width * t.seq_decrease)
    if capacity is not None and capacity.max_concurrent_seqs < new:
        new = max(capacity.max_concurrent_seqs, math.floor(width * t.seq_max_decrease))
    return new


def steps_from_running(n: int, capacity: CapacityPlan | None, t: Thresholds, running: float | None) -> bool:
    """Whether no more sequences run (mean over the window) than a step from the cap would
    leave: the cache, not the cap, limits admission, and a cap above the running count
    changes nothing."""
    return running is not None and running >= 1 and math.ceil(running) <= preemption_step(n, capacity, t)


def lower_seqs(cur: Settings, bounds: Bounds, capacity: CapacityPlan | None, t: Thresholds,
               running: float | None = None) -> int | None:
    """One preemption step down from the cap, or from the running count when a step from the
    cap would bind nothing: such a change cannot help, and its verification would judge
    noise or a load still ramping up (and revert it)."""
    n = cur.max_num_seqs
    width = math.ceil(running) if steps_from_running(n, capacity, t, running) else n
    new = bounds.max_num_seqs.clamp(min(preemption_step(width, capacity, t), n - 1))
    return new if new < n else None


def seqs_ceiling(cur: Settings, bounds: Bounds) -> int:
    ceiling = bounds.max_num_seqs.max
    if cur.max_num_batched_tokens is not None:
        ceiling = min(ceiling, cur.max_num_batched_tokens)
    return ceiling


def kv_width(s: MetricsSnapshot, n: int, t: Thresholds) -> int:
    """The widest cap that keeps the projected peak KV usage under kv_raise_target, usage
    taken to scale with the sequences admitted (n of them now)."""
    return math.floor(n * t.kv_raise_target / max(s.kv_usage_max or 0.0, 1e-3))


def raise_seqs(s: MetricsSnapshot, cur: Settings, bounds: Bounds, t: Thresholds) -> int | None:
    n = cur.max_num_seqs
    new = max(n + 1, math.ceil(n * t.seq_increase))
    new = min(new, max(n + 1, kv_width(s, n, t)))
    room = tpot_room(s, cur, t)
    if room is not None:
        new = min(new, room)
    new = min(new, seqs_ceiling(cur, bounds))
    return new if new > n else None


def lower_seqs_for_tpot(s: MetricsSnapshot, cur: Settings, bounds: Bounds, t: Thresholds) -> int | None:
    """The batch width that brings TPOT to objective x tpot_target_ratio, supposing step
    time proportional to width (it has a fixed part too, so this cuts too little rather than
    too much; the next interval takes another step). The width is what runs on the busiest
    pod (whose steps the p95 reads), not the cap above it; at most half of it in one step.
    None when one sequence already runs alone or the bound stops it."""
    width = min(cur.max_num_seqs, s.batch_width(cur.replicas))
    if width < 2:
        return None
    want = math.floor(width * t.tpot_objective_s * t.tpot_target_ratio / s.tpot_p95_s)
    new = max(want, math.ceil(width * t.seq_max_decrease), 1)
    new = bounds.max_num_seqs.clamp(min(new, cur.max_num_seqs - 1))
    return new if new < cur.max_num_seqs else None


def tpot_room(s: MetricsSnapshot, cur: Settings, t: Thresholds) -> int | None:
    """The widest batch projected to keep TPOT p95 under objective x tpot_raise_ratio, TPOT
    taken as proportional to the busiest pod's running width (which overstates the growth:
    cautious); None without an objective or a TPOT reading."""
    if t.tpot_objective_s is None or not s.tpot_p95_s:
        return None
    width = max(1.0, min(cur.max_num_seqs, s.batch_width(cur.replicas)))
    return math.floor(width * t.tpot_objective_s * t.tpot_raise_ratio / s.tpot_p95_s)


def tpot_blocks_raise(s: MetricsSnapshot, cur: Settings, t: Thresholds) -> str | None:
    room = tpot_room(s, cur, t)
    if room is None or room > cur.max_num_seqs:
        return None
    return (f"TPOT p95 {1000 * s.tpot_p95_s:.0f}ms leaves no room under "
            f"{1000 * t.tpot_objective_s * t.tpot_raise_ratio:.0f}ms (objective x {t.tpot_raise_ratio:g}) "
            f"for a wider batch, so widening it would break the objective")


def len_target(s: MetricsSnapshot, cur: Settings, bounds: Bounds, t: Thresholds) -> int | None:
    """The lower max_model_len KVCacheBound would move to, or None when lengths are not
    far below it (or unknown, or requests are being refused for length)."""
    if s.request_len_p99 is None or (s.length_refusals_per_s or 0.0) > t.refusal_enter_per_s:
        return None
    target = round_up(s.request_len_p99 * t.len_headroom, cur.block_size)
    if target > cur.max_model_len * t.len_far_ratio:
        return None
    step_floor = round_up(cur.max_model_len / t.len_max_divisor, cur.block_size)
    new = bounds.max_model_len.clamp(max(target, step_floor))
    return new if new < cur.max_model_len else None


def round_up(x: float, block: int) -> int:
    return max(block, math.ceil(x / block) * block)
