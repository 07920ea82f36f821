"""`kvpilot bench soak`: thousands of mixed requests against one server, then the checks a
long-lived pod needs: no failed request, no memory growth after warm-up, and nothing left
running, waiting or holding KV blocks at the end.

The server is one already running (`--base-url`) or one this command starts
(`--serve-model`, a `kvpilot serve` subprocess). `run_soak(SoakConfig(...)) -> dict` is the
in-process API; the dict's `passed` is what the exit status says."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .serve import DEFAULT_VOCAB, auth_headers, http_client, served_models
from .soak_client import Outcome, send
from .soak_mix import make_requests
from .soak_report import print_result, summarize
from .serve_process import ServeProcess, rss_bytes

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
ABORTS = ("vllm:request_success_total", {"finished_reason": "abort"})
RSS_METRIC = "process_resident_memory_bytes"
DISCONNECT_LOG = "client disconnected; aborting request"
SETTLE_POLL_S = 0.2


def _flag(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class SoakConfig:
    """Every soak setting once; `kvpilot bench soak` generates its flags from these fields."""

    base_url: str | None = _flag(None, "a running server, e.g. http://127.0.0.1:8000", exclusive="server")
    serve_model: str | None = _flag(None, "start `kvpilot serve --model SERVE_MODEL` on a free local "
                                          "port for the soak (e.g. builtin:tiny)", exclusive="server")
    serve_args: str | None = _flag(None, "more `kvpilot serve` flags for --serve-model, as one string")
    model: str | None = _flag(None, "the served model name (default: the one /v1/models lists)")
    api_key: str | None = _flag(None, "sent as `Authorization: Bearer KEY`")
    num_requests: int = _flag(10_000, "requests to send")
    concurrency: int = _flag(32, "requests in flight at once")
    seed: int = _flag(0, "seed of the request mix")
    max_tokens: int = _flag(16, "most tokens per choice (cancelled requests get at least 16)")
    cancel_fraction: float = _flag(0.05, "share of requests the client disconnects from mid-stream")
    warmup_requests: int | None = _flag(
        None, "requests finished before the warm-up RSS reading (default: 10 %% of the requests)")
    server_pid: int | None = _flag(
        None, "read the server's RSS from /proc/PID/status (default: the started server's, else the "
              f"server's {RSS_METRIC} metric)")
    max_rss_growth_pct: float = _flag(5.0, "most RSS growth from warm-up to the end, in percent")
    settle_timeout_s: float = _flag(30.0, "how long the gauges may take to return to 0 at the end")
    request_timeout_s: float = _flag(300.0, "per-request HTTP timeout")
    log_file: str | None = _flag(None, "the started server's log (default: a temporary file)")
    disable_tqdm: bool = _flag(False, "no progress bar")

    def __post_init__(self) -> None:
        if (self.base_url is None) == (self.serve_model is None):
            raise ValueError("give exactly one of base_url (a running server) or serve_model")
        for name in ("num_requests", "concurrency", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 <= self.cancel_fraction <= 1.0:
            raise ValueError(f"cancel_fraction must be in [0, 1], got {self.cancel_fraction}")
        if self.warmup_requests is None:
            self.warmup_requests = max(1, self.num_requests // 10)
        if not 1 <= self.warmup_requests < self.num_requests:
            raise ValueError(f"warmup_requests must be in [1, num_requests), got {self.warmup_requests}")
        for name in ("max_rss_growth_pct", "settle_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


async def scrape(client) -> dict[tuple[str, tuple], float]:
    """Every /metrics sample as (name, sorted label pairs) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = await client.get("/metrics")
    resp.raise_for_status()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


async def try_scrape(client) -> dict[tuple[str, tuple], float]:
    """scrape(), or no samples when the server does not answer (it died: the soak reports it)."""
    try:
        return await scrape(client)
    except Exception:  # httpx's errors, or a /metrics body that does not parse
        return {}


def metric(samples: dict, name: str, labels: dict | None = None) -> float | None:
    """The sum of `name`'s samples whose labels include `labels`; None when there is none."""
    values = [v for (n, lbls), v in samples.items()
              if n == name and (labels or {}).items() <= dict(lbls).items()]
    return sum(values) if values else None


class MemoryProbe:
    """The server's RSS: /proc/PID/status when it runs here, else its own metric."""

    def __init__(self, client, pid: int | None) -> None:
        self.client, self.pid = client, pid
        self.source = f"/proc/{pid}/status" if pid is not None else RSS_METRIC

    async def read(self) -> int | None:
        if self.pid is not None:
            return rss_bytes(self.pid)
        value = metric(await try_scrape(self.client), RSS_METRIC)
        return int(value) if value is not None else None


