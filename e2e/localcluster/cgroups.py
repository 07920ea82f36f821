"""The node's pods live under one cgroup per cluster (the kubelet's
cgroupRoot) in every cgroup v1 hierarchy. Stopping a cluster kills whatever
is still inside and removes the tree, so no container outlives its cluster
even if containerd or the kubelet died first."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")


def hierarchies() -> list[Path]:
    """The mounted v1 hierarchies (cpu, memory, pids, ..., systemd)."""
    return sorted(p for p in CGROUP_FS.iterdir()
                  if p.is_dir() and (p / "cgroup.procs").exists() and p.name != "unified")


def create(root: str) -> None:
    """The cgroup `root` in every hierarchy (the kubelet requires its cgroupRoot to exist).
    A v1 cpuset cgroup starts with no CPUs and no memory nodes: copy the parent's."""
    for h in hierarchies():
        d = h / root.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        if h.name == "cpuset":
            for f in ("cpuset.cpus", "cpuset.mems"):
                if not (d / f).read_text().strip():
                    (d / f).write_text((d.parent / f).read_text())


def pids_under(root: str) -> set[int]:
    found: set[int] = set()
    for h in hierarchies():
        base = h / root.strip("/")
        if not base.is_dir():
            continue
        # os.walk skips a cgroup removed while it walks (rglob raised, failing a teardown).
        for d, _, files in os.walk(base):
            if "cgroup.procs" in files:
                try:
                    found.update(int(x) for x in Path(d, "cgroup.procs").read_text().split())
                except OSError:
                    pass  # removed between the listing and the read
    return found


def processes_under(root: str, hierarchy: str) -> list[tuple[int, str]]:
    """(pid, cgroup path relative to the hierarchy) of every process under `root`."""
    base = CGROUP_FS / hierarchy
    out = []
    for procs in (base / root.strip("/")).rglob("cgroup.procs"):
        try:
            pids = procs.read_text().split()
        except OSError:
            continue
        rel = "/" + str(procs.parent.relative_to(base)) + "/"
        out.extend((int(p), rel) for p in pids)
    return out


def kill_and_remove(root: str) -> list[int]:
    """SIGKILLs every process under `root` and removes its cgroups; returns the pids killed."""
    pids = sorted(pids_under(root))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while pids_under(root) and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel is tearing them down
    for h in hierarchies():
        base = h / root.strip("/")
        if not base.is_dir():
            continue
        # Deepest first: a cgroup can be removed once it has no children and no tasks. os.walk
        # skips a cgroup the kubelet or runc removes meanwhile (Path.rglob raised
        # FileNotFoundError on that race at a cluster's teardown).
        for dirpath, _, _ in os.walk(base, topdown=False):
            _rmdir(Path(dirpath))
    return pids


def _rmdir(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass  # still has tasks that are exiting; the next stop or start sweeps it
