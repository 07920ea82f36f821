"""What `make demo` and `make autotune-bench` share: a local cluster (reused from
.cluster/ when one runs there, else started and later stopped), the operator
installed from the Helm chart, one LLMDeployment, load spread over its pods'
addresses, and a monitor that samples the signals and the autotuner's status.

Pods get 10.K.x.y addresses reachable from the host; ClusterIPs are not routed,
so load goes to the pod IPs directly, round-robin, refreshed as replicas change."""
from __future__ import annotations

import asyncio
import math
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import yaml
from kvpilot.engine.bench.serve import stream_completion

sys.path.insert(0, str(Path(__file__).resolve().parent))

from localcluster import LocalCluster, wait_for  # noqa: E402
from localcluster.build import BuildError, ensure_cluster_parts, ensure_images  # noqa: E402
from localcluster.cluster import ClusterError  # noqa: E402
from background import AsyncWorker  # noqa: E402
from timeline import Change, Sample  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvpilot"
OPERATOR_NS = "kvpilot-system"
RELEASE = "kvpilot"
LLMD_PATH = "/apis/serving.kvpilot.dev/v1alpha1/namespaces/{ns}/llmdeployments/{name}"
INSTANCE_LABEL = "serving.kvpilot.dev/llmdeployment"
PROM_LABEL = "serving_kvpilot_dev_llmdeployment"  # the pod label after Prometheus's labelmap


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class SetupError(RuntimeError):
    """A step failed; the message says which and where to look."""


# What a failed set-up step raises (a step, the cluster, a build, a wait): a script logs it
# in one line and exits 1.
SETUP_FAILURES = (SetupError, ClusterError, BuildError, TimeoutError)


def run_to_exit_code(job, what: str) -> int:
    """A benchmark script's main: `job.run()` as the exit code; SIGTERM and Ctrl-C clean up
    and give 130, a failed set-up step is logged and gives 1; `job.cleanup()` always runs."""
    def interrupt(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)
    try:
        return job.run()
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        return 130
    except SETUP_FAILURES as e:
        log(f"{what} failed: {e}")
        return 1
    finally:
        job.cleanup()

# --- cluster ------------------------------------------------------------------------
def open_cluster(workdir: Path, targets: tuple[str, ...] = ("operator", "engine")) -> tuple[LocalCluster, bool]:
    """(cluster, started_here): attaches to a running cluster in `workdir`, else starts
    one there (building the binaries on first use, with progress), with kvpilot's images
    `targets` (ensure_images) imported."""
    if (workdir / "state.json").exists():
        c = LocalCluster.attach(workdir)
        if c.running() and c.state.get("running"):
            log(f"reusing the local cluster in {workdir} (importing this checkout's image if it changed)")
            c.import_images(ensure_images(targets))
            return c, False
    log(f"starting a local cluster in {workdir} (the first run on a machine builds Kubernetes, "
        "containerd, CoreDNS, Prometheus and kvpilot's image: progress below)")
    c = LocalCluster(workdir, detached=True, images=ensure_cluster_parts(targets))
    c.start()
    return c, True


