"""The gateway's added latency, read without run-to-run noise.

Two runs of the same path against one engine on a shared host differ by far more than the
gateway adds (hundreds of ms of e2e p50 at concurrency 64 on 2 cores), so comparing a
direct run with a gateway run cannot show a 2 ms overhead. Here one run sends requests in
pairs that start together, one straight to the engine and one through the gateway, so both
halves of a pair share the engine's batches and the host's load, and the per-pair
difference (gateway minus direct) is what the gateway adds. Reported: the median and the
mean of those differences with a 95 % interval."""
from __future__ import annotations

import asyncio
import math
import statistics

import httpx

from kvpilot.engine.bench.serve import stream_completion
from kvpilot.engine.bench.serve_stats import RequestResult


def streamed_completion(model: str, prompt: list[int], output_tokens: int) -> dict:
    """The body every gateway benchmark request sends: greedy, exactly `output_tokens` out,
    streamed with usage."""
    return {"model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def drive_paired(direct_url: str, gateway_url: str, model: str, prompts: list[list[int]],
                       output_tokens: int, concurrency: int) -> list[tuple[RequestResult, RequestResult]]:
    """Streams each prompt twice at once, direct and through the gateway; `concurrency`
    counts requests, so `concurrency // 2` pairs are open at a time."""
    pairs_open = asyncio.Semaphore(max(1, concurrency // 2))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600)) as client:
        async def pair(prompt: list[int]) -> tuple[RequestResult, RequestResult]:
            body = streamed_completion(model, prompt, output_tokens)
            async with pairs_open:
                direct, via = await asyncio.gather(stream_completion(client, direct_url + "/v1/completions", body),
                                                   stream_completion(client, gateway_url + "/v1/completions", body))
                return direct, via

        return await asyncio.gather(*(pair(p) for p in prompts))


def _spread(diffs: list[float]) -> dict[str, float]:
    """Median, p1, p99 and mean of `diffs` (seconds) in ms, with the mean's 95 % interval
    half-width (normal approximation; the pairs are many and independent enough for it).
    The tails are mostly the engine's: the two halves of a pair can land in different
    engine steps either way round (p1 shows the other side); the mean carries what the hop
    adds to that, as a request it delays past a step's start waits a whole step."""
    mean = statistics.fmean(diffs)
    half = 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    cuts = statistics.quantiles(diffs, n=100, method="inclusive") if len(diffs) > 1 else [diffs[0]] * 99
    return {"median_ms": statistics.median(diffs) * 1e3, "p1_ms": cuts[0] * 1e3, "p99_ms": cuts[98] * 1e3,
            "mean_ms": mean * 1e3, "ci95_ms": half * 1e3}


def added_latency(pairs: list[tuple[RequestResult, RequestResult]]) -> dict:
    """What the gateway adds per request, from pairs whose both halves succeeded; failed
    halves are counted, never dropped silently."""
    ok = [(d, g) for d, g in pairs if d.success and g.success]
    out = {"pairs": len(ok), "failed_direct": sum(not d.success for d, _ in pairs),
           "failed_gateway": sum(not g.success for _, g in pairs)}
    if not ok:
        raise ValueError("no pair had both requests succeed; see the engine's and the gateway's logs")
    out["ttft"] = _spread([g.ttft - d.ttft for d, g in ok])
    out["e2e"] = _spread([g.latency - d.latency for d, g in ok])
    return out
