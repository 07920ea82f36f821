"""Command line: python -m localcluster {up,down,status,build} [--dir DIR]
(run with e2e/ on sys.path; `make cluster-up` / `make cluster-down` do)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .build import (BuildError, ensure_binaries, ensure_images, ensure_keda, ensure_node_binaries, ensure_prometheus,
                    ensure_prometheus_operator)
from .cluster import ClusterError, LocalCluster
from .paths import REPO_ROOT


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m localcluster", description=__doc__)
    ap.add_argument("command", choices=["up", "down", "status", "build"])
    ap.add_argument("--dir", type=Path, default=REPO_ROOT / ".cluster",
                    help="work folder (default: .cluster at the repository root)")
    args = ap.parse_args()
    if args.command == "build":
        t = time.monotonic()
        try:
            print(ensure_binaries(), *ensure_node_binaries().values(), ensure_prometheus(),
                  ensure_prometheus_operator(), ensure_keda(),
                  *(path for _, path in ensure_images()), f"({time.monotonic() - t:.0f}s)")
        except BuildError as e:
            print(f"cluster-build failed: {e}", file=sys.stderr)
            return 1
        return 0
    state = args.dir / "state.json"
    if args.command == "up":
        try:
            c = LocalCluster(args.dir, detached=True).start()
        except (ClusterError, BuildError) as e:
            print(f"cluster-up failed: {e}", file=sys.stderr)
            return 1
        print(f"Local cluster running (logs in {c.workdir / 'logs'}, pod logs under {c.pods_dir}).")
        print(f"Use it with:\n  export KUBECONFIG={c.kubeconfig} PROMETHEUS_URL={c.prometheus_url}")
        print(f"  {c.bin_dir / 'kubectl'} get nodes      # kubectl {c.state['version']}, also on PATH via cluster.env()")
        return 0
    if not state.exists():
        print(f"no cluster in {args.dir}")
        return 0
    c = LocalCluster.attach(args.dir)
    if args.command == "down":
        c.stop()
        left = c.leftover_processes()
        print("local cluster stopped" + (f"; still running: {left}" if left else ""))
        return 1 if left else 0
    running = {n: p.pid for n, p in c.procs.items() if p.running()}
    print(f"server {c.state.get('server')}, prometheus {c.prometheus_url}, running: {running or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