def helm_binary() -> str:
    log("helm: building it if needed (first run only)")
    proc = subprocess.run([str(ROOT / "e2e" / "build-helm.sh")], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SetupError("building helm failed (see the lines above)")
    return proc.stdout.strip().splitlines()[-1]


def operator_pods(kube) -> list[dict]:
    pods = kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/pods",
                    params={"labelSelector": "app.kubernetes.io/name=kvpilot-operator"}, ok404=True)
    return [p for p in (pods or {}).get("items", []) if not p["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))]


def gateway_url(kube, model: str | None = None) -> str | None:
    """The chart's gateway (a Ready pod's URL), once it lists `model` when one is named."""
    pods = kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/pods",
                    params={"labelSelector": "app.kubernetes.io/component=gateway"}, ok404=True)
    for p in (pods or {}).get("items", []):
        if p["metadata"].get("deletionTimestamp") or not p["status"].get("podIP") or not any(
                c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", [])):
            continue
        url = f"http://{p['status']['podIP']}:8000"
        if model is None:
            return url
        try:
            listed = {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=5).json()["data"]}
        except (httpx.HTTPError, ValueError, KeyError):
            continue
        if model in listed:
            return url
    return None


def gateway_ready_replicas(url: str, model: str) -> float | None:
    """The ready replicas of `model` the gateway at `url` routes to (its listing lags the API
    by up to its refresh interval); None while it lists none of that model."""
    m = re.search(rf'^kvpilot_gateway_ready_replicas\{{model="{re.escape(model)}"\}} ([0-9.e+-]+)$',
                  httpx.get(f"{url}/metrics", timeout=10).text, re.M)
    return float(m.group(1)) if m else None


def gateway_sees_no_replica(url: str, model: str) -> bool:
    """The gateway at `url` has no ready replica of `model` to route to (until its listing
    catches up, a draining pod still answers)."""
    return gateway_ready_replicas(url, model) == 0.0


def load_targets(kube, ns: str, name: str, direct: bool = False):
    """Where a benchmark sends its load for `name`: the chart's gateway (one endpoint for every
    model, as clients use kvpilot), or with `direct` each Ready pod of the deployment."""
    if direct:
        return lambda: pod_urls(kube, ns, name)
    url = wait_for(lambda: gateway_url(kube, name), timeout=120, interval=1, what=f"the gateway to route {name}")
    log(f"the load for {name} goes through kvpilot's gateway ({url})")
    return lambda: [url]


def install_operator(cluster: LocalCluster, resync_s: int = 5, values: dict | None = None) -> None:
    """The chart rendered with the built helm and applied (CRD first); waits for the
    operator pod. Re-applying over an earlier install is harmless. `values`: more chart
    values (--set NAME=VALUE)."""
    helm = helm_binary()
    # The gateway only where a test or benchmark asks for it: elsewhere its per-second listing
    # and scraping would be one more load on this small host's timing-sensitive tests.
    values = {"gateway.enabled": "false", **(values or {})}
    extra = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
    out = subprocess.run([helm, "template", RELEASE, str(CHART), "-n", OPERATOR_NS, "--include-crds",
                          "--kube-version", "1.31.0", *cluster.helm_args(),
                          "--set", f"resyncInterval={resync_s}", "--set", "logLevel=INFO", *extra],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SetupError(f"helm template failed: {out.stderr.strip()}")
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    rest = [d for d in docs if d["kind"] != "CustomResourceDefinition"]
    log("installing the chart: CRD, RBAC, operator Deployment")
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(crds))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/llmdeployments.serving.kvpilot.dev")
    cluster.create_namespace(OPERATOR_NS)
    kube = cluster.kube()
    before = {p["metadata"]["uid"] for p in operator_pods(kube)}
    cluster.restore_images()
    cluster.apply(rest)
    if before:  # a reused cluster: restart the operator so it runs this checkout's code
        log("restarting the operator that was already running (so it runs this checkout)")
        cluster.kubectl("rollout", "restart", f"deployment/{RELEASE}", "-n", OPERATOR_NS)

    def ready():
        pods = operator_pods(kube)
        return pods if pods and not ({p["metadata"]["uid"] for p in pods} & before) else None
    try:
        wait_for(ready, timeout=180, interval=1, what="the operator pod to be Ready")
    except TimeoutError:
        r = cluster.kubectl("get", "pods,events", "-n", OPERATOR_NS, check=False)
        raise SetupError(f"the operator did not become Ready in 180s:\n{r.stdout}{r.stderr}") from None
    log("operator Ready")


# --- the LLMDeployment ---------------------------------------------------------------
def llmd_manifest(ns: str, name: str, engine: dict, autotune: dict, replicas: int = 1,
                  autoscaling: dict | None = None, cpu: str = "1", resources: dict | None = None,
                  model: dict | None = None) -> dict:
    return {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"model": model or {"source": "builtin:tiny", "servedName": name}, "engine": engine,
                     "resources": resources or {"gpus": 0, "cpu": cpu, "memory": "1Gi"}, "replicas": replicas,
                     "autoscaling": autoscaling or {"minReplicas": 1, "maxReplicas": 1},
                     "autotune": autotune}}


