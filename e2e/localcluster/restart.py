"""Fault injection on the control plane: kill -9 one of the cluster's processes (the API
server, say) and start it again with the same command line, environment and log, as a
supervisor (systemd, the kubelet's static pods) would after a crash."""
from __future__ import annotations

import json
import signal
import time

from .kube import Kube
from .procs import Proc, _signal_group, alive
from .waiting import wait_for

HEALTH = {"kube-apiserver": "/readyz"}  # checked through the cluster's admin credentials


def kill_process(cluster, name: str) -> None:
    """SIGKILL the named process (its process group) and wait until it is gone."""
    proc = cluster.procs.get(name) or Proc.load(cluster.workdir / "run" / f"{name}.pid")
    if proc is None:
        raise RuntimeError(f"the cluster has no process {name}")
    _signal_group(proc.pid, signal.SIGKILL)
    if proc.popen is not None:
        proc.popen.wait(timeout=10)
    else:
        wait_for(lambda: not alive(proc.pid, proc.started), timeout=10, interval=0.05,
                 what=f"{name} (pid {proc.pid}) to die")


def start_process(cluster, name: str, timeout: float = 120.0) -> float:
    """Start `name` again from its pid file's command line; seconds until it is healthy."""
    argv = json.loads((cluster.workdir / "run" / f"{name}.pid").read_text())["argv"]
    t0 = time.monotonic()
    cluster._spawn(name, argv)
    path = HEALTH.get(name)
    if path is not None:
        kube = Kube(cluster.credentials(), timeout=5)
        try:
            cluster._wait(name, lambda: kube.http.get(path).status_code == 200, timeout=timeout)
        finally:
            kube.close()
    return time.monotonic() - t0


def restart_process(cluster, name: str, down_s: float = 0.0) -> float:
    """kill -9 `name`, keep it down for `down_s` seconds (polled, not slept blindly: the
    wait ends early if something else starts it), start it again; seconds until healthy."""
    kill_process(cluster, name)
    if down_s > 0:
        deadline = time.monotonic() + down_s
        wait_for(lambda: time.monotonic() >= deadline, timeout=down_s + 1, interval=0.1,
                 what=f"{name} to stay down {down_s}s")
    return start_process(cluster, name)


def restart_apiserver(cluster, down_s: float = 0.0) -> float:
    return restart_process(cluster, "kube-apiserver", down_s)
