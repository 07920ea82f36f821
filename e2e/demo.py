"""`make demo`: kvpilot end to end, from nothing running.

  1. a local Kubernetes (.cluster/; reused when one is already up there; the first
     run on a machine builds etcd, kube-* and Prometheus from source, with progress)
  2. the operator installed from the Helm chart
  3. with REAL_ENGINE=1 (or --real-engine), the real engine: builtin:tiny on this CPU
     answers one completion (that pod runs the engine image, torch and all: building it
     the first time adds about ten minutes, so the default story leaves it out)
  4. a SIMULATED H100 80GB serving Llama-3.1-8B (the real scheduler, KV cache manager,
     server, metrics, operator, Prometheus and Kubernetes; only the forward pass is a
     timing model), started with max_num_seqs 8 and loaded by 48 users; after one
     metrics window autotune.mode becomes Auto, and a live table shows the autotuner
     raising max_num_seqs until nobody waits (see demo_story.py)
  5. the timeline PNG written; everything torn down (KEEP=1 leaves it running and
     prints how to look around)

The story is the same on any machine: the simulated GPU's step times come from its
timing model, not from this host's speed (the summary says if the host fell behind).
Ctrl-C at any point stops the load and tears down what the demo started."""
from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvsession as ks  # noqa: E402
from demo_story import FULL, NS, SIM_NAME, Story  # noqa: E402
from kvsession import log  # noqa: E402


def _interrupt(*_):
    raise KeyboardInterrupt


class Demo:
    def __init__(self, args):
        self.args = args
        self.cluster = None
        self.started_cluster = False
        self.story: Story | None = None
        self.keep = args.keep

    def run(self) -> int:
        t_all = time.monotonic()
        targets = ("operator", "engine") if self.args.real_engine else ("operator",)
        self.cluster, self.started_cluster = ks.open_cluster(Path(self.args.cluster_dir), targets)
        ks.install_operator(self.cluster, values={"gateway.enabled": "true"})
        timing = replace(FULL, deadline_s=self.args.deadline, settle_s=self.args.settle,
                         warmup_s=self.args.warmup, every_s=self.args.every)
        self.story = Story(self.cluster, timing, Path(self.args.out), via_gateway=True,
                           real_engine=self.args.real_engine)
        result = self.story.run()
        print()
        for line in result.summary:
            log(line)
        log(f"demo took {(time.monotonic() - t_all) / 60:.1f} min")
        return 0 if result.fixed else 1

    def cleanup(self) -> None:
        if self.story is not None:
            self.story.stop()
        if self.cluster is None:
            return
        if self.keep:
            print(f"\nKEEP=1: left running. Look around with:\n"
                  f"  export KUBECONFIG={self.cluster.kubeconfig} PATH={self.cluster.bin_dir}:$PATH\n"
                  f"  kubectl get llmd -n {NS}\n"
                  f"  kubectl get llmd {SIM_NAME} -n {NS} -o jsonpath='{{.status.autotune}}'\n"
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
    ap.add_argument("--deadline", type=float, default=float(os.environ.get("DEMO_DEADLINE", FULL.deadline_s)),
                    help=f"seconds of load before giving up (default {FULL.deadline_s:.0f})")
    ap.add_argument("--every", type=float, default=FULL.every_s, help="seconds between table rows")
    ap.add_argument("--settle", type=float, default=FULL.settle_s,
                    help=f"seconds nobody may wait, with no change, to count as fixed (default {FULL.settle_s:.0f})")
    ap.add_argument("--warmup", type=float, default=FULL.warmup_s,
                    help=f"seconds of load, mis-tuned, before autotune.mode becomes Auto (default {FULL.warmup_s:.0f})")
    ap.add_argument("--real-engine", action="store_true",
                    default=os.environ.get("REAL_ENGINE", "") not in ("", "0"),
                    help="first, the real engine on this CPU answers one completion (builds the engine "
                         "image, several GB, on first use; also REAL_ENGINE=1)")
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
    except ks.SETUP_FAILURES as e:
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
