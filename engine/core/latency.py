"""Latency figures for the histograms, one source for every consumer: the engine
stamps each request's times on its own clock (arrival, first scheduled, each token,
finish) and reports TTFT, inter-token gaps and each finished sequence to a sink: the
server's Prometheus collectors, or a simulated replica's scrape-able counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .request import Request


@dataclass(frozen=True)
class GroupSummary:
    """A whole user request (its n choices), reported with its last choice to finish."""

    n: int
    max_num_generation_tokens: int  # the longest choice's output


@dataclass
class FinishedRequest:
    """What one finished sequence contributes to the request histograms. The phase times
    follow vLLM's: prefill from first scheduled to first token, decode from first to last
    token, inference from first scheduled to last token (preemptions included); None
    where a phase never began (aborted while waiting)."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    queue_time: float | None
    ttft: float | None
    mean_time_per_output_token: float | None  # None below 2 tokens (no gap to average)
    service_tier: str = "default"
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    max_tokens_param: int | None = None  # the client's max_tokens (None: not given)
    group: GroupSummary | None = None  # set on the last choice of its request to finish


class LatencySink(Protocol):
    def record_first_token(self, ttft: float) -> None: ...
    def record_inter_token(self, latency: float) -> None: ...
    def record_finished(self, req: FinishedRequest) -> None: ...
    def record_iteration_tokens(self, num_tokens: int) -> None: ...


def _span(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None else None


def finished_record(req: Request, reason: str, group: GroupSummary | None = None) -> FinishedRequest:
    """A finished sequence's histogram values, from its own timestamps (and, for the last
    choice of its request to finish, `group`: the request's n and longest output, from
    the output processor's group_summary)."""
    t = req.times
    n = len(req.output_token_ids)
    tpot = None
    if n > 1 and t.first_token is not None and t.last_token is not None:
        tpot = (t.last_token - t.first_token) / (n - 1)
    queue = None
    if reason != "abort" and t.first_scheduled is not None:
        queue = t.first_scheduled - t.arrival
    end = t.finished if t.finished is not None else t.last_token
    return FinishedRequest(
        finish_reason=reason, num_prompt_tokens=req.num_prompt_tokens, num_generation_tokens=n,
        e2e_latency=(end - t.arrival) if end is not None else 0.0, queue_time=queue,
        ttft=(t.first_token - t.arrival) if t.first_token is not None else None,
        mean_time_per_output_token=tpot, service_tier=req.service_tier,
        prefill_time=_span(t.first_scheduled, t.first_token),
        decode_time=_span(t.first_token, t.last_token),
        inference_time=_span(t.first_scheduled, t.last_token),
        num_preemptions=req.num_preemptions, num_cached_tokens=req.num_cached_tokens or 0,
        max_tokens_param=req.sampling_params.max_tokens, group=group,
    )
