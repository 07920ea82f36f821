"""`kvpilot bench serve`: drive a running OpenAI-compatible server (kvpilot or vLLM) with
streaming completions of random token-id prompts and report vLLM-style serving metrics.

`run_benchmark(BenchConfig(...)) -> dict` (or `await benchmark(...)`) is the in-process API
the autotuner's tests use to put load on a server."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from .serve_stats import RequestResult, parse_goodput, print_result, summarize

DEFAULT_VOCAB = 4096  # ids below this exist in every tokenizer this is pointed at
MIN_TOKEN_ID = 16  # skip the lowest ids, where tokenizers keep their special tokens


@dataclass
class BenchConfig:
    base_url: str
    model: str
    api_key: str | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    num_prompts: int = 1000
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    vocab_size: int | None = None
    goodput: dict[str, float] = field(default_factory=dict)  # ttft/tpot/e2el -> ms
    timeout_s: float = 6 * 3600.0
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        for name in ("random_input_len", "random_output_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.random_prefix_len < 0:
            raise ValueError(f"random_prefix_len must be non-negative, got {self.random_prefix_len}")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive (or inf), got {self.request_rate}")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")


@dataclass
class BenchRequest:
    prompt: list[int]
    output_len: int


def make_requests(cfg: BenchConfig, vocab_size: int) -> list[BenchRequest]:
    """vLLM's random dataset: a shared prefix, then lengths uniform in len*(1 -/+ ratio)."""
    rng = random.Random(cfg.seed)

    def lengths(mean: int) -> list[int]:
        lo = max(1, int(mean * (1 - cfg.random_range_ratio)))
        hi = max(lo, int(mean * (1 + cfg.random_range_ratio)))
        return [rng.randint(lo, hi) for _ in range(cfg.num_prompts)]

    high = max(vocab_size, MIN_TOKEN_ID + 1)
    prefix = [rng.randrange(MIN_TOKEN_ID, high) for _ in range(cfg.random_prefix_len)]
    inputs, outputs = lengths(cfg.random_input_len), lengths(cfg.random_output_len)
    return [BenchRequest(prefix + [rng.randrange(MIN_TOKEN_ID, high) for _ in range(n)], o)
            for n, o in zip(inputs, outputs)]


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _headers(cfg: BenchConfig) -> dict[str, str]:
    return auth_headers(cfg.api_key)


def http_client(base_url: str, concurrency: int, timeout_s: float):
    """An httpx.AsyncClient holding up to `concurrency` connections to the server."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), limits=limits,
                             timeout=httpx.Timeout(timeout_s, connect=30.0))


async def sse_data(resp) -> AsyncIterator[dict | None]:
    """The JSON payloads of an SSE response, then None for `data: [DONE]` (and stop)."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            yield None
            return
        yield json.loads(data)


async def _send(client, cfg: BenchConfig, req: BenchRequest) -> RequestResult:
    body = {"model": cfg.model, "prompt": req.prompt, "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    return await stream_completion(client, "/v1/completions", body, _headers(cfg))


async def stream_completion(client, url: str, body: dict,
                            headers: dict[str, str] | None = None) -> RequestResult:
    """POST one streaming completion and time it: TTFT, inter-chunk latencies, end to end.
    A failure is recorded in the result, never raised."""
    result = RequestResult(prompt_len=len(body["prompt"]))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers or {}) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return result
            async for event in sse_data(resp):
                if event is None:
                    break
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))
                    return result
                now = time.perf_counter()
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0].get("text"):
                    chunks += 1
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        if result.output_tokens is None:
            result.output_tokens = chunks
        result.success = result.ttft is not None
        if not result.success:
            result.error = "the stream carried no tokens"
    except Exception as exc:  # connection errors count as failed requests, not crashes
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _arrivals(n: int, rate: float, burstiness: float, rng: random.Random):
    """Yield request indexes; Poisson (gamma with burstiness) arrivals at `rate` per second."""
    for i in range(n):
        yield i
        if math.isinf(rate) or i == n - 1:
            continue
        theta = 1.0 / (rate * burstiness)
        await asyncio.sleep(rng.gammavariate(burstiness, theta))


async def served_models(client, api_key: str | None) -> dict[str, dict]:
    """GET /v1/models: each served model's entry by id. A server that cannot be reached
    is a ValueError naming its URL (a command-line error, not a traceback)."""
    import httpx

    try:
        resp = await client.get("/v1/models", headers=auth_headers(api_key))
    except httpx.TransportError as e:
        raise ValueError(f"--base-url: cannot reach {client.base_url}: {type(e).__name__}: {e}") from None
    if resp.status_code != 200:
        raise RuntimeError(f"GET /v1/models failed: HTTP {resp.status_code}: {resp.text[:200]}")
    return {m["id"]: m for m in resp.json().get("data", [])}


async def _vocab_size(client, cfg: BenchConfig) -> int:
    if cfg.vocab_size:
        return cfg.vocab_size
    models = await served_models(client, cfg.api_key)
    if cfg.model not in models:
        raise RuntimeError(f"the server does not serve {cfg.model!r} (it serves {sorted(models)})")
    return int(models[cfg.model].get("vocab_size") or DEFAULT_VOCAB)


async def benchmark(cfg: BenchConfig) -> dict:
    from tqdm.auto import tqdm

    limit = cfg.max_concurrency or cfg.num_prompts
    async with http_client(cfg.base_url, limit, cfg.timeout_s) as client:
        requests = make_requests(cfg, await _vocab_size(client, cfg))
        semaphore = asyncio.Semaphore(limit)
        bar = tqdm(total=len(requests), desc="bench serve", unit="req", disable=cfg.disable_tqdm,
                   file=sys.stderr)

        async def one(req: BenchRequest) -> RequestResult:
            async with semaphore:
                result = await _send(client, cfg, req)
            bar.update(1)
            return result

        rng = random.Random(cfg.seed + 1)
        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), cfg.request_rate, cfg.burstiness, rng):
            tasks.append(asyncio.create_task(one(requests[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    summary = summarize(results, duration, cfg.goodput)
    summary.update(num_prompts=cfg.num_prompts, max_concurrency=cfg.max_concurrency,
                   request_rate=cfg.request_rate if not math.isinf(cfg.request_rate) else "inf",
                   model=cfg.model, base_url=cfg.base_url,
                   random_input_len=cfg.random_input_len, random_output_len=cfg.random_output_len,
                   random_prefix_len=cfg.random_prefix_len, random_range_ratio=cfg.random_range_ratio)
    return summary


def run_benchmark(cfg: BenchConfig) -> dict:
    """Synchronous entry point (not from inside a running event loop: use `benchmark`)."""
    return asyncio.run(benchmark(cfg))


def _cmd(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    cfg = BenchConfig(
        base_url=args.base_url, model=args.model, api_key=args.api_key,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len, num_prompts=args.num_prompts,
        max_concurrency=args.max_concurrency, request_rate=args.request_rate,
        burstiness=args.burstiness, seed=args.seed, vocab_size=args.vocab_size,
        goodput=parse_goodput(args.goodput), disable_tqdm=args.disable_tqdm,
    )
    result = run_benchmark(cfg)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_result(result)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["completed"] > 0 else 1


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("serve", help="load a running server over HTTP (streaming)")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--api-key", default=None)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len*(1-r), len*(1+r)]")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of a prefix shared by every prompt (added to the input length)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times (1 = Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="draw prompt ids below this (default: from /v1/models, else 4096)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--save-result", default=None, metavar="FILE", help="also write JSON here")
    p.set_defaults(func=_cmd)
    return p