def get_llmd(kube, ns: str, name: str) -> dict | None:
    return kube.get(LLMD_PATH.format(ns=ns, name=name), ok404=True)


def engine_pods(kube, ns: str, name: str) -> list[dict]:
    pods = kube.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": f"{INSTANCE_LABEL}={name}"})
    return [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp") and p["status"].get("podIP")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]


def pod_urls(kube, ns: str, name: str) -> list[str]:
    return [f"http://{p['status']['podIP']}:8000" for p in engine_pods(kube, ns, name)]


def deploy(cluster: LocalCluster, kube, manifest: dict, timeout: float = 300) -> None:
    ns, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    cluster.create_namespace(ns)
    cluster.apply(manifest)
    want = manifest["spec"].get("replicas", 1)

    def ready():
        obj = get_llmd(kube, ns, name)
        conds = {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or []}
        return conds.get("Ready", {}).get("status") == "True" and len(engine_pods(kube, ns, name)) >= want
    log(f"waiting for LLMDeployment {ns}/{name} to be Ready (engine pods start in ~20-60s)")
    try:
        wait_for(ready, timeout=timeout, interval=1, what=f"LLMDeployment {ns}/{name} to be Ready")
    except TimeoutError:
        r = cluster.kubectl("get", "llmd,deploy,pods,events", "-n", ns, "-o", "wide", check=False)
        o = cluster.kubectl("logs", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=kvpilot-operator", "--prefix",
                            "--tail=30", check=False)
        raise SetupError(f"{ns}/{name} not Ready after {timeout:.0f}s:\n{r.stdout}{r.stderr}\n"
                         f"--- operator log ---\n{o.stdout}{o.stderr}") from None
    log(f"{ns}/{name} Ready: {', '.join(pod_urls(kube, ns, name))}")


def gauge(url: str, name: str) -> float | None:
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def preemptions_total(urls: list[str]) -> dict[str, float]:
    return {u: v for u in urls if (v := gauge(u, "vllm:num_preemptions_total")) is not None}


def set_live(cluster: LocalCluster, kube, ns: str, name: str, max_num_seqs: int, max_model_len: int,
             timeout: float = 120) -> None:
    """A static setting through the spec (the operator writes the ConfigMap; pods keep
    running); returns once every pod reports it in its kvpilot: gauges."""
    cluster.kubectl("patch", "llmd", name, "-n", ns, "--type=merge", "-p",
                    yaml.safe_dump({"spec": {"engine": {"maxNumSeqs": max_num_seqs, "maxModelLen": max_model_len}}}))

    def took():
        urls = pod_urls(kube, ns, name)
        return urls and all(gauge(u, "kvpilot:max_num_seqs") == max_num_seqs
                            and gauge(u, "kvpilot:max_model_len") == max_model_len for u in urls)
    wait_for(took, timeout=timeout, interval=1,
             what=f"the pods to report max_num_seqs={max_num_seqs} max_model_len={max_model_len}")


# --- load -------------------------------------------------------------------------
@dataclass
class Workload:
    """A fixed, seeded mixed-length workload: prompt and output lengths uniform in
    [input_min, input_max] and [output_min, output_max]; Poisson arrivals at `rate`
    per second with at most `max_concurrency` in flight, or with rate inf a closed
    loop of `max_concurrency` clients each sending its next request when one ends."""
    num_requests: int = 160
    input_min: int = 32
    input_max: int = 512
    output_min: int = 32
    output_max: int = 256
    rate: float = 2.0
    max_concurrency: int = 64
    seed: int = 0
    vocab: int = 4096
    stream: bool = True  # False: one response per request (no per-token HTTP work for the client)

    def requests(self) -> list[tuple[list[int], int]]:
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.num_requests):
            n = rng.randint(self.input_min, self.input_max)
            out.append(([rng.randrange(16, self.vocab) for _ in range(n)],
                        rng.randint(self.output_min, self.output_max)))
        return out

    def describe(self) -> str:
        arrivals = (f"{self.max_concurrency} clients back to back" if math.isinf(self.rate)
                    else f"Poisson {self.rate:g} req/s, <= {self.max_concurrency} in flight")
        return (f"{self.num_requests} requests, input {self.input_min}-{self.input_max} tokens, "
                f"output {self.output_min}-{self.output_max} tokens, {arrivals}, seed {self.seed}")


