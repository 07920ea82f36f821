"""`kvpilot gateway-bench`: the gateway's figures, with engines and a gateway started as
local processes (no cluster needed).

- `prefix`: N engines, a RAG-like workload (D distinct long system prompts, each request
  one of them plus a short question), sent through the gateway once per routing policy
  (fresh engines each time, the same requests in the same order): prefix-cache hit rate
  (the engines' own vllm:prefix_cache_* counters) and TTFT p50/p95 per policy.
- `overhead`: one engine, the same streamed requests at a fixed concurrency straight to
  the engine and then through the gateway (throughput and latency per path), then one run
  of pairs started together, one direct and one through the gateway (bench_paired.py): the
  added latency per request, free of run-to-run noise.

Engines are `kvpilot serve` with the arguments given after `--` (default: a SIMULATED L4
serving Llama-3.1-8B, so every figure from the default is a simulated figure)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvpilot.engine.bench.serve import stream_completion
from kvpilot.engine.bench.serve_stats import summarize
from kvpilot.engine.bench.serve_process import ServeProcess, free_port
from kvpilot.operator.gateway.bench_paired import added_latency, drive_paired, streamed_completion

DEFAULT_ENGINE_ARGS = ["--simulate", "l4", "--simulate-model", "llama-3.1-8b", "--max-model-len", "4096"]
MODEL = "bench"


def metric_sum(text: str, name: str) -> float:
    """Sum of one metric's samples over its label sets in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            rest = line[line.rfind("}") + 1:] if line[len(name)] == "{" else line[len(name):]
            total += float(rest.split()[0])
    return total


