"""Continuous batching with one rule: each request's computed tokens chase its tokens."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .clock import RealClock
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass
class SchedulerLimits:
    """The limits the scheduler enforces; max_num_seqs and max_model_len can change live."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # the spec tokens included
    # Draft tokens verified this step (they follow the request's last token in the batch).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last token, so its logits are sampled."""
        return (self.request.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids)
                == self.request.num_tokens)


@dataclass
class SchedulerOutput:
    started_at: float = 0.0  # when schedule() began: the step's start on the engine's clock
    # The previous step left work, so this one follows it without an idle spell (on real
    # hardware the host work in between overlaps the accelerator's).
    follows_previous: bool = False
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests whose blocks were freed (preempted, finished or aborted) since the last
    # output with work, this one's preemptions included: the executor drops what it keeps
    # per request (block-table rows) for these before it reads this step's block tables.
    freed: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv_cache: KVCacheManager, clock=None) -> None:
        self.limits = limits
        self.clock = clock or RealClock()
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.unfinished: dict[Request, None] = {}  # an insertion-ordered set
        self._freed: list[Request] = []  # handed to the next output that has work
        self.num_preemptions = 0
        # Of `waiting`, the requests preempted back into it (they resume first). They are
        # not new arrivals: the server's queue cap bounds the others (see num_queued).
        self.num_preempted_waiting = 0

    def add_request(self, request: Request) -> None:
        """Queue a new request (the engine's add_request checked its id, once)."""
        self.unfinished[request] = None
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.unfinished)

    @property
    def num_queued(self) -> int:
        """Waiting requests not yet started (new arrivals): `waiting` less the preempted."""
        return len(self.waiting) - self.num_preempted_waiting

    def schedule(self) -> SchedulerOutput:
        now = self.clock.now()
        out = SchedulerOutput(started_at=now)
        budget = self.limits.max_num_batched_tokens
        # 1. Running requests first, oldest first; the newest is preempted when blocks run out.
        running, allocate, scheduled = self.running, self.kv_cache.allocate_slots, out.scheduled
        # For the decode fast path below (per sequence per step: kept lean).
        bs, caching = self.kv_cache.block_size, self.kv_cache.enable_prefix_caching
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = len(request.prompt_token_ids) + len(request.output_token_ids) - request.num_computed_tokens
            if num_new <= 0:
                i += 1
                continue
            spec = request.spec.token_ids  # the speculator drops them after the step (record)
            if num_new == 1 and not spec and request.num_computed_tokens < len(request.kv.block_ids) * bs and not (
                    caching and (request.num_computed_tokens + 1) // bs > request.kv.num_hashed_blocks):
                # The common decode: its slot is in a block it holds and it fills no block
                # to cache, so allocate_slots would do nothing.
                scheduled.append(ScheduledRequest(request, 1))
                budget -= 1
                i += 1
                continue
            if spec:
                # Drafts ride with a decode; the budget cuts drafts, never the real token.
                spec = spec[:max(0, budget - num_new)] if num_new == 1 else []
                num_new += len(spec)
            if num_new > budget:
                num_new = budget
            while allocate(request, num_new) is None:
                victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            scheduled.append(ScheduledRequest(request, num_new, spec) if spec
                             else ScheduledRequest(request, num_new))
            budget -= num_new
            i += 1
        # 2. Admit waiting requests in arrival order, unless this step already ran short.
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.limits.max_num_seqs
        ):
            request = self.waiting[0]
            hit_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            if self.kv_cache.allocate_slots(request, num_new, hit_blocks) is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.status is RequestStatus.PREEMPTED:
                self.num_preempted_waiting -= 1
            self.kv_cache.record_prefix_lookup(request.num_tokens, num_hit)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit
            if request.times.first_scheduled is None:
                request.times.first_scheduled = now
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        if out.scheduled:  # an empty output is never run, so the executor would not see it
            out.freed = self.take_freed()
        return out

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop its KV blocks and queue it first in line."""
        self.kv_cache.free(request)
        self._freed.append(request)  # the speculator drops its drafts and draft KV count there
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preempted_waiting += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput, sampled_requests: list[Request],
               token_ids: list[list[int]]) -> list[int]:
        """Advance computed tokens and append each sampled request's new tokens (one, or
        with speculation its accepted drafts and one more; aligned with sampled_requests);
        return how many each appended before it finished (the rest are dropped)."""
        drafted = False
        for item in out.scheduled:
            # Rejected drafts' KV is not computed: it is past the request's tokens, and
            # the blocks that held only such slots go back to the pool.
            if item.spec_token_ids:
                drafted = True
                item.request.num_computed_tokens += item.num_new_tokens - len(item.spec_token_ids)
            else:
                item.request.num_computed_tokens += item.num_new_tokens
        appended = []
        for request, tokens in zip(sampled_requests, token_ids):
            # max_tokens was fixed against max_model_len at admission, so a live change
            # of max_model_len never cuts a request already accepted.
            if len(tokens) == 1:  # no drafts: one token (per sequence per step: kept lean)
                status = request.append_token(tokens[0])
                if status is not None:
                    self.finish(request, status)
                appended.append(1)
                continue
            n = 0
            for token in tokens:
                n += 1
                status = request.append_token(token)
                if status is not None:
                    self.finish(request, status)
                    break
            appended.append(n)
            if n > 1:
                # The accepted drafts' KV was written by this step (their slots follow the
                # last computed token), so they count as computed; the last token does not.
                request.num_computed_tokens += n - 1
        for item in out.scheduled if drafted else ():
            if item.spec_token_ids and not item.request.status.finished:
                self.kv_cache.trim(item.request)
        return appended

    def append_decoded(self, request: Request, token_ids: list[int]) -> None:
        """Record a run of decode steps' tokens for a running request, one a step, none of
        which ends it (the fleet's fast-forward, engine/fleet/fast_forward.py, checked that
        and allocated their slots): what update() does for them one step at a time."""
        request.output_token_ids += token_ids
        request.num_computed_tokens += len(token_ids)

    def take_freed(self) -> list[Request]:
        """The requests freed since the last scheduled output, handed over once."""
        freed, self._freed = self._freed, []
        return freed

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and free its blocks; idempotent."""
        if request.status.finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
            if request.status is RequestStatus.PREEMPTED:
                self.num_preempted_waiting -= 1
        request.status = status
        request.times.finished = self.clock.now()
        self.kv_cache.free(request)
        self.unfinished.pop(request, None)
        self._freed.append(request)

    def stop(self, request: Request, stop_reason: str, *, num_dropped: int) -> None:
        """End a request on a stop string the output processor found in its text, dropping
        its `num_dropped` newest tokens (accepted drafts past the stop string). If it had
        already ended (length, a stop token) on one of those, it ends as stopped instead."""
        if num_dropped:
            del request.output_token_ids[-num_dropped:]
        request.stop_reason = stop_reason
        if not request.status.finished:
            self.finish(request, RequestStatus.FINISHED_STOPPED)
        elif num_dropped:
            request.status = RequestStatus.FINISHED_STOPPED

    def abort(self, request: Request) -> None:
        self.finish(request, RequestStatus.FINISHED_ABORTED)
