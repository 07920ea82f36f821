"""One sequence being served: its tokens, progress and timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .detokenizer import IncrementalDetokenizer
    from .outputs import CompletionOutput


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, to be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str) -> None:
        # A plain attribute, not a property: the engine asks this per request per step.
        self.finished = value in ("stop", "length", "abort")


@dataclass(slots=True)
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(slots=True)
class KVState:
    """The KV cache manager's (core/kv_cache_manager.py) per-request state: the block table
    and its prefix-cache hashes. Written by the KV cache manager only."""

    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    block_ids: list[int] = field(default_factory=list)  # the block table: physical block per logical
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix index
    # Bumped whenever ids leave block_ids (a free, a trim), with the count of leading ids
    # that removal kept, so a copy of them elsewhere (the executor's block-table row) knows
    # from where it is stale without being written to by this layer.
    version: int = 0
    kept: int = 0


@dataclass(slots=True)
class RowState:
    """The executor's (worker/step_inputs.py, BlockTables) per-request state: its row of the
    persistent block-table tensor. Written by BlockTables only."""

    table_row: int | None = None  # the row while the request holds blocks
    num_table_blocks: int = 0  # of kv.block_ids, those already written to that row
    kv_version: int = 0  # kv.version when they were written


@dataclass(slots=True)
class SampleState:
    """The sampler's (sample/) per-request state. The generator is made at the engine's
    add_request (by the executor, for a seeded request); the counts by the sampler."""

    generator: Any = None  # a torch.Generator, if seeded
    penalty_counts: Any = None  # the sampler's PenaltyCounts, once the request has penalties


@dataclass(slots=True)
class SpecState:
    """Speculation's (spec_decode/speculator.py, worker/draft_model.py) per-request state:
    the drafts proposed after the last step, which the scheduler reads (never writes) and
    the next step verifies. Written by the speculator and the draft model only."""

    token_ids: list[int] = field(default_factory=list)
    draft_probs: Any = None  # a draft model's distributions of them ([K', vocab]), when sampled
    draft_num_computed: int = 0  # leading tokens whose KV the draft model holds


@dataclass(slots=True)
class OutputState:
    """The output processor's (core/output_processor.py) per-request state, set up when
    the request is added. Written by the output processor only."""

    group: RequestGroup | None = None  # the user request this sequence is choice `index` of
    index: int = 0
    completion: CompletionOutput | None = None  # the choice as the user sees it so far
    detokenizer: IncrementalDetokenizer | None = None  # None when detokenize is off


@dataclass(eq=False, slots=True)
class Request:
    """A single sequence. `num_computed_tokens` chases `num_tokens`; that is the whole
    scheduling rule: a prompt is many uncomputed tokens, a decode is one.

    Its own fields are the request as the engine's add_request resolved it (fixed from
    then on) and the scheduler's state (core/scheduler.py writes them, through
    append_token for the output). What each other layer keeps per request is its own
    state object below, written by that layer only (tests/engine/core/test_request_owners.py)."""

    # Resolved once, at the engine's add_request.
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against max_model_len at admission
    stop_token_ids: frozenset[int]  # eos (unless ignore_eos) plus the user's stop ids
    seed: int = 0  # per sequence: the user's seed + child index, else derived from the prompt
    service_tier: str = "default"  # OpenAI's tier, for the per-tier latency metrics
    times: RequestTimes = field(default_factory=lambda: RequestTimes(arrival=time.monotonic()))
    # The scheduler's.
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first scheduling
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Each other layer's.
    kv: KVState = field(default_factory=KVState)
    row: RowState = field(default_factory=RowState)
    sample: SampleState = field(default_factory=SampleState)
    spec: SpecState = field(default_factory=SpecState)
    out: OutputState = field(default_factory=OutputState)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def append_token(self, token_id: int) -> RequestStatus | None:
        """Record a sampled token; return the finishing status if it ends the request."""
        self.output_token_ids.append(token_id)
        n = len(self.output_token_ids)
        if token_id in self.stop_token_ids and n > self.sampling_params.min_tokens:
            self.stop_reason = (
                token_id if token_id in (self.sampling_params.stop_token_ids or ()) else None
            )
            return RequestStatus.FINISHED_STOPPED
        if n >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None


@dataclass(eq=False, slots=True)
class RequestGroup:
    """One user request: its `n` choices are sequences of their own (children), sharing
    the prompt, and are reported together in one RequestOutput."""

    request_id: str
    prompt: str | None  # the text, when the prompt came as text
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)
    first_token_seen: bool = False  # TTFT is the first token of any choice
    summary_recorded: bool = False  # n and the longest output go to the metrics once

    @property
    def finished(self) -> bool:
        return all(c.status.finished for c in self.children)
