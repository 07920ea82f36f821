"""`make demo`: kvpilot end to end, from nothing running.

  1. a local Kubernetes (.cluster/; reused when one is already up there; the first
     run on a machine builds etcd, kube-* and Prometheus from source, with progress)
  2. the operator installed from the Helm chart
  3. a tiny LLMDeployment started with max_num_seqs far too high for its 4 MiB KV
     cache, so under load the engine keeps preempting
  4. load spread over its pods (32 users back to back); after 25 s of it (one
     metrics window) autotune.mode becomes Auto; a live table every few seconds
     until the autotuner has fixed it (a change applied, preemptions near zero, diagnosis no
     longer PreemptionBound) or the deadline passes
  5. the timeline PNG written; everything torn down (KEEP=1 leaves it running and
     prints how to look around)

Ctrl-C at any point stops the load and tears down what the demo started."""
from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvsession as ks  # noqa: E402
from kvsession import log  # noqa: E402
from timeline import convergence_time, observed_changes, write_timeline_png  # noqa: E402

NS = "kvpilot-demo"
NAME = "tiny"
BAD_SEQS = 32
KV_CACHE = "4Mi"  # 1024 tokens of the tiny model: three or four of the demo's requests
ENGINE = {"maxNumSeqs": BAD_SEQS, "maxModelLen": 1024, "maxNumBatchedTokens": 1024, "kvCacheMemory": KV_CACHE}
AUTOTUNE = {"mode": "Auto", "interval": "10s", "window": "20s", "cooldown": "20s",
            "maxNumSeqs": {"min": 2, "max": 64}, "maxModelLen": {"min": 768, "max": 1024}}
# 32 users, each sending its next request when the last one ends: all 32 fit under
# max_num_seqs, none fit in the cache together.
WORKLOAD = ks.Workload(num_requests=400, rate=float("inf"), max_concurrency=32, seed=3,
                       input_min=32, input_max=256, output_min=64, output_max=192)
PREEMPT_FIXED = 0.1  # preemptions/s over the monitor's window
POLL_S = 1.0  # how often the demo's main loop checks the monitor's latest sample


def _interrupt(*_):
    raise KeyboardInterrupt


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


