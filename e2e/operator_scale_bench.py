"""The operator at scale, on the local cluster with simulated pods (figures are labelled
simulated): as many LLMDeployments in Auto as this machine holds (target 100), each one
replica of a simulated H100 serving Llama-3.1-8B, with a short resync; then, over a few
autotune intervals, whether every deployment was autotuned every interval, the reconcile
latency (p50/p99 from the operator's histogram), the resync pass duration, the Prometheus
query rate (the operator's count and Prometheus's own), the operator's memory and CPU, and
the memory each simulated pod costs (its RSS, and the host's available memory per pod).

    flock /tmp/kvpilot-e2e.lock .venv/bin/python e2e/operator_scale_bench.py --deployments 100

Starts its own cluster (Prometheus scraping every 5 s: a hundred engine pods scraped every
second would take a core of this 2-core host) and stops it at the end. Deployments are
created in batches; creation stops when a batch does not become Ready in time (the
machine is full) and the figures are taken at the size reached."""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvsession import install_operator, log, run_to_exit_code  # noqa: E402
from localcluster import LocalCluster  # noqa: E402
from scale_fleet import (OPERATOR_NS, QUERIES_PER_SNAPSHOT, Scrape, count_over, fleet, fleet_member,  # noqa: E402
                         last_decision, mean_between, operator_metrics_url, operator_pod, quantile_bound,
                         ready_count)