@dataclass
class RequestOutcome:
    sent_at: float
    ttft: float | None = None
    tpot: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
               t0: float, stream: bool = True) -> RequestOutcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    sent_at = time.monotonic() - t0
    if not stream:
        start = time.perf_counter()
        try:
            resp = await client.post(f"{url}/v1/completions", json=body)
        except httpx.HTTPError as e:
            return RequestOutcome(sent_at=sent_at, error=f"{type(e).__name__}: {e}")
        latency = time.perf_counter() - start
        if resp.status_code != 200:
            return RequestOutcome(sent_at=sent_at, latency=latency, error=f"HTTP {resp.status_code}: {resp.text[:200]}")
        return RequestOutcome(sent_at=sent_at, latency=latency,
                              output_tokens=resp.json()["usage"]["completion_tokens"])
    body.update(stream=True, stream_options={"include_usage": True})
    r = await stream_completion(client, f"{url}/v1/completions", body)
    return RequestOutcome(sent_at=sent_at, ttft=r.ttft, tpot=r.tpot, latency=r.latency,
                          output_tokens=r.output_tokens or 0, error=r.error)


class LoadDriver(AsyncWorker):
    """Sends a Workload round-robin over the deployment's Ready pods (re-listed every
    few seconds, so new replicas get traffic) from a background thread."""

    thread_name = "load"

    def __init__(self, urls_fn: Callable[[], list[str]], model: str, workload: Workload,
                 progress: Callable[[int, int], None] | None = None, loop_forever: bool = False):
        super().__init__()
        self.urls_fn, self.model, self.workload = urls_fn, model, workload
        self.progress = progress
        self.loop_forever = loop_forever
        self.results: list[RequestOutcome] = []
        self.started = self.finished = None

    def start(self) -> "LoadDriver":
        self._start()
        return self

    async def _main(self) -> None:
        w = self.workload
        reqs = w.requests()
        rng = random.Random(w.seed + 1)
        sem = asyncio.Semaphore(w.max_concurrency)
        limits = httpx.Limits(max_connections=w.max_concurrency + 8, max_keepalive_connections=w.max_concurrency)
        urls: list[str] = []
        urls_at = -math.inf
        self.started = time.monotonic()
        tasks = []
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=10)) as client:
            async def one(i: int, url: str):
                try:
                    r = await _one(client, url, self.model, *reqs[i % len(reqs)], self.started, w.stream)
                finally:
                    sem.release()
                self.results.append(r)
                if self.progress:
                    self.progress(len(self.results), len(tasks) if self.loop_forever else len(reqs))
            i = 0
            while not self._stop.is_set() and (self.loop_forever or i < len(reqs)):
                if time.monotonic() - urls_at > 3 or not urls:
                    fresh = await asyncio.to_thread(self.urls_fn)
                    urls, urls_at = fresh or urls, time.monotonic()
                    if not urls:
                        await asyncio.sleep(1)
                        continue
                await sem.acquire()  # at most max_concurrency in flight (closed loop when rate is inf)
                tasks.append(asyncio.create_task(one(i, urls[i % len(urls)])))
                i += 1
                if not math.isinf(w.rate):
                    await asyncio.sleep(rng.expovariate(w.rate))
            if self._stop.is_set():
                for t in tasks:
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.finished = time.monotonic()


# --- monitoring -------------------------------------------------------------------
def _num(v):
    return None if v is None else float(v)