class Demo:
    def __init__(self, args):
        self.args = args
        self.cluster = self.kube = None
        self.started_cluster = False
        self.load = self.monitor = None
        self.keep = args.keep
        self.ok = False

    def run(self) -> int:
        from kvpilot.operator.autotune import TABLE_HEADER, format_table_row
        t_all = time.monotonic()
        self.cluster, self.started_cluster = ks.open_cluster(Path(self.args.cluster_dir))
        self.kube = self.cluster.kube()
        ks.install_operator(self.cluster)
        self.cluster.kubectl("delete", "llmd", NAME, "-n", NS, "--wait=true", "--timeout=60s", check=False)
        m = ks.llmd_manifest(NS, NAME, ENGINE, {**AUTOTUNE, "mode": "Off",
                                                "prometheus": {"url": self.cluster.prometheus_url}},
                             autoscaling={"minReplicas": 1, "maxReplicas": 2})
        log(f"applying LLMDeployment {NS}/{NAME}: maxNumSeqs {BAD_SEQS} (deliberately too high "
            f"for a {KV_CACHE} KV cache = 1024 tokens), maxModelLen 1024, autotune off for now")
        ks.deploy(self.cluster, self.kube, m)

        log(f"driving load: {WORKLOAD.describe()} (spread over the pods' addresses)")
        self.load = ks.LoadDriver(lambda: ks.pod_urls(self.kube, NS, NAME), NAME, WORKLOAD,
                                  loop_forever=True).start()
        state = {"last_time": None, "rows": 0, "fixed_since": None}
        print(TABLE_HEADER, flush=True)

        def row(s, at):
            last = (at.get("lastDecision") or {})
            new = last.get("time") != state["last_time"]
            state["last_time"] = last.get("time")
            d = decision_from_status(at, new and state["rows"] > 0)
            state["rows"] += 1
            print(format_table_row(time.time(), self.monitor.last_snapshot, s.max_num_seqs or 0,
                                   s.max_model_len or 0, s.replicas or 0, d), flush=True)
        self.monitor = ks.Monitor(self.cluster, self.kube, NS, NAME, every_s=self.args.every,
                                  window_s=15, on_row=row).start()
        deadline = time.monotonic() + self.args.deadline
        auto_at = time.monotonic() + self.args.warmup
        fixed = auto_on = False
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            if not auto_on and time.monotonic() >= auto_at:
                # Signals first settle under load over one window, then the autotuner takes over.
                log("the deployment is preempting under load; turning the autotuner on (autotune.mode: Auto)")
                self.cluster.kubectl("patch", "llmd", NAME, "-n", NS, "--type=merge",
                                     "-p", '{"spec": {"autotune": {"mode": "Auto"}}}')
                auto_on = True
            if self.load.error:
                raise ks.SetupError(f"the load generator failed: {self.load.error}")
            s = self.monitor.samples[-1] if self.monitor.samples else None
            lowered = any("maxNumSeqs" in c.change and c.change["maxNumSeqs"][1] < BAD_SEQS
                          for c in self.monitor.changes)
            if s is None or not lowered:
                continue
            good = (s.preempt_per_s is not None and s.preempt_per_s < PREEMPT_FIXED
                    and s.diagnosis not in ("PreemptionBound", None, "NoData"))
            if good and s.t - (self.monitor.changes[-1].t if self.monitor.changes else 0) >= 15:
                fixed = True
                break
        if fixed and self.args.settle > 0:
            log(f"preemptions are down; watching {self.args.settle:.0f}s more (the autotuner may now "
                "add a replica for the queue)")
            settle_end = time.monotonic() + self.args.settle
            while time.monotonic() < settle_end and not self.load.error:
                time.sleep(POLL_S)
        self.load.stop()
        self.monitor.stop()
        took = time.monotonic() - t_all
        self.monitor.changes = sorted(self.monitor.changes + observed_changes(self.monitor.samples,
                                                                              self.monitor.changes),
                                      key=lambda c: c.t)
        png = write_timeline_png(self.monitor.samples, self.monitor.changes, Path(self.args.out) / "demo-timeline.png",
                                 title=f"kvpilot demo: Auto fixing max_num_seqs={BAD_SEQS} on a {KV_CACHE} KV cache",
                                 phases=[(self.args.warmup, "mode: Auto")])
        sent = len(self.load.results)
        errors = sum(1 for r in self.load.results if r.error)
        print()
        last = self.monitor.samples[-1]
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        if fixed:
            conv = convergence_time([c for c in self.monitor.changes if "maxNumSeqs" in c.change])
            changes = "; ".join(f"t={c.t:.0f}s {c.label()}" for c in self.monitor.changes)
            log(f"FIXED: the autotuner applied {len(self.monitor.changes)} change(s) ({changes}); "
                f"last max_num_seqs change {conv:.0f}s after the load started; preemptions now "
                f"{fmt(last.preempt_per_s, '.2f')}/s, max_num_seqs {last.max_num_seqs}, replicas {last.replicas}, "
                f"diagnosis {last.diagnosis}")
        else:
            at = self.monitor.status.get("autotune") or {}
            log(f"NOT FIXED within {self.args.deadline:.0f}s: diagnosis {at.get('diagnosis')}"
                + (f" ({at.get('message')})" if at.get("message") else "")
                + f"; {len(self.monitor.changes)} change(s) applied")
        log(f"requests: {sent} finished, {errors} failed")
        done = sorted(r.sent_at + r.latency for r in self.load.results if r.error is None and r.latency)
        end = time.monotonic() - self.load.started

        def rate(a: float, b: float) -> str:
            return f"{sum(1 for t in done if a <= t < b) / (b - a):.2f} req/s" if b > a else "-"
        log(f"throughput: {rate(5, self.args.warmup)} mis-tuned (load start +5s to Auto on), "
            f"{rate(max(self.args.warmup, end - 30), end)} over the last 30 s")
        log(f"timeline: {png}")
        log(f"demo took {took / 60:.1f} min")
        self.ok = fixed
        return 0 if fixed else 1

    def cleanup(self) -> None:
        for part in (self.load, self.monitor):
            if part is not None:
                part.stop()
        if self.cluster is None:
            return
        if self.keep:
            print(f"\nKEEP=1: left running. Look around with:\n"
                  f"  export KUBECONFIG={self.cluster.kubeconfig} PATH={self.cluster.bin_dir}:$PATH\n"
                  f"  kubectl get llmd -n {NS}\n"
                  f"  kubectl get llmd {NAME} -n {NS} -o jsonpath='{{.status.autotune}}'\n"
                  f"  Prometheus: {self.cluster.prometheus_url}\n"
                  f"Stop it with: make cluster-down", flush=True)
            return
        if self.started_cluster:
            log("tearing down the local cluster")
            self.cluster.stop()
            left = self.cluster.leftover_processes()
            log("done; no processes left" if not left else f"still running: {left}")
        else:
            log(f"deleting namespace {NS} (the cluster in {self.cluster.workdir} was already running; left up)")
            self.cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = ks.ROOT
    ap.add_argument("--out", default=str(root / "results"))
    ap.add_argument("--cluster-dir", default=os.environ.get("CLUSTER_DIR", str(root / ".cluster")))
    ap.add_argument("--deadline", type=float, default=float(os.environ.get("DEMO_DEADLINE", 480)),
                    help="seconds of load before giving up (default 480)")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between table rows")
    ap.add_argument("--settle", type=float, default=45.0,
                    help="seconds to keep watching once preemptions are fixed (default 45)")
    ap.add_argument("--warmup", type=float, default=25.0,
                    help="seconds of load, mis-tuned, before autotune.mode becomes Auto (default 25)")
    ap.add_argument("--keep", action="store_true", default=os.environ.get("KEEP", "") not in ("", "0"),
                    help="leave everything running (also KEEP=1)")
    args = ap.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if os.geteuid() != 0:
        print("make demo needs root: the local cluster uses network and mount namespaces", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    demo = Demo(args)
    t0 = time.monotonic()
    try:
        return demo.run()
    except KeyboardInterrupt:
        print()
        log("interrupted; cleaning up")
        return 130
    except (ks.SetupError, ks.ClusterError, TimeoutError) as e:
        log(f"demo failed: {e}")
        if demo.cluster is not None:
            log(f"cluster logs: {demo.cluster.workdir / 'logs'}; pod logs under {demo.cluster.pods_dir}")
        return 1
    finally:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
            demo.cleanup()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        log(f"total {dt.timedelta(seconds=int(time.monotonic() - t0))}")


if __name__ == "__main__":
    sys.exit(main())