NAMESPACE = "scale-bench"
RECONCILE = "kvpilot_operator_reconcile_duration_seconds"


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def pod_rss(kube) -> list[float]:
    pods = kube.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
    out = []
    for p in pods:
        ip = p["status"].get("podIP")
        if not ip:
            continue
        try:
            out.append(Scrape.get(f"http://{ip}:8000/metrics").total("process_resident_memory_bytes"))
        except httpx.HTTPError:
            pass
    return out


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cluster: LocalCluster | None = None

    def cleanup(self) -> None:
        if self.cluster is not None and not self.args.keep:
            log("stopping the cluster")
            self.cluster.stop()

    def run(self) -> int:
        a = self.args
        workdir = Path(a.workdir or tempfile.mkdtemp(prefix="kvpilot-scale-"))
        self.cluster = c = LocalCluster(workdir, scrape_interval=f"{a.scrape_s}s")
        free_before_cluster = mem_available()
        c.start()
        install_operator(c, a.resync_s, values={"maxConcurrentReconciles": a.max_concurrent,
                                                "resources.limits.memory": "1Gi"})
        kube = c.kube()
        c.create_namespace(NAMESPACE)
        free_before = mem_available()
        created, t_create = 0, time.monotonic()
        while created < a.deployments:
            batch = min(a.batch, a.deployments - created)
            c.apply([fleet_member(f"sim-{i:03d}", NAMESPACE, c.prometheus_url, f"{a.interval_s}s",
                                  f"{a.window_s}s") for i in range(created, created + batch)])
            created += batch
            deadline = time.monotonic() + a.batch_timeout_s
            while (ready := ready_count(fleet(kube, NAMESPACE))) < created and time.monotonic() < deadline:
                time.sleep(2)  # a script's poll, not a test
            log(f"{ready}/{created} Ready after {time.monotonic() - t_create:.0f}s, host MemAvailable "
                f"{mem_available() / 2**30:.1f} GiB")
            if ready < created:
                log(f"stopping at {ready}: the last batch did not become Ready in {a.batch_timeout_s}s")
                break
        n = ready_count(fleet(kube, NAMESPACE))
        rss = pod_rss(kube)
        free_after = mem_available()
        if a.settle_s:  # the last pods' start-up (about a CPU-second each) out of the figures
            log(f"letting the fleet settle for {a.settle_s}s before measuring "
                f"(load average {Path('/proc/loadavg').read_text().split()[0]})")
            time.sleep(a.settle_s)
        load_before = Path("/proc/loadavg").read_text().split()[0]

        op = operator_pod(kube)
        url = operator_metrics_url(op)
        prom_url = f"{c.prometheus_url}/metrics"
        before, prom_before, t0 = Scrape.get(url), Scrape.get(prom_url), time.time()
        decisions: dict[str, set[float]] = {}
        measure_s = a.measure_intervals * a.interval_s
        while time.time() - t0 < measure_s:
            for o in fleet(kube, NAMESPACE):
                t = last_decision(o)
                if t is not None and t >= t0:
                    decisions.setdefault(o["metadata"]["name"], set()).add(t)
            time.sleep(2)
        after, prom_after, elapsed = Scrape.get(url), Scrape.get(prom_url), time.time() - t0

        per = sorted(len(decisions.get(o["metadata"]["name"], ())) for o in fleet(kube, NAMESPACE))
        gaps = [b - x for ts in decisions.values() for x, b in zip(sorted(ts), sorted(ts)[1:])]
        p50, count = quantile_bound(before, after, RECONCILE, 0.50)
        p99, _ = quantile_bound(before, after, RECONCILE, 0.99)
        timer = (after.total("kvpilot_operator_reconciles_total", trigger="timer")
                 - before.total("kvpilot_operator_reconciles_total", trigger="timer"))
        q = {r: after.total("kvpilot_operator_prometheus_queries_total", reader=r)
             - before.total("kvpilot_operator_prometheus_queries_total", reader=r) for r in ("fleet", "deployment")}
        prom_q = (prom_after.total("prometheus_http_requests_total", handler="/api/v1/query")
                  - prom_before.total("prometheus_http_requests_total", handler="/api/v1/query"))
        cpu = after.total("process_cpu_seconds_total") - before.total("process_cpu_seconds_total")
        conc = dict(after.buckets("kvpilot_operator_reconcile_concurrency"))
        conc0 = dict(before.buckets("kvpilot_operator_reconcile_concurrency"))
        started = conc[math.inf] - conc0.get(math.inf, 0)
        overlapped = started - (conc[1.0] - conc0.get(1.0, 0))
        pass_mean = mean_between(before, after, "kvpilot_operator_resync_duration_seconds")
        api = {m: after.total("kvpilot_operator_api_requests_total", method=m)
               - before.total("kvpilot_operator_api_requests_total", method=m)
               for m in ("GET", "PATCH", "DELETE", "POST")}
        api_line = ", ".join(f"{m} {v:.0f}" for m, v in api.items() if v)
        skipped = sum(after.total("kvpilot_operator_api_requests_skipped_total", method=m)
                      - before.total("kvpilot_operator_api_requests_skipped_total", method=m)
                      for m in ("PATCH", "DELETE"))
        rows = [
            "operator scale benchmark (simulated pods: h100-80gb/llama-3.1-8b, 1 replica each, Auto)",
            f"  host: {Path('/proc/cpuinfo').read_text().count('processor')} CPUs, "
            f"{free_before_cluster / 2**30:.1f} GiB available before the cluster",
            f"  deployments Ready: {n} of {a.deployments} asked (resync {a.resync_s}s, autotune interval "
            f"{a.interval_s}s, window {a.window_s}s, {a.max_concurrent} concurrent reconciles, "
            f"Prometheus scrape {a.scrape_s}s)",
            f"  simulated pod memory: engine RSS mean {statistics.mean(rss) / 2**20:.0f} MiB, max "
            f"{max(rss) / 2**20:.0f} MiB over {len(rss)} pods; host MemAvailable fell "
            f"{(free_before - free_after) / 2**20 / max(n, 1):.0f} MiB per pod (container, shim, pause)"
            if rss else "  simulated pod memory: no pod answered",
            f"  measured over {elapsed:.0f}s ({a.measure_intervals} autotune intervals), {a.settle_s}s after the "
            f"last batch was Ready; host load average {load_before} at the start, "
            f"{Path('/proc/loadavg').read_text().split()[0]} at the end:",
            f"    autotune decisions per deployment: min {per[0] if per else 0}, max {per[-1] if per else 0} "
            f"(expected about {a.measure_intervals}); longest gap between a deployment's decisions "
            f"{max(gaps) if gaps else float('nan'):.0f}s",
            f"    resync reconciles: {timer:.0f} ({timer / max(n, 1) / (elapsed / a.resync_s):.2f} per deployment "
            f"per resync period); mean resync pass {pass_mean:.2f}s",
            f"    reconcile latency ({count} passes): p50 <= {p50}s, p99 <= {p99}s (histogram bucket bounds); "
            f"over 0.5s: {count_over(before, after, RECONCILE, 0.5)}, over 0.75s: "
            f"{count_over(before, after, RECONCILE, 0.75)}, over 1s: {count_over(before, after, RECONCILE, 1.0)}",
            f"    reconciles that started while another ran: {overlapped:.0f} of {started:.0f}",
            f"    Kubernetes API requests from the reconciles: {sum(api.values()) / elapsed:.1f}/s, "
            f"{sum(api.values()) / max(count, 1):.1f} per reconcile ({api_line}); {skipped:.0f} applies and "
            f"deletes not sent (unchanged)",
            f"    Prometheus queries: operator {q['fleet']:.0f} fleet + {q['deployment']:.0f} per-deployment "
            f"= {(q['fleet'] + q['deployment']) / elapsed:.1f}/s; Prometheus served {prom_q / elapsed:.1f} "
            f"/api/v1/query requests/s (per-deployment reads would be {n * QUERIES_PER_SNAPSHOT / a.interval_s:.0f}/s)",
            f"    operator: RSS {after.total('process_resident_memory_bytes') / 2**20:.0f} MiB, "
            f"CPU {100 * cpu / elapsed:.0f}% of one core",
        ]
        print("\n".join(rows), flush=True)
        if a.output:
            Path(a.output).write_text("\n".join(rows) + "\n")
        c.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        c.kubectl("delete", "namespace", OPERATOR_NS, "--wait=false", check=False)
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deployments", type=int, default=100)
    p.add_argument("--batch", type=int, default=25)
    p.add_argument("--batch-timeout-s", type=float, default=300)
    p.add_argument("--resync-s", type=int, default=5)
    p.add_argument("--interval-s", type=int, default=20)
    p.add_argument("--window-s", type=int, default=60)
    p.add_argument("--measure-intervals", type=int, default=3)
    p.add_argument("--max-concurrent", type=int, default=8)
    p.add_argument("--scrape-s", type=int, default=5)
    p.add_argument("--settle-s", type=int, default=60,
                   help="seconds to wait after the last batch is Ready before measuring")
    p.add_argument("--workdir", default=None)
    p.add_argument("--output", default=None, help="also write the figures to this file")
    p.add_argument("--keep", action="store_true", help="leave the cluster running")
    return run_to_exit_code(Bench(p.parse_args(argv)), "the operator scale benchmark")


if __name__ == "__main__":
    sys.exit(main())
