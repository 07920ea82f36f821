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


@dataclass(eq=False, slots=True)
class Request:
    """A single sequence. `num_computed_tokens` chases `num_tokens`; that is the whole
    scheduling rule: a prompt is many uncomputed tokens, a decode is one."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against max_model_len at admission
    stop_token_ids: frozenset[int]  # eos (unless ignore_eos) plus the user's stop ids
    seed: int = 0  # per sequence: the user's seed + child index, else derived from the prompt
    generator: Any = None  # the executor's per-request generator (a torch.Generator), if seeded
    times: RequestTimes = field(default_factory=lambda: RequestTimes(arrival=time.monotonic()))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first scheduling
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    block_ids: list[int] = field(default_factory=list)  # the block table: physical block per logical
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix index
    table_row: int | None = None  # the executor's block-table row while it holds blocks
    num_table_blocks: int = 0  # of block_ids, those already written to that row
    service_tier: str = "default"  # OpenAI's tier, for the per-tier latency metrics
    # Output state, set up by the OutputProcessor when the request is added.
    group: RequestGroup | None = None  # the user request this sequence is choice `index` of
    index: int = 0
    completion: CompletionOutput | None = None  # the choice as the user sees it so far
    detokenizer: IncrementalDetokenizer | None = None  # None when detokenize is off
    penalty_counts: Any = None  # the sampler's PenaltyCounts, once the request has penalties
    # Speculation: draft tokens proposed after the last step, verified by the next one.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Any = None  # a draft model's distributions of them ([K', vocab]), when sampled
    draft_num_computed: int = 0  # leading tokens whose KV the draft model holds

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
