"""Replaying a seeded trace against a deployment's pods in real time, open loop: each
request is sent at its arrival time whatever the server is doing (as users do), round
robin over the Ready pods (as a Service spreads them), without streaming; the server's
`Server-Timing` header gives each request's TTFT and TPOT as the engine saw them. Also
the GPUs a deployment's pods hold over time, from the API server.

Results are SimRequest records on the trace's clock, so the simulator's scoring judges a
real-time run exactly as it judges a virtual one."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

import aiohttp

from kvpilot.engine.server.server_timing import parse_server_timing
from kvpilot.engine.fleet.fleet import SimRequest
from kvpilot.engine.fleet.trace import TraceRequest

from background import AsyncWorker

URLS_EVERY_S = 2.0  # how often the Ready pods are re-listed (a Service's endpoints lag too)


class TraceReplayer(AsyncWorker):
    """Sends `trace` from a background thread; `requests` fills in as answers come back.
    `late_s` is how far behind its arrival time each request left this client (it is
    added to the request's TTFT: a user waits for it too)."""

    thread_name = "replay"

    def __init__(self, urls_fn: Callable[[], list[str]], model: str, trace: list[TraceRequest],
                 vocab: tuple[int, int], progress: Callable[[str], None] | None = None,
                 drain_s: float = 600.0) -> None:
        super().__init__()
        self.urls_fn, self.model, self.trace, self.vocab = urls_fn, model, trace, vocab
        self.drain_s = drain_s  # how long answers may still come after the last request is sent
        self.progress = progress
        self.requests: list[SimRequest] = []
        self.late_s: list[float] = []
        self.started: float | None = None

    def start(self, t0: float) -> "TraceReplayer":
        """Arrival 0 is the monotonic time t0 (the caller's, shared with a GpuLedger)."""
        self.started = t0
        self._start()
        return self

    async def _main(self) -> None:
        # aiohttp, as vLLM's own benchmark client: httpx's pool scans every connection for
        # every queued request, which stalls this loop once thousands are in flight. Idle
        # connections close on this side first (uvicorn drops them after 5 s), so no request
        # goes out on a connection the server is closing.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=900)
        urls: list[str] = []
        urls_at = -1e9
        tasks: set[asyncio.Task] = set()
        t0 = self.started
        next_report = t0
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
            for i, req in enumerate(self.trace):
                if self._stop.is_set():
                    break
                delay = t0 + req.arrival - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                now = time.monotonic()
                if now - urls_at > URLS_EVERY_S or not urls:
                    urls = await asyncio.to_thread(self.urls_fn) or urls
                    urls_at = now
                if not urls:
                    self._record(i, req, 0.0, error="no Ready pod")
                    continue
                task = asyncio.create_task(self._one(client, urls[i % len(urls)], i, req, t0))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                if self.progress and now >= next_report:
                    next_report = now + 30
                    self.progress(f"t={now - t0:5.0f}s sent {i + 1}/{len(self.trace)}, "
                                  f"{len(tasks)} in flight, {len(self.requests)} answered")
            # The answers still owed, until the drain deadline (or a stop): what is left then
            # is cancelled, and recorded as failed.
            deadline = time.monotonic() + self.drain_s
            while tasks and not self._stop.is_set() and time.monotonic() < deadline:
                await asyncio.wait(set(tasks), timeout=1.0)
                if self.progress and time.monotonic() >= next_report:
                    next_report = time.monotonic() + 30
                    self.progress(f"t={time.monotonic() - t0:5.0f}s all sent, {len(tasks)} in flight, "
                                  f"{len(self.requests)} answered")
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, client: aiohttp.ClientSession, url: str, i: int, req: TraceRequest, t0: float) -> None:
        late = max(0.0, time.monotonic() - t0 - req.arrival)
        body = {"model": self.model, "prompt": req.token_ids(i, self.vocab), "max_tokens": req.output_len,
                "temperature": 0.0, "ignore_eos": req.ignore_eos, "service_tier": req.service_tier}
        try:
            async with client.post(f"{url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    self._record(i, req, late, error=f"HTTP {resp.status}: {text[:160]}")
                    return
                timing = parse_server_timing(resp.headers.get("server-timing"))
                tokens = (await resp.json())["usage"]["completion_tokens"]
        except asyncio.CancelledError:
            self._record(i, req, late, error="abandoned: still unanswered at the drain deadline")
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._record(i, req, late, error=f"{type(e).__name__}: {e}")
            return
        self._record(i, req, late, output_tokens=tokens, timing=timing)

    def _record(self, i: int, req: TraceRequest, late: float, output_tokens: int = 0,
                timing: dict[str, float] | None = None, error: str | None = None) -> None:
        r = SimRequest(index=i, replica=0, arrival=req.arrival, prompt_len=req.prompt_len,
                       output_tokens=output_tokens, error=error)
        if timing and "ttft" in timing and "e2e" in timing:
            r.first_token = req.arrival + late + timing["ttft"]
            r.finished = req.arrival + late + timing["e2e"]
            r.queue_time = timing.get("queue")
            r.finish_reason = "length"
        elif error is None:
            r.error = "no Server-Timing header in the response"
        self.requests.append(r)
        self.late_s.append(late)


class GpuLedger:
    """(seconds since t0, GPUs held) each time the count of the deployment's pods changes: a
    pod holds its GPU from creation until it is gone, terminating included."""

    def __init__(self, kube, ns: str, selector: str, gpus_per_pod: int = 1, every_s: float = 1.0) -> None:
        self.kube, self.ns, self.selector = kube, ns, selector
        self.gpus_per_pod, self.every_s = gpus_per_pod, every_s
        self.timeline: list[tuple[float, int]] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-ledger", daemon=True)

    def start(self, t0: float) -> "GpuLedger":
        self.t0 = t0
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pods = self.kube.get(f"/api/v1/namespaces/{self.ns}/pods",
                                     params={"labelSelector": self.selector})["items"]
            except Exception:  # an API hiccup: keep the last count, try again next tick
                pods = None
            if pods is not None:
                n = self.gpus_per_pod * sum(1 for p in pods if p["status"].get("phase") not in ("Succeeded", "Failed"))
                # the first count stands from t0 on (the ledger starts just before the trace)
                t = max(0.0, time.monotonic() - self.t0) if self.timeline else 0.0
                if not self.timeline or self.timeline[-1][1] != n:
                    self.timeline.append((t, n))
            self._stop.wait(self.every_s)