class GatewayProcess:
    """`kvpilot gateway --backend MODEL=URLS` on a free port, until the block ends."""

    def __init__(self, backends: list[str], routing: str, log_path: Path, extra: list[str] = (),
                 cpus: set[int] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "kvpilot.engine.cli", "gateway", "--host", "127.0.0.1",
                    "--port", str(self.port), "--routing", routing, *extra,
                    *(a for b in backends for a in ("--backend", b))]
        self.log_path = log_path
        self.cpus = cpus  # sched_setaffinity in the child; None: this process's CPUs
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "GatewayProcess":
        with open(self.log_path, "wb") as log:
            pin = (lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpilot gateway exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("kvpilot gateway did not answer /health within 60 s")
            time.sleep(0.1)  # a poll interval under a deadline

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def engines(n: int, engine_args: list[str], workdir: Path):
    procs = [ServeProcess([*engine_args, "--served-model-name", MODEL], workdir / f"engine-{i}.log")
             for i in range(n)]
    try:
        for p in procs:  # launched together, then waited for: start-ups overlap
            p.launch()
        for i, p in enumerate(procs):
            p.wait_ready()
            print(f"  engine {i + 1}/{n} ready ({p.url})", file=sys.stderr)
        yield procs
    finally:
        for p in procs:
            p.stop()


def rag_requests(seed: int, documents: int, system_tokens: int, question_tokens: int, requests: int,
                 vocab: int = 4096) -> list[tuple[int, list[int]]]:
    """(document index, prompt token ids) per request: one of `documents` fixed system
    prompts, then a fresh question. Token ids, so every engine sees exactly these tokens."""
    rng = random.Random(seed)
    systems = [[rng.randrange(16, vocab) for _ in range(system_tokens)] for _ in range(documents)]
    out = []
    for _ in range(requests):
        d = rng.randrange(documents)
        out.append((d, systems[d] + [rng.randrange(16, vocab) for _ in range(question_tokens)]))
    return out


async def drive(url: str, prompts: list[list[int]], output_tokens: int, rate: float | None,
                concurrency: int, seed: int) -> tuple[list, float]:
    """Streams every prompt (Poisson arrivals at `rate`/s, or as fast as `concurrency` allows)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600)) as client:
        async def one(prompt):
            async with gate:
                return await stream_completion(client, "/v1/completions",
                                               streamed_completion(MODEL, prompt, output_tokens))
        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(one(prompt)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))  # the arrival process, not a wait for a result
            if (i + 1) % 50 == 0:
                print(f"  sent {i + 1}/{len(prompts)}", file=sys.stderr)
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def scrape(urls: list[str]) -> dict[str, float]:
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
             "kvpilot:simulated_overrun_seconds_total")
    totals = dict.fromkeys(names, 0.0)
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        for name in names:
            totals[name] += metric_sum(text, name)
    return totals


def run_prefix(args) -> list[dict]:
    reqs = rag_requests(args.seed, args.documents, args.system_tokens, args.question_tokens, args.requests)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies.split(","):
            print(f"[{policy}] starting {args.replicas} engines and the gateway", file=sys.stderr)
            with engines(args.replicas, args.engine_args, Path(tmp)) as procs:
                backend = f"{MODEL}=" + ",".join(p.url for p in procs)
                with GatewayProcess([backend], policy, Path(tmp) / f"gateway-{policy}.log") as gw:
                    before = scrape([p.url for p in procs])
                    results, duration = asyncio.run(drive(gw.url, [p for _, p in reqs], args.output_tokens,
                                                          args.rate, args.concurrency, args.seed))
                    after = scrape([p.url for p in procs])
                    decisions = httpx.get(gw.url + "/metrics").text
            summary = summarize(results, duration, {})
            queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
            hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
            overrun = (after["kvpilot:simulated_overrun_seconds_total"]
                       - before["kvpilot:simulated_overrun_seconds_total"])
            rows.append({"policy": policy, "hit_rate": hits / queries if queries else 0.0,
                         "ttft_p50_ms": summary["median_ttft_ms"], "ttft_p95_ms": summary["p95_ttft_ms"],
                         "ttft_mean_ms": summary["mean_ttft_ms"], "completed": summary["completed"],
                         "failed": summary.get("failed", 0), "duration_s": duration,
                         "output_tok_s": summary["output_throughput"], "overrun_s": overrun,
                         "spills": metric_sum(decisions, 'kvpilot_gateway_routing_decisions_total{model="bench",'
                                              'reason="prefix_spill"}')})
    return rows


def split_cpus(spec: str, available: set[int]) -> tuple[set[int], set[int]] | None:
    """(the gateway's CPUs, the engine's and the client's) from --gateway-cpus: "auto" gives
    the gateway the lower half of `available` (None with fewer than two: nothing to split),
    "none" splits nothing, else a comma list of CPU numbers, some but not all of
    `available`."""
    if spec == "none":
        return None
    cpus = sorted(available)
    if spec == "auto":
        if len(cpus) < 2:
            return None
        gateway = set(cpus[:len(cpus) // 2])
    else:
        try:
            gateway = {int(c) for c in spec.split(",")}
        except ValueError:
            raise ValueError(f"--gateway-cpus: expected auto, none or CPU numbers like 0,1, got {spec!r}") from None
        if not gateway <= available or gateway == available:
            raise ValueError(f"--gateway-cpus: {spec!r} must name some, not all, of this process's CPUs "
                             f"{','.join(map(str, cpus))}")
    return gateway, available - gateway


def run_overhead(args) -> list[dict]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(16, 4096) for _ in range(args.input_tokens)] for _ in range(args.requests)]
    rows = []
    gateway_cpus = None
    if args.split is not None:
        gateway_cpus, rest = args.split
        os.sched_setaffinity(0, rest)  # this process (the client) and the engine it starts
        if "--cpu-threads" not in args.engine_args:  # torch would size its pool by the host
            args.engine_args = [*args.engine_args, "--cpu-threads", str(len(rest))]
    with tempfile.TemporaryDirectory() as tmp:
        with engines(1, args.engine_args, Path(tmp)) as procs:
            url = procs[0].url
            # Warm-up: one whole unmeasured round (a shorter one left the first measured round
            # ~15 % slower than the rest).
            asyncio.run(drive(url, prompts, args.output_tokens, None, args.concurrency, 0))
            with GatewayProcess([f"{MODEL}={url}"], "prefix", Path(tmp) / "gateway.log", cpus=gateway_cpus) as gw:
                for path, target in (("direct", url), ("gateway", gw.url)) * args.rounds:
                    print(f"[{path}] {len(prompts)} requests at concurrency {args.concurrency}", file=sys.stderr)
                    results, duration = asyncio.run(drive(target, prompts, args.output_tokens, None,
                                                          args.concurrency, 0))
                    s = summarize(results, duration, {})
                    rows.append({"path": path, "e2el_p50_ms": s["median_e2el_ms"], "e2el_p99_ms": s["p99_e2el_ms"],
                                 "ttft_p50_ms": s["median_ttft_ms"], "ttft_p99_ms": s["p99_ttft_ms"],
                                 "output_tok_s": s["output_throughput"], "req_s": s["request_throughput"],
                                 "failed": s.get("failed", 0)})
                print(f"[paired] {len(prompts)} pairs (direct + gateway at once) at concurrency "
                      f"{args.concurrency}", file=sys.stderr)
                pairs = asyncio.run(drive_paired(url, gw.url, MODEL, prompts, args.output_tokens,
                                                 args.concurrency))
                rows.append({"path": "paired", **added_latency(pairs)})
    return rows


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("gateway-bench", help="the gateway's benchmarks (local engine processes)")
    sub = p.add_subparsers(dest="bench", required=True)
    pre = sub.add_parser("prefix", help="prefix-aware vs other routing on N engines, a RAG workload")
    pre.add_argument("--replicas", type=int, default=4)
    pre.add_argument("--documents", type=int, default=50, help="distinct system prompts")
    pre.add_argument("--system-tokens", type=int, default=2048)
    pre.add_argument("--question-tokens", type=int, default=64)
    pre.add_argument("--output-tokens", type=int, default=32)
    pre.add_argument("--requests", type=int, default=600)
    pre.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals per second")
    pre.add_argument("--concurrency", type=int, default=256, help="most requests open at once")
    pre.add_argument("--policies", default="prefix,round-robin,least-loaded")
    pre.add_argument("--seed", type=int, default=0)
    pre.add_argument("--json", type=Path, help="also write the rows here")
    pre.set_defaults(func=_cmd_prefix)
    ovh = sub.add_parser("overhead", help="latency and throughput through the gateway vs straight to the engine")
    ovh.add_argument("--requests", type=int, default=512)
    ovh.add_argument("--concurrency", type=int, default=64)
    ovh.add_argument("--input-tokens", type=int, default=64)
    ovh.add_argument("--output-tokens", type=int, default=32)
    ovh.add_argument("--seed", type=int, default=0)
    ovh.add_argument("--rounds", type=int, default=3,
                     help="direct-then-gateway rounds for throughput (the host's drift between rounds "
                          "is read from the spread)")
    ovh.add_argument("--gateway-cpus", default="auto",
                     help="CPUs for the gateway alone, as its own pod would have them; the engine and the "
                          "client share the rest, alike for both paths (auto: the lower half; none: all "
                          "share all; or e.g. 0)")
    ovh.add_argument("--json", type=Path)
    ovh.set_defaults(func=_cmd_overhead)
    for q in (pre, ovh):
        q.add_argument("engine_args", nargs=argparse.REMAINDER,
                       help="after --: `kvpilot serve` arguments for the engines (default: "
                            + " ".join(DEFAULT_ENGINE_ARGS) + ")")


def _engine_args(args) -> None:
    rest = [a for a in args.engine_args if a != "--"]
    args.engine_args = rest or DEFAULT_ENGINE_ARGS


def _label(args) -> str:
    return "SIMULATED " if "--simulate" in args.engine_args else ""


def _quiet_clients() -> None:
    import logging
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request


def _cmd_prefix(args) -> int:
    _quiet_clients()
    _engine_args(args)
    rows = run_prefix(args)
    print(f"{_label(args)}routing on {args.replicas} replicas ({' '.join(args.engine_args)}): {args.requests} "
          f"requests at {args.rate:g}/s, {args.documents} system prompts of {args.system_tokens} tokens + "
          f"{args.question_tokens}-token questions, {args.output_tokens} output tokens")
    print(f"{'policy':<14}{'hit rate':>10}{'TTFT p50':>11}{'TTFT p95':>11}{'mean':>10}{'out tok/s':>11}"
          f"{'failed':>8}{'spills':>8}{'overrun':>9}")
    for r in rows:
        print(f"{r['policy']:<14}{r['hit_rate']:>10.1%}{r['ttft_p50_ms']:>9.0f}ms{r['ttft_p95_ms']:>9.0f}ms"
              f"{r['ttft_mean_ms']:>8.0f}ms{r['output_tok_s']:>11.1f}{r['failed']:>8}{r['spills']:>8.0f}"
              f"{r['overrun_s']:>8.1f}s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def _cmd_overhead(args) -> int:
    _quiet_clients()
    _engine_args(args)
    try:
        if args.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
        args.split = split_cpus(args.gateway_cpus, os.sched_getaffinity(0))
    except ValueError as err:
        print(f"kvpilot gateway-bench overhead: {err}", file=sys.stderr)
        return 2
    rows = run_overhead(args)
    where = ("gateway on CPU " + ",".join(map(str, sorted(args.split[0]))) + ", engine and client on CPU "
             + ",".join(map(str, sorted(args.split[1]))) if args.split else "engine, gateway and client sharing the CPUs")
    print(f"{_label(args)}gateway overhead, one engine ({' '.join(args.engine_args)}), {args.requests} streamed "
          f"requests at concurrency {args.concurrency}, {args.input_tokens} in / {args.output_tokens} out; {where}")
    print(f"{'path':<9}{'e2e p50':>10}{'e2e p99':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'out tok/s':>11}{'failed':>8}")
    for r in rows[:-1]:
        print(f"{r['path']:<9}{r['e2el_p50_ms']:>8.1f}ms{r['e2el_p99_ms']:>8.1f}ms{r['ttft_p50_ms']:>8.1f}ms"
              f"{r['ttft_p99_ms']:>8.1f}ms{r['output_tok_s']:>11.1f}{r['failed']:>8}")
    tok_s = {path: [r["output_tok_s"] for r in rows[:-1] if r["path"] == path] for path in ("direct", "gateway")}
    direct, via = (sum(v) / len(v) for v in (tok_s["direct"], tok_s["gateway"]))
    print(f"throughput through the gateway {100 * (via / direct - 1):+.1f} % of direct (mean of {args.rounds} "
          f"rounds each; direct rounds {min(tok_s['direct']):.1f}-{max(tok_s['direct']):.1f} tok/s)")
    p = rows[-1]
    print(f"added by the gateway, {p['pairs']} pairs started together (one direct, one through the gateway; "
          f"failed {p['failed_direct']} direct, {p['failed_gateway']} gateway):")
    for what in ("ttft", "e2e"):
        d = p[what]
        print(f"  {what.upper():<5} median {d['median_ms']:+.1f} ms, p1 {d['p1_ms']:+.1f} ms, p99 {d['p99_ms']:+.1f} ms, "
              f"mean {d['mean_ms']:+.1f} ms "
              f"(95% interval {d['mean_ms'] - d['ci95_ms']:+.1f} .. {d['mean_ms'] + d['ci95_ms']:+.1f} ms)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0
