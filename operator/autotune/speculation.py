"""The speculation rule: num_speculative_tokens (K, the draft tokens per sequence and step)
moved by what the drafts earn against the work they add. A heuristic, small enough to check
by hand:

- earned: with a per-token acceptance probability `a` (each draft token accepted on its own,
  as the speculative-decoding papers model it), one verification of K drafts yields
  E(K) = (1 - a^(K+1)) / (1 - a) tokens on average (K + 1 when a = 1; E(0) = 1 is plain
  decoding). `a` is the value for which E(K in effect) equals the measured mean accepted
  length (1 + accepted tokens per draft, from vllm:spec_decode_*).
- cost: a step runs B x (1 + K) rows, B the sequences running per replica. Decoding is
  memory-bound (reading the weights) up to about R = Thresholds.spec_compute_rows rows,
  compute-bound beyond: step time ~ max(1, rows / R), so relative to plain decoding a step
  costs C(K) = max(1, B (1 + K) / R) / max(1, B / R).
- value: G(K) = E(K) / C(K), output per unit of step time relative to plain decoding
  (G(0) = 1). Below R rows drafts are free and any acceptance pays; at B >= R no K pays,
  since E(K) <= K + 1. The best K is the one within the bounds with the highest G.

The rule moves K toward the best only when that is predicted to give spec_gain_margin more:
down by halving, or straight to the bound's minimum (0: off) when no K beats it; up one step
at a time. From K = 0 nothing measures acceptance, so K = 1 is tried only where the model
says one draft per sequence costs nothing (2B <= R). Drafting's own work (none for n-gram
lookup, a small model's passes for a draft model) and prefill rows are left out: each change
is verified on TPOT and, while requests wait, output tokens/s (verify.py), and reverted if
either got worse, like every other change."""

from __future__ import annotations

from .decision import Bounds, Diagnosis, Settings, Thresholds
from .history import History
from .memory import blocked_move
from .signals import MetricsSnapshot

SETTING = "num_speculative_tokens"
# No raise under KV pressure (each draft needs cache slots) or without load to measure.
NO_RAISE = (Diagnosis.PREEMPTION_BOUND, Diagnosis.IDLE, Diagnosis.NO_DATA)


def tokens_per_verification(a: float, k: int) -> float:
    """E(K): expected tokens one verification of k drafts yields at acceptance a."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def acceptance_from_mean_len(mean_len: float, k: int) -> float:
    """The per-token acceptance a with E(k) = mean_len (bisection; E grows with a)."""
    if k < 1 or mean_len <= 1.0:
        return 0.0
    if mean_len >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_verification(mid, k) < mean_len else (lo, mid)
    return (lo + hi) / 2


def step_cost(rows_per_replica: float, k: int, compute_rows: float) -> float:
    """C(K): a step's time with k drafts per sequence relative to plain decoding."""
    b = max(rows_per_replica, 0.0)
    return max(1.0, b * (1 + k) / compute_rows) / max(1.0, b / compute_rows)


def value(a: float, k: int, rows_per_replica: float, compute_rows: float) -> float:
    """G(K): output per unit of step time relative to plain decoding."""
    return tokens_per_verification(a, k) / step_cost(rows_per_replica, k, compute_rows)


def best_k(a: float, rows_per_replica: float, lo: int, hi: int, compute_rows: float) -> int:
    """The K in [lo, hi] with the highest G; the smaller on a tie."""
    best = lo
    for k in range(lo + 1, hi + 1):
        if value(a, k, rows_per_replica, compute_rows) > value(a, best, rows_per_replica, compute_rows) + 1e-9:
            best = k
    return best


def speculation_change(diagnosis: Diagnosis, s: MetricsSnapshot, cur: Settings, bounds: Bounds, history: History,
                       now: float, t: Thresholds, direction: int):
    """(change, target signal, sentence, diagnosis) moving K down (direction -1) or up (+1),
    or None: no speculation configured, nothing measured, no predicted gain, or blocked."""
    k, rng = cur.num_speculative_tokens, bounds.num_speculative_tokens
    if k is None or rng is None or diagnosis in (Diagnosis.IDLE, Diagnosis.NO_DATA):
        return None
    if direction > 0 and diagnosis in NO_RAISE:
        return None
    # The change is judged on TPOT: without a reading there is nothing to judge it by. Nor on a
    # window in which load began or paused (some pod ran nothing at some point): its running
    # mean is diluted, and the window it is judged against is not.
    target = "tpot_mean_s" if s.tpot_mean_s is not None else "tpot_p95_s" if s.tpot_p95_s is not None else None
    if target is None or (s.running_min is not None and s.running_min < 0.5):
        return None
    rows = s.running_per_pod(cur.replicas)
    r = t.spec_compute_rows
    if k == 0:
        if direction < 0 or rng.max < 1 or 2 * rows > r or blocked_move(history, SETTING, +1, now, t):
            return None
        return ({SETTING: (0, 1)}, target,
                f"speculation is off and {rows:.1f} running per replica x (1 + 1 draft) = {2 * rows:.0f} rows a "
                f"step is under the ~{r:.0f}-row compute threshold, so one draft per sequence costs nothing by "
                f"the model: try num_speculative_tokens 0 -> 1 (TPOT decides whether it stays)", diagnosis)
    if s.spec_mean_accepted_len is None:  # nothing drafted in the window: nothing measured
        return None
    measured_k = int(s.num_speculative_tokens) if s.num_speculative_tokens else k
    a = acceptance_from_mean_len(s.spec_mean_accepted_len, measured_k)
    best = best_k(a, rows, rng.min, rng.max, r)
    g_now, g_best = value(a, k, rows, r), value(a, best, rows, r)
    if g_best < g_now * (1 + t.spec_gain_margin) or (best - k) * direction <= 0:
        return None
    if blocked_move(history, SETTING, direction, now, t):
        return None
    if direction < 0:
        new = rng.min if best == rng.min else max(best, k // 2, rng.min)
    else:
        new = min(k + 1, rng.max)
    accepted = ("" if s.spec_acceptance_rate is None
                else f", {s.spec_acceptance_rate:.0%} of draft tokens accepted")
    measured = (f"{s.spec_mean_accepted_len:.2f} tokens per verification at K={measured_k}{accepted} "
                f"(per-token acceptance {a:.2f})")
    rows_now = f"{rows:.1f} running per replica x (1 + {k}) = {rows * (1 + k):.0f} rows a step"
    gains = f"{g_now:.2f}x plain decoding now, {g_best:.2f}x at K={best}"
    if direction < 0:
        off = " (off: no K pays at this batch)" if new == 0 else ""
        return ({SETTING: (k, new)}, target,
                f"speculation costs more than it earns: {rows_now} (a step costs {step_cost(rows, k, r):.2f}x "
                f"a plain one past the ~{r:.0f}-row compute threshold) for {measured}: {gains}; "
                f"lower num_speculative_tokens {k} -> {new}{off}", diagnosis)
    return ({SETTING: (k, new)}, target,
            f"speculation would earn more: {rows_now} (compute threshold ~{r:.0f} rows) and {measured}: "
            f"{gains}; raise num_speculative_tokens {k} -> {new}", diagnosis)
