"""max_num_batched_tokens as a tuned live setting: the chunked-prefill budget trades TTFT
against TPOT. Every step that carries a prefill chunk of C tokens takes about as long as
C tokens of compute, and every running sequence waits for it; with C in the thousands
such steps are several times a decode step, so prompt-heavy traffic breaks a TPOT
objective however narrow the batch. Smaller chunks spread a prompt over more, shorter
steps (TPOT down, TTFT up); larger ones serve prompts in fewer steps (TTFT and
throughput up).

The diagnosis reads only what the pods export: the share of the tokens processed that
are prompt tokens (vllm:prompt_tokens_total against vllm:generation_tokens_total), TPOT
p95 against the objective, and the queue. Lowered under TPOTBound with
prompt-heavy traffic, before the batch is narrowed, in proportion to the excess (halved to
quartered); raised (doubled, up to the bound) when requests queue while TPOT has room and
still wait at the window's end; halved under SchedulerBound when TPOT alone keeps the batch
from widening and prompt chunks fill the steps (`room_for_width`: the room, before a replica).
A lowered budget is not raised again within flip_backoff_s, and each move is verified on its
target signal like any other.

TPOT p95 is each finished request's own mean time per output token, so a window in which
load paused (bursty traffic: every window holds idle seconds) still measures it, where the
running and waiting means are diluted. Lowering the budget on such a window needs only
enough requests finished in it (`tpot_min_requests`); the policy's hold for a window of
steady load stays for every move read from those means. For the same reason a scale-out
just made does not hold the lowering: that change is not reverted for its signal, so neither
its verification nor its cooldown needs the budget to stay where it is, and a new replica takes
minutes to lower TPOT that a smaller chunk lowers at the next step."""

from __future__ import annotations

import math

from .decision import Bounds, Diagnosis, Settings, Thresholds
from .history import History
from .memory import QUEUE_BOUND, blocked_move
from .signals import MetricsSnapshot
from .steps import kv_width, seqs_ceiling

SETTING = "max_num_batched_tokens"


def prompt_share(s: MetricsSnapshot) -> float:
    prompt, gen = s.prompt_tokens_per_s or 0.0, s.generation_tokens_per_s or 0.0
    return prompt / (prompt + gen) if prompt + gen > 0 else 0.0


def lowered(mbt: int, tpot_p95: float | None, objective: float | None, t: Thresholds) -> int:
    """The chunk budget a TPOT excess points to: scaled by target / TPOT p95 (the steps that
    carry a chunk are what stretch TPOT, and they shorten with it), to the nearest power of
    two, at least halved and at most quartered in one move (as the batch width's step)."""
    if not tpot_p95 or not objective:
        return mbt // 2
    want = mbt * t.tpot_target_ratio * objective / tpot_p95
    nearest = 2 ** round(math.log2(max(want, 1.0)))
    return int(min(mbt // 2, max(mbt // 4, nearest)))


def tpot_sampled(s: MetricsSnapshot, t: Thresholds) -> bool:
    """Whether enough requests finished in the window for its TPOT p95 to stand alone."""
    return s.tpot_p95_s is not None and (s.request_rate_per_s or 0.0) * s.window_s >= t.tpot_min_requests


def beside_scale_out(diagnosis: Diagnosis, s: MetricsSnapshot, cur: Settings, bounds: Bounds,
                     history: History, now: float, t: Thresholds):
    """The lowering chunk_change proposes for TPOT when the last change applied was a
    scale-out (which would otherwise hold it for its verification and cooldown), or None."""
    last = history.last_applied()
    if diagnosis is not Diagnosis.TPOT_BOUND or last is None or set(last.decision.change) != {"replicas"}:
        return None
    old, new = last.decision.change["replicas"]
    if new <= old or not tpot_sampled(s, t):
        return None
    return chunk_change(diagnosis, s, cur, bounds, history, now, t)


def chunk_change(diagnosis: Diagnosis, s: MetricsSnapshot, cur: Settings, bounds: Bounds, history: History,
                 now: float, t: Thresholds):
    """(change, target signal, sentence, diagnosis) moving the chunk budget, or None."""
    r, mbt = bounds.max_num_batched_tokens, cur.max_num_batched_tokens
    if r is None or mbt is None:
        return None
    share = prompt_share(s)
    objective = t.tpot_objective_s
    if diagnosis is Diagnosis.TPOT_BOUND and share >= t.chunk_prompt_share:
        new = max(r.min, cur.max_num_seqs, lowered(mbt, s.tpot_p95_s, objective, t))
        if new < mbt and not blocked_move(history, SETTING, -1, now, t):
            return ({SETTING: (mbt, new)}, "tpot_p95_s",
                    f"lower max_num_batched_tokens {mbt} -> {new}: {share:.0%} of the tokens processed are "
                    f"prompt tokens, and each step carrying a chunk of up to {mbt} of them stretches every "
                    f"running sequence's next token (TPOT p95 {1000 * (s.tpot_p95_s or 0):.0f}ms against "
                    f"{1000 * t.tpot_target_ratio * (objective or 0):.0f}ms aimed at)", diagnosis)
        return None
    tpot_room = objective is None or (s.tpot_p95_s is not None and s.tpot_p95_s <= t.chunk_raise_tpot_ratio * objective)
    if diagnosis in QUEUE_BOUND and mbt < r.max and tpot_room and share >= t.chunk_prompt_share:
        new = min(r.max, mbt * 2)
        # A queue already served (queue p95 still reads it) is no reason: the raise would be
        # verified on a queue that is gone, and its verification holds every other move.
        if not blocked_move(history, SETTING, +1, now, t) and not s.backlog_served(t.waiting_exit):
            tpot = f"TPOT p95 {1000 * s.tpot_p95_s:.0f}ms has room" if s.tpot_p95_s is not None else "no TPOT objective"
            return ({SETTING: (mbt, new)}, "num_waiting",
                    f"raise max_num_batched_tokens {mbt} -> {new}: requests queue for prompt chunks "
                    f"({share:.0%} of the tokens are prompt tokens) while {tpot}", diagnosis)
    return None


def room_for_width(s: MetricsSnapshot, cur: Settings, bounds: Bounds, history: History, now: float,
                   t: Thresholds, tpot_block: str):
    """A smaller chunk for SchedulerBound when only TPOT keeps the batch from widening (the
    cache has room, the cap is below its ceiling) and most tokens processed are prompt tokens:
    the chunk, not the batch, fills each step, so halving it is the room a wider batch needs,
    and it costs no GPU where the rules would add a replica. None otherwise."""
    r, mbt, n = bounds.max_num_batched_tokens, cur.max_num_batched_tokens, cur.max_num_seqs
    if r is None or mbt is None or prompt_share(s) < t.chunk_prompt_share:
        return None
    if kv_width(s, n, t) <= n or n >= seqs_ceiling(cur, bounds) or blocked_move(history, "max_num_seqs", +1, now, t):
        return None
    new = max(r.min, n, mbt // 2)
    if new >= mbt or blocked_move(history, SETTING, -1, now, t):
        return None
    return ({SETTING: (mbt, new)}, "tpot_p95_s",
            f"{tpot_block}; lower max_num_batched_tokens {mbt} -> {new} first: {prompt_share(s):.0%} of the "
            f"tokens processed are prompt tokens, so the chunk, not the batch, fills each step",
            Diagnosis.SCHEDULER_BOUND)