class Monitor:
    """Every `every_s` seconds: the signals over the last `window_s` seconds from
    Prometheus (the autotuner's own reader and queries), the settings in effect and the
    autotuner's diagnosis from the LLMDeployment status. Applied decisions (new entries
    in status.autotune.history with applied true) become Changes."""

    def __init__(self, cluster: LocalCluster, kube, ns: str, name: str, every_s: float = 5.0,
                 window_s: float = 15.0, on_row: Callable[[Sample, dict], None] | None = None):
        from kvpilot.operator.autotune import PrometheusReader
        self.reader = PrometheusReader.from_url(cluster.prometheus_url, scrape_interval_s=1.0, label=PROM_LABEL)
        self.kube = cluster.kube()  # its own client: this runs in another thread
        self.ns, self.name = ns, name
        self.last_snapshot = None
        self.every_s, self.window_s = every_s, window_s
        self.on_row = on_row
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.samples: list[Sample] = []
        self.changes: list[Change] = []
        self.status: dict = {}
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def start(self) -> "Monitor":
        self._prime_seen()
        self._thread = threading.Thread(target=self._loop, name="monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)

    def _prime_seen(self) -> None:
        """Decisions applied before this monitor started are not this run's."""
        obj = get_llmd(self.kube, self.ns, self.name) or {}
        for d in (((obj.get("status") or {}).get("autotune") or {}).get("history") or []):
            self._seen.add(_decision_key(d))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as e:  # a missed sample, not a failed run
                self.errors += 1
                if self.errors <= 3:
                    log(f"monitor: {type(e).__name__}: {e}")
            self._stop.wait(self.every_s)

    def sample(self) -> Sample:
        t = time.monotonic() - self.t0
        snap = None
        try:
            snap = self.reader.snapshot(self.ns, self.name, self.window_s)
        except Exception as e:
            self.errors += 1
            if self.errors <= 3:
                log(f"monitor: Prometheus query failed: {e}")
        self.last_snapshot = snap
        obj = get_llmd(self.kube, self.ns, self.name) or {}
        status = obj.get("status") or {}
        self.status = status
        eff = status.get("effective") or {}
        at = status.get("autotune") or {}
        s = Sample(t=round(t, 1),
                   kv_pct=None if snap is None or snap.kv_usage_mean is None else 100 * snap.kv_usage_mean,
                   preempt_per_s=_num(snap and snap.preemptions_per_s),
                   queue_p95_s=_num(snap and snap.queue_time_p95_s),
                   tpot_p95_ms=None if snap is None or snap.tpot_p95_s is None else 1000 * snap.tpot_p95_s,
                   ttft_p95_s=_num(snap and snap.ttft_p95_s),
                   tokens_per_s=_num(snap and snap.generation_tokens_per_s),
                   max_num_seqs=eff.get("maxNumSeqs"), max_model_len=eff.get("maxModelLen"),
                   replicas=eff.get("replicas", status.get("replicas")), diagnosis=at.get("diagnosis"))
        self.samples.append(s)
        for d in at.get("history") or []:
            key = _decision_key(d)
            if key in self._seen:
                continue
            self._seen.add(key)
            if d.get("applied") and d.get("change"):
                self.changes.append(Change(t=max(0.0, _rfc3339(d["time"]) - self.wall0) if d.get("time") else s.t,
                                           change=d["change"], action=d.get("action", "change"),
                                           reason=d.get("reason", "")))
        if self.on_row:
            self.on_row(s, at)
        return s


def _decision_key(d: dict) -> str:
    return f"{d.get('time')}|{d.get('action')}|{sorted((d.get('change') or {}).items())}"


def _rfc3339(text: str) -> float:
    import datetime as dt
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc).timestamp()


__all__ = ["BuildError", "ClusterError", "LoadDriver", "Monitor", "SETUP_FAILURES", "SetupError", "Workload", "run_to_exit_code",
           "deploy", "engine_pods", "get_llmd", "gateway_ready_replicas", "gateway_sees_no_replica", "gateway_url", "install_operator", "load_targets", "llmd_manifest", "log", "open_cluster",
           "pod_urls", "preemptions_total", "set_live", "wait_for"]
