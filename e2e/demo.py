"""`make demo`: kvpilot end to end, from nothing running.

  1. a local Kubernetes (.cluster/; reused when one is already up there; the first
     run on a machine builds etcd, kube-* and Prometheus from source, with progress)
  2. the operator installed from the Helm chart
  3. a tiny LLMDeployment with a 50 ms TPOT objective (autotune.objectives.tpot: each
     user's stream at 20 tokens/s or better) started at max_num_seqs 64, the default:
     with 32 users every decode step serves all 32, and each stream crawls at ~75 ms
     per token
  4. load spread over its pods (32 users back to back); after 25 s of it (one
     metrics window, so the table shows the mis-tuned state first) autotune.mode
     becomes Auto; a live table every few seconds until the autotuner has fixed it (a
     lower max_num_seqs applied, then TPOT p95 within the objective and the diagnosis
     not TPOTBound for 45 s running) or the deadline passes
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
BAD_SEQS = 64  # the operator's default (operator/spec.py)
TPOT_OBJECTIVE_MS = 50
KV_CACHE = "128Mi"  # 32k tokens of the tiny model: the cache never binds, batch width does
ENGINE = {"maxNumSeqs": BAD_SEQS, "maxModelLen": 2048, "maxNumBatchedTokens": 2048, "kvCacheMemory": KV_CACHE}
AUTOTUNE = {"mode": "Auto", "interval": "10s", "window": "20s", "cooldown": "20s",
            "maxNumSeqs": {"min": 2, "max": 64}, "maxModelLen": {"min": 768, "max": 2048},
            "objectives": {"tpot": f"{TPOT_OBJECTIVE_MS}ms"}}
# 32 users, each sending its next request when the last one ends: all 32 run at once
# under max_num_seqs 64, and on two CPU cores each step then takes ~75 ms.
WORKLOAD = ks.Workload(num_requests=400, rate=float("inf"), max_concurrency=32, seed=3,
                       input_min=32, input_max=512, output_min=16, output_max=112)
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
                             # One pod: a second one on the same two CPU cores makes every TPOT
                             # reading noisier, and the demo slower to settle.
                             autoscaling={"minReplicas": 1, "maxReplicas": 1})
        log(f"applying LLMDeployment {NS}/{NAME}: maxNumSeqs {BAD_SEQS} (the default; too wide a batch "
            f"for its {TPOT_OBJECTIVE_MS} ms TPOT objective under 32 users), autotune off for now")
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
                now_ms = self.monitor.samples[-1].tpot_p95_ms if self.monitor.samples else None
                log(f"TPOT p95 {'-' if now_ms is None else f'{now_ms:.0f}'} ms against the {TPOT_OBJECTIVE_MS} ms "
                    f"objective; turning the autotuner on (autotune.mode: Auto)")
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
            good = (s.tpot_p95_ms is not None and s.tpot_p95_ms <= TPOT_OBJECTIVE_MS
                    and s.diagnosis not in ("TPOTBound", None, "NoData")
                    and s.t - (self.monitor.changes[-1].t if self.monitor.changes else 0) >= 15)
            if not good:
                state["fixed_since"] = None
                continue
            if state["fixed_since"] is None:
                state["fixed_since"] = time.monotonic()
                if not state.get("announced"):
                    state["announced"] = True
                    log(f"TPOT is within the objective; watching that it holds for {self.args.settle:.0f}s "
                        "(the autotuner may still widen the batch as far as the objective allows)")
            if time.monotonic() - state["fixed_since"] >= self.args.settle:
                fixed = True
                break
        self.load.stop()
        self.monitor.stop()
        took = time.monotonic() - t_all
        self.monitor.changes = sorted(self.monitor.changes + observed_changes(self.monitor.samples,
                                                                              self.monitor.changes),
                                      key=lambda c: c.t)
        png = write_timeline_png(self.monitor.samples, self.monitor.changes, Path(self.args.out) / "demo-timeline.png",
                                 title=f"kvpilot demo: Auto narrowing max_num_seqs={BAD_SEQS} for a "
                                       f"{TPOT_OBJECTIVE_MS} ms TPOT objective",
                                 phases=[(self.args.warmup, "mode: Auto")],
                                 objectives={"tpot_p95_ms": TPOT_OBJECTIVE_MS})
        sent = len(self.load.results)
        errors = sum(1 for r in self.load.results if r.error)
        print()
        last = self.monitor.samples[-1]
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        if fixed:
            conv = convergence_time([c for c in self.monitor.changes if "maxNumSeqs" in c.change])
            changes = "; ".join(f"t={c.t:.0f}s {c.label()}" for c in self.monitor.changes)
            log(f"FIXED: the autotuner applied {len(self.monitor.changes)} change(s) ({changes}); "
                f"last max_num_seqs change {conv:.0f}s after the load started; TPOT p95 now "
                f"{fmt(last.tpot_p95_ms, '.0f')} ms, max_num_seqs {last.max_num_seqs}, replicas {last.replicas}, "
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
        meets = [r for r in self.load.results if r.error is None and r.tpot is not None]

        def within(a: float, b: float) -> str:
            part = [r for r in meets if a <= r.sent_at < b]
            ok = sum(1 for r in part if r.tpot * 1000 <= TPOT_OBJECTIVE_MS)
            return f"{ok}/{len(part)} requests" if part else "-"
        log(f"streams within {TPOT_OBJECTIVE_MS} ms/token: {within(0, self.args.warmup)} sent mis-tuned, "
            f"{within(max(self.args.warmup, end - 60), end)} sent in the last 60 s")
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
                    help="seconds TPOT must stay within the objective, with no change, to count as fixed (default 45)")
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
