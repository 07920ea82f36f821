"""Fast-forward through a simulated replica's decode-only steps (virtual time only).

Between two fleet events (an arrival, a scrape, a client's deadline, a replica coming up),
a replica whose running sequences all decode one token, and which could admit nothing
from its queue, takes steps whose course is known: each sequence gets one token, none
finishes, nothing is admitted or preempted. Most steps of a simulated hour are such
steps. `decode_steps` takes a run of them at once: the step times one by one (the
simulated executor's `run_decode`, as its `run` counts them), then each sequence's tokens
for the whole run, its KV blocks where its slots start or fill one (in the order the
scheduler would take them, step by step), and the metrics the engine would record.

A run stops before any step that could go another way: one that would finish a sequence
(its max_tokens-th token), one that needs more KV blocks than are free (a preemption),
or one that starts at or after `until`. That step, and any replica with drafts, logprobs,
stop tokens, text to detokenize, n > 1 or streamed outputs, goes through `LLMEngine.step`.
The outcome is the same to the bit as stepping each time: tests/engine/fleet/
test_fast_forward.py runs fleets both ways and compares every request, scrape and counter."""

from __future__ import annotations

import math

from ..core.request import Request
from ..llm_engine import LLMEngine
from ..sim.executor import SimulatedExecutor
from .replica_metrics import ReplicaMetrics


def decode_steps(engine: LLMEngine, until: float) -> int:
    """Take the decode-only steps that start before `until` (the fleet's next event) at
    once; return how many (0: step the usual way)."""
    runner, sched, sink = engine.runner, engine.scheduler, engine.latency_sink
    running = sched.running
    if (not running or engine.speculator is not None or not isinstance(runner, SimulatedExecutor)
            or not (sink is None or isinstance(sink, ReplicaMetrics))):
        return 0
    n = len(running)
    most, context = _steps_before_a_finish(running)
    if most < 1 or n > sched.limits.max_num_batched_tokens or not _admission_blocked(engine, n):
        return 0
    kv, clock = engine.kv_cache, runner.clock
    bs = kv.block_size
    # Steps only lengthen as the sequences grow: no more than this many start before `until`.
    first = runner.decode_time(n, context + n)
    if first > 0 and until - clock.now() < (most - 1) * first:
        most = max(1, math.ceil((until - clock.now()) / first))
    # Where each sequence's slot starts a block (it takes one) or its token fills one (it is
    # cached): (step, place in the running order, takes a block), in the scheduler's order.
    events = sorted(e for i, r in enumerate(running) for e in _block_events(r, i, bs, kv.enable_prefix_caching, most))
    taking = [0] * most
    for step, _, takes in events:
        taking[step] += takes
    # The steps' times, one by one; the run ends where a step would start too late or
    # find too few free blocks (it would preempt).
    free = kv.pool.num_free_blocks
    ends: list[float] = []
    follows = engine.left_work
    while len(ends) < most:
        started_at = clock.now()
        free -= taking[len(ends)]
        if started_at >= until or free < 0:
            break
        context += n
        runner.run_decode(n, context, started_at, follows)
        ends.append(clock.now())
        follows = True
    k = len(ends)
    if not k:
        return 0
    # The metrics: each sequence's first gap since its last token, then one gap per step.
    if sink is not None:
        for r in running:
            sink.record_inter_token(ends[0] - r.times.last_token)
        for j in range(1, k):
            sink.record_inter_token(ends[j] - ends[j - 1], times=n)
        sink.record_iteration_tokens(n, times=k)
    # The tokens (update() and the output path's one-token case, k times over), then the
    # blocks as schedule() would have allocated them at each step: allocate_slots sees the
    # sequence as it was then (its tokens past that step not computed, so not hashed).
    computed = [r.num_computed_tokens for r in running]
    tokens_for = runner.tokens.tokens_ignoring_eos
    engine.emit_decoded([tokens_for(r.seed, len(r.output_token_ids), k) for r in running], ends[-1])
    for step, i, _ in events:
        if step >= k:
            break
        kv.allocate_slots(running[i], 1, num_computed=computed[i] + step)
    return k


def _steps_before_a_finish(running: list[Request]) -> tuple[int, int]:
    """(steps every running sequence can take on the fast path before one of them ends (0
    when one cannot take it at all), their computed tokens in all)."""
    steps, context = math.inf, 0
    for r in running:
        p, out = r.sampling_params, r.out
        # A decode: it has a token already (a prompt's last chunk of one token gives the first).
        if (not r.output_token_ids or r.num_computed_tokens != len(r.prompt_token_ids) + len(r.output_token_ids) - 1
                or r.spec.token_ids
                or r.stop_token_ids or p.logprobs is not None or out.detokenizer is not None
                or len(out.group.children) != 1 or p.output_kind != "final_only"):
            return 0, 0
        # The step that gives the max_tokens-th token finishes it: it goes the usual way.
        steps = min(steps, r.max_tokens - len(r.output_token_ids) - 1)
        if steps < 1:  # one finishes at the next step: no run
            return 0, 0
        context += r.num_computed_tokens
    return int(steps), context


def _block_events(r: Request, i: int, bs: int, caching: bool, steps: int) -> list[tuple[int, int, int]]:
    """The steps (< steps) at which schedule() would call allocate_slots for the decoding
    sequence r, at place i of the running order: where its slot is past its blocks (it
    takes one), or, with prefix caching, where its token fills a block not yet cached."""
    c, held, hashed = r.num_computed_tokens, len(r.kv.block_ids), r.kv.num_hashed_blocks
    events, j = [], 0
    while True:
        new_block = held * bs - c  # the first step whose slot is past the held blocks
        fills = (hashed + 1) * bs - 1 - c if caching else math.inf  # the first that fills one
        j = max(j, min(new_block, fills))
        if j >= steps:
            return events
        takes = int(j >= new_block)
        events.append((j, i, takes))
        held += takes
        if caching:  # allocate_slots caches every full block of its tokens so far
            hashed = max(hashed, (c + j + 1) // bs)
        j += 1


def _admission_blocked(engine: LLMEngine, num_running: int) -> bool:
    """Whether schedule() admits nothing from the queue in any step of the run: with the
    running count and the token budget fixed and KV blocks only taken, never freed, what
    the queue's head cannot get now it cannot get later in the run."""
    sched = engine.scheduler
    if not sched.waiting:
        return True
    budget = sched.limits.max_num_batched_tokens - num_running
    if budget <= 0 or num_running >= sched.limits.max_num_seqs:
        return True
    head = sched.waiting[0]
    hit_blocks, num_hit = engine.kv_cache.get_computed_blocks(head)  # as schedule() asks it
    return engine.kv_cache.blocks_needed(head, min(head.num_tokens - num_hit, budget), hit_blocks) is None