async def settle(client, deadline_s: float) -> tuple[dict[str, float | None], float | None]:
    """Poll the gauges until all read 0; (last values, seconds it took or None on timeout)."""
    start = time.monotonic()
    while True:
        samples = await try_scrape(client)
        gauges = {g: metric(samples, g) for g in GAUGES}
        if all(v == 0 for v in gauges.values()):
            return gauges, time.monotonic() - start
        if time.monotonic() - start > deadline_s:
            return gauges, None
        await asyncio.sleep(SETTLE_POLL_S)


async def soak(cfg: SoakConfig, base_url: str, pid: int | None) -> dict:
    from tqdm.auto import tqdm

    headers = auth_headers(cfg.api_key)
    async with http_client(base_url, cfg.concurrency, cfg.request_timeout_s) as client:
        models = await served_models(client, cfg.api_key)
        model = cfg.model or next(iter(models), None)
        if model not in models:
            raise ValueError(f"model: the server does not serve {model!r} (it serves {sorted(models)})")
        requests = make_requests(cfg.num_requests, cfg.seed, model=model,
                                 vocab_size=int(models[model].get("vocab_size") or DEFAULT_VOCAB),
                                 max_tokens=cfg.max_tokens, cancel_fraction=cfg.cancel_fraction)
        memory = MemoryProbe(client, pid)
        aborts_before = metric(await try_scrape(client), *ABORTS) or 0.0
        rss = {"start": await memory.read()}
        checkpoints = {cfg.warmup_requests: "warmup", cfg.num_requests // 2: "middle"}
        trace: list[tuple[int, int | None]] = []
        outcomes: list[Outcome | None] = [None] * len(requests)
        tally: Counter[str] = Counter()
        bar = tqdm(total=len(requests), desc="bench soak", unit="req", disable=cfg.disable_tqdm,
                   file=sys.stderr)
        pending = iter(requests)

        async def worker() -> None:
            for req in pending:  # one shared iterator: each request is taken once
                outcome = outcomes[req.index] = await send(client, req, headers)
                tally[outcome.status] += 1
                done = sum(tally.values())  # counted before any await: unique per request
                if done in checkpoints or done % max(1, cfg.num_requests // 10) == 0:
                    reading = await memory.read()
                    trace.append((done, reading))
                    if done in checkpoints:
                        rss[checkpoints[done]] = reading
                    bar.set_postfix(ok=tally["ok"], failed=tally["failed"], cancelled=tally["cancelled"],
                                    rss_mib=f"{reading / 2**20:.0f}" if reading else "?")
                bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        duration = time.perf_counter() - start
        bar.close()
        gauges, settled_s = await settle(client, cfg.settle_timeout_s)
        rss["end"] = await memory.read()
        aborted = (metric(await try_scrape(client), *ABORTS) or 0.0) - aborts_before
    return summarize(cfg, requests, outcomes, duration=duration, rss=rss, rss_source=memory.source,
                     rss_trace=trace, gauges=gauges, settled_s=settled_s, server_aborted=int(aborted),
                     model=model, base_url=base_url)


def run_soak(cfg: SoakConfig) -> dict:
    """The soak against cfg.base_url, or against a server started for it (and stopped after)."""
    if cfg.base_url is not None:
        return asyncio.run(soak(cfg, cfg.base_url, cfg.server_pid))
    log = Path(cfg.log_file or tempfile.mkstemp(prefix="kvpilot-soak-serve-", suffix=".log")[1])
    server = ServeProcess(["--model", cfg.serve_model, *shlex.split(cfg.serve_args or "")], log)
    print(f"starting kvpilot serve --model {cfg.serve_model} {cfg.serve_args or ''} (log: {log})",
          file=sys.stderr, flush=True)
    with server:
        result = asyncio.run(soak(cfg, server.url, cfg.server_pid or server.pid))
    text = log.read_text(errors="replace")
    tracebacks = text.count("Traceback (most recent call last)")
    result.update(server_log=str(log), server_exit_code=server.proc.returncode,
                  server_log_disconnects=text.count(DISCONNECT_LOG), server_log_tracebacks=tracebacks)
    result["checks"]["no_server_tracebacks"] = tracebacks == 0  # a failed step logs one
    result["passed"] = all(v is not False for v in result["checks"].values())
    return result


def _cmd(args: argparse.Namespace) -> int:
    import logging

    from ..config.flags import dataclass_from_args

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    result = run_soak(dataclass_from_args(SoakConfig, args, ""))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_result(result)
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    from ..config.flags import add_dataclass_flags

    p = bench_subparsers.add_parser("soak", help="many mixed requests (streaming, n, stop, logprobs, "
                                                 "cancels); checks failures, RSS growth, gauges at the end")
    add_dataclass_flags(p, SoakConfig, "")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--save-result", default=None, metavar="FILE", help="also write JSON here")
    p.set_defaults(func=_cmd)
    return p

