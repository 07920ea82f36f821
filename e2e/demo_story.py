"""The story `make demo` tells, runnable against any local cluster (the demo's own, or
the e2e suite's in tests): a simulated H100 80GB serving Llama-3.1-8B, started with
`max_num_seqs: 8` (a setting copied from somewhere smaller: the KV cache holds more than
fifty 8k-token sequences, yet only 8 may run), loaded by 48 users; the autotuner sees
the cache nearly empty while requests queue (SchedulerBound), raises max_num_seqs step
by step, and throughput rises while the queue disappears. Decode on a GPU reads the
weights once per step whatever the batch, so a wider batch is nearly free: the lever
the CPU never showed. One real-engine pod (builtin:tiny on this CPU) answers a
completion first, so the real engine is in the story too.

Only the accelerator is simulated: the scheduler, KV cache manager, server, metrics,
operator, Prometheus and Kubernetes are the real ones."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import kvsession as ks
from kvsession import log
from timeline import Change, convergence_time, observed_changes, write_timeline_png

NS = "kvpilot-demo"
SIM_NAME = "chat"
REAL_NAME = "tiny"
ACCELERATOR, MODEL = "h100-80gb", "llama-3.1-8b"
BAD_SEQS = 8
USERS = 48
QUEUE_OK_S = 0.5  # queue p95 at or under this reads as "nobody waits" (the autotuner's own level)
SIM_ENGINE = {"maxNumSeqs": BAD_SEQS, "maxModelLen": 8192, "maxNumBatchedTokens": 8192,
              "gpuMemoryUtilization": 0.9, "simulate": {"accelerator": ACCELERATOR, "model": MODEL}}
# A simulated pod needs little of this host: no weights, no KV bytes, no torch. The local
# node offers this host's real CPUs (2 here), and a day's eight replicas must fit on it.
SIM_RESOURCES = {"gpus": 1, "cpu": "100m", "memory": "512Mi"}
REAL_ENGINE = {"maxNumSeqs": 8, "maxModelLen": 1024, "maxNumBatchedTokens": 1024, "kvCacheMemory": "32Mi"}
# 48 users back to back, one response per request (no streaming: the client's HTTP work per
# token would compete with the simulated pod for this host's CPU at H100 token rates).
WORKLOAD = ks.Workload(num_requests=5000, rate=math.inf, max_concurrency=USERS, seed=11,
                       input_min=200, input_max=2000, output_min=100, output_max=400, stream=False)


@dataclass(frozen=True)
class Timing:
    warmup_s: float  # load at the bad setting before autotune.mode becomes Auto
    settle_s: float  # healthy this long, with no change, to count as fixed
    deadline_s: float  # seconds of load before giving up
    every_s: float  # table rows
    monitor_window_s: float
    interval: str  # the autotuner's
    window: str
    cooldown: str


FULL = Timing(20, 30, 600, 5, 15, "5s", "15s", "15s")
# The e2e test of the same story. Fixed once healthy for 12 s after a monitor window (10 s)
# with no change since: at least 22 s, five of the autotuner's 4 s intervals, with nothing to do.
# A change every 16 s: its 8 s cooldown, then a window of eight 1 s scrapes all taken at the
# new setting (every 20 s with a 10 s window).
FAST = Timing(12, 12, 480, 3, 10, "4s", "8s", "8s")


@dataclass
class Result:
    fixed: bool
    changes: list[Change] = field(default_factory=list)
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    overrun_fraction: float | None = None
    png: Path | None = None
    real_answer: str = ""
    summary: list[str] = field(default_factory=list)


def _autotune(timing: Timing, prometheus: str, mode: str) -> dict:
    return {"mode": mode, "interval": timing.interval, "window": timing.window, "cooldown": timing.cooldown,
            "maxNumSeqs": {"min": 4, "max": 256}, "maxModelLen": {"min": 1024, "max": 8192},
            "prometheus": {"url": prometheus}}


def real_engine_answer(cluster, kube) -> str:
    """Deploy builtin:tiny on the real engine (this CPU) and ask it one thing."""
    m = ks.llmd_manifest(NS, REAL_NAME, REAL_ENGINE, {"mode": "Off"}, cpu="500m")
    log(f"applying LLMDeployment {NS}/{REAL_NAME}: the real engine on this CPU (builtin:tiny, 4 layers, "
        f"random weights)")
    ks.deploy(cluster, kube, m)
    url = ks.pod_urls(kube, NS, REAL_NAME)[0]
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": REAL_NAME, "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def decision_from_status(at: dict, new: bool):
    """A kvpilot.operator.autotune Decision for the table row: the last decision when it
    is new since the previous row, else a hold carrying the current diagnosis."""
    from kvpilot.operator.autotune import Action, Decision, Diagnosis
    diag = at.get("diagnosis")
    if not diag:
        return None
    try:
        diagnosis = Diagnosis(diag)
    except ValueError:
        diagnosis = Diagnosis.NO_DATA
    last = at.get("lastDecision") or {}
    snake = {"maxNumSeqs": "max_num_seqs", "maxModelLen": "max_model_len", "replicas": "replicas"}
    if new and last.get("change") and last.get("applied"):
        return Decision(time.time(), diagnosis, Action(last.get("action", "change")), last.get("reason", ""),
                        change={snake.get(k, k): tuple(v) for k, v in last["change"].items()})
    return Decision(time.time(), diagnosis, Action.HOLD, "")


def _window(results, a: float, b: float) -> dict:
    done = [r for r in results if r.error is None and r.latency and a <= r.sent_at + r.latency < b]
    span = max(b - a, 1e-9)
    lat = sorted(r.latency for r in done)
    return {"req_per_s": len(done) / span, "tok_per_s": sum(r.output_tokens for r in done) / span,
            "latency_p50_s": lat[len(lat) // 2] if lat else None, "n": len(done)}


class Story:
    def __init__(self, cluster, timing: Timing, out_dir: Path, via_gateway: bool = False,
                 real_engine: bool = True) -> None:
        """via_gateway: the load goes through the chart's gateway (installed with it on).
        real_engine: first, builtin:tiny on this CPU answers one completion (a pod of the
        engine image, which holds torch: it must be in the cluster)."""
        self.cluster, self.timing, self.out_dir = cluster, timing, Path(out_dir)
        self.via_gateway, self.real_engine = via_gateway, real_engine
        self.kube = cluster.kube()
        self.load: ks.LoadDriver | None = None
        self.monitor: ks.Monitor | None = None

    def stop(self) -> None:
        for part in (self.load, self.monitor):
            if part is not None:
                part.stop()

    def delete(self) -> None:
        """Remove the story's namespace (its pods would otherwise go on using the host)."""
        self.cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)

    def run(self) -> Result:
        from kvpilot.operator.autotune import TABLE_HEADER, format_table_row

        t = self.timing
        result = Result(fixed=False)
        for name in (SIM_NAME, REAL_NAME):
            self.cluster.kubectl("delete", "llmd", name, "-n", NS, "--wait=true", "--timeout=60s", check=False)
        if self.real_engine:
            result.real_answer = real_engine_answer(self.cluster, self.kube)
            log(f"the real engine answered \"The quick brown fox\" with {result.real_answer!r}")

        log(f"SIMULATED accelerator from here on: a {ACCELERATOR} serving {MODEL} (the scheduler, KV cache "
            f"manager, server, metrics, operator, Prometheus and Kubernetes are real; only the GPU's forward "
            f"pass is a timing model)")
        m = ks.llmd_manifest(NS, SIM_NAME, SIM_ENGINE, _autotune(t, self.cluster.prometheus_url, "Off"),
                             resources=SIM_RESOURCES, model={"servedName": SIM_NAME})
        log(f"applying LLMDeployment {NS}/{SIM_NAME}: maxNumSeqs {BAD_SEQS} on a GPU whose KV cache holds "
            f"~450k tokens (more than fifty 8k-token sequences); autotune off for now")
        ks.deploy(self.cluster, self.kube, m)
        url = ks.pod_urls(self.kube, NS, SIM_NAME)[0]
        targets = lambda: ks.pod_urls(self.kube, NS, SIM_NAME)  # noqa: E731
        if self.via_gateway:
            gateway = ks.wait_for(lambda: ks.gateway_url(self.kube, SIM_NAME), timeout=120, interval=1,
                                  what=f"the gateway to route {SIM_NAME}")
            targets = lambda: [gateway]  # noqa: E731
            log(f"the load goes through kvpilot's gateway ({gateway}): one endpoint for every model")
        log(f"driving load: {WORKLOAD.describe()}, non-streaming")
        self.load = ks.LoadDriver(targets, SIM_NAME, WORKLOAD, loop_forever=True).start()
        state = {"last_time": None, "rows": 0}
        print(TABLE_HEADER, flush=True)

        def row(s, at):
            last = at.get("lastDecision") or {}
            new = last.get("time") != state["last_time"]
            state["last_time"] = last.get("time")
            d = decision_from_status(at, new and state["rows"] > 0)
            state["rows"] += 1
            print(format_table_row(time.time(), self.monitor.last_snapshot, s.max_num_seqs or 0,
                                   s.max_model_len or 0, s.replicas or 0, d), flush=True)

        self.monitor = ks.Monitor(self.cluster, self.kube, NS, SIM_NAME, every_s=t.every_s,
                                  window_s=t.monitor_window_s, on_row=row).start()
        start = time.monotonic()
        auto_at, deadline = start + t.warmup_s, start + t.deadline_s
        auto_on, healthy_since = False, None
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if self.load.error:
                raise ks.SetupError(f"the load generator failed: {self.load.error}")
            s = self.monitor.samples[-1] if self.monitor.samples else None
            if not auto_on and time.monotonic() >= auto_at:
                q = "-" if s is None or s.queue_p95_s is None else f"{s.queue_p95_s:.1f}"
                kv = "-" if s is None or s.kv_pct is None else f"{s.kv_pct:.0f}"
                log(f"queue p95 {q} s with the KV cache at {kv} %: requests wait while memory sits idle; "
                    f"turning the autotuner on (autotune.mode: Auto)")
                self.cluster.kubectl("patch", "llmd", SIM_NAME, "-n", NS, "--type=merge",
                                     "-p", '{"spec": {"autotune": {"mode": "Auto"}}}')
                auto_on = True
            raised = any("maxNumSeqs" in c.change and c.change["maxNumSeqs"][1] > BAD_SEQS
                         for c in self.monitor.changes)
            last_change = self.monitor.changes[-1].t if self.monitor.changes else 0.0
            good = (s is not None and raised and s.diagnosis == "Healthy" and s.queue_p95_s is not None
                    and s.queue_p95_s <= QUEUE_OK_S and s.t - last_change >= t.monitor_window_s)
            if not good:
                healthy_since = None
                continue
            if healthy_since is None:
                healthy_since = time.monotonic()
                log(f"nobody waits any more; watching that it holds for {t.settle_s:.0f}s")
            if time.monotonic() - healthy_since >= t.settle_s:
                result.fixed = True
                break
        end = time.monotonic() - start
        self.load.stop()
        self.monitor.stop()
        self._report(result, url, end)
        return result

    def _report(self, result: Result, url: str, end: float) -> None:
        mon, t = self.monitor, self.timing
        result.changes = sorted(mon.changes + observed_changes(mon.samples, mon.changes), key=lambda c: c.t)
        result.png = write_timeline_png(
            mon.samples, result.changes, self.out_dir / "demo-timeline.png",
            title=f"kvpilot demo (SIMULATED {ACCELERATOR}, {MODEL}): Auto raising max_num_seqs={BAD_SEQS}",
            phases=[(t.warmup_s, "mode: Auto")],
            panels=["kv_pct", "queue_p95_s", "ttft_p95_s", "tokens_per_s", "max_num_seqs"])
        results = self.load.results
        result.before = _window(results, 5, t.warmup_s)
        result.after = _window(results, max(t.warmup_s, end - 30), end)
        rss = ks.gauge(url, "process_resident_memory_bytes")
        busy = ks.gauge(url, "kvpilot:simulated_busy_seconds_total")
        over = ks.gauge(url, "kvpilot:simulated_overrun_seconds_total")
        if busy:
            result.overrun_fraction = (over or 0.0) / busy
        last = mon.samples[-1] if mon.samples else None
        lines = result.summary
        if result.fixed:
            conv = convergence_time([c for c in result.changes if "maxNumSeqs" in c.change])
            lines.append(f"FIXED: the autotuner applied {len(result.changes)} change(s) ("
                         + "; ".join(f"t={c.t:.0f}s {c.label()}" for c in result.changes)
                         + f"); the last {conv:.0f}s after the load started; max_num_seqs now "
                         f"{last.max_num_seqs}, diagnosis {last.diagnosis}")
        else:
            at = mon.status.get("autotune") or {}
            lines.append(f"NOT FIXED within {t.deadline_s:.0f}s: diagnosis {at.get('diagnosis')}; "
                         f"{len(result.changes)} change(s) applied")
        b, a = result.before, result.after
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        lines.append(f"throughput (SIMULATED {ACCELERATOR}): {b['req_per_s']:.2f} req/s, {b['tok_per_s']:.0f} "
                     f"output tok/s at max_num_seqs {BAD_SEQS}; {a['req_per_s']:.2f} req/s, {a['tok_per_s']:.0f} "
                     f"tok/s over the last 30 s")
        lines.append(f"request latency p50 (queue + answer): {fmt(b['latency_p50_s'], '.1f')} s before, "
                     f"{fmt(a['latency_p50_s'], '.1f')} s at the end")
        errors = sum(1 for r in results if r.error)
        lines.append(f"requests: {len(results)} finished, {errors} failed")
        if result.overrun_fraction is not None:
            verdict = ("this host kept up with the simulated GPU" if result.overrun_fraction < 0.05 else
                       "WARNING: this host could not keep up with the simulated GPU; figures are slower than modelled")
            lines.append(f"host work past the modelled step ends: {result.overrun_fraction:.1%} of the modelled "
                         f"time ({verdict})")
        if rss:
            lines.append(f"the simulated pod's resident memory after the load: {rss / 2**20:.0f} MiB "
                         f"(no weights, no KV bytes, no torch)")
        lines.append(f"timeline: {result.png}")
