"""Latency figures for the histograms, one source for every consumer: the engine
stamps each request's times on its own clock (arrival, first scheduled, each token,
finish) and reports TTFT, inter-token gaps and each finished sequence to a sink: the
server's Prometheus collectors, or a simulated replica's scrape-able counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .request import Request


@dataclass
class FinishedRequest:
    """What one finished sequence contributes to the request histograms."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    queue_time: float | None
    ttft: float | None
    mean_time_per_output_token: float | None
    service_tier: str = "default"


class LatencySink(Protocol):
    def record_first_token(self, ttft: float) -> None: ...
    def record_inter_token(self, latency: float) -> None: ...
    def record_finished(self, req: FinishedRequest) -> None: ...


def finished_record(req: Request, reason: str) -> FinishedRequest:
    """A finished sequence's histogram values, from its own timestamps."""
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
    )
