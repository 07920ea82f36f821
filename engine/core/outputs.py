"""What the engine hands back: vLLM-shaped request and completion outputs, and stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, best first


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # cumulative; while streaming, a possible stop-string prefix is held back
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Monotonic timestamps (time.monotonic()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None  # the engine failed on this request alone (it ends with "abort")


@dataclass
class EngineStats:
    """A point-in-time view for metrics: gauges plus monotonically growing counters."""

    num_running: int
    num_waiting: int  # new arrivals not yet started: what the server's queue cap bounds
    kv_cache_usage: float  # fraction of KV blocks held by requests
    num_kv_blocks: int
    num_preemptions_total: int
    prefix_cache_queries_total: int  # tokens
    prefix_cache_hits_total: int  # tokens
    prompt_tokens_total: int
    generation_tokens_total: int
    max_num_seqs: int
    max_model_len: int
    executor_counters: dict[str, float] = field(default_factory=dict)  # e.g. simulated step time
    prompt_tokens_cached_total: int = 0  # of prompt_tokens_total, supplied by the prefix cache
    spec_decode: Any = None  # the speculator's SpecDecodeStats (a copy), when speculation is configured
    num_speculative_tokens: int | None = None  # in effect (live-tunable), when configured
    # Preempted (KV dropped for recompute) and waiting to resume: admitted already, so they
    # are not in num_waiting (the cap bounds that) but count against the cap at admission.
    num_preempted_waiting: int = 0

    @property
    def num_queued(self) -> int:
        """Everything in the scheduler's waiting queue: what admission counts against the cap."""
        return self.num_waiting + self.num_preempted_waiting
