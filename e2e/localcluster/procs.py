"""Background processes with pid files, so that exactly the processes a
cluster started (and nothing else) can be found and stopped later, even from
another Python process (`make cluster-down`).

Every process of a cluster carries KVPILOT_CLUSTER_ID=<id> in its environment
(children inherit it), which lets `tagged_processes` find stragglers."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CLUSTER_ID_ENV = "KVPILOT_CLUSTER_ID"


def start_time(pid: int) -> str | None:
    """The kernel's start time of a process (field 22 of /proc/PID/stat): a pid
    plus its start time names one process, even after pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def alive(pid: int, started: str | None = None) -> bool:
    st = start_time(pid)
    if st is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    if state in ("Z", "X"):
        return False
    return started is None or st == started


def _die_with_parent() -> None:
    """preexec_fn: new session, and SIGTERM when the spawning thread dies."""
    os.setsid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Proc:
    """One managed process; its pid file is JSON {pid, started, name, argv}."""

    name: str
    pidfile: Path
    pid: int
    started: str | None
    popen: subprocess.Popen | None = None

    @classmethod
    def spawn(cls, name: str, argv: list[str], *, pidfile: Path, logfile: Path,
              env: dict[str, str], cwd: Path | None = None, detached: bool = False) -> "Proc":
        logfile.parent.mkdir(parents=True, exist_ok=True)
        with open(logfile, "ab") as log:
            popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=cwd,
                # Detached processes (make cluster-up) outlive their starter; attached
                # ones (pytest fixtures) get SIGTERM if the starter dies.
                start_new_session=detached, preexec_fn=None if detached else _die_with_parent,
            )
        proc = cls(name, pidfile, popen.pid, start_time(popen.pid), popen)
        pidfile.parent.mkdir(parents=True, exist_ok=True)
        pidfile.write_text(json.dumps({"pid": proc.pid, "started": proc.started,
                                       "name": name, "argv": argv}))
        return proc

    @classmethod
    def load(cls, pidfile: Path) -> "Proc | None":
        try:
            d = json.loads(pidfile.read_text())
        except (OSError, ValueError):
            return None
        return cls(d["name"], pidfile, d["pid"], d.get("started"))

    def running(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return alive(self.pid, self.started)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL after `grace` seconds."""
        if self.running():
            _signal_group(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.running():
                _signal_group(self.pid, signal.SIGKILL)
                deadline = time.monotonic() + 5
                while self.running() and time.monotonic() < deadline:
                    time.sleep(0.05)
        if self.popen is not None:
            try:
                self.popen.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        self.pidfile.unlink(missing_ok=True)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # each managed process leads its own session
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def tagged_processes(cluster_id: str) -> list[int]:
    """Pids of live processes whose environment names this cluster."""
    needle = f"{CLUSTER_ID_ENV}={cluster_id}".encode()
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def kill_tagged(cluster_id: str, grace: float = 3.0) -> list[int]:
    """Last-resort sweep: SIGTERM, then SIGKILL, every process of this cluster."""
    pids = tagged_processes(cluster_id)
    for pid in pids:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and tagged_processes(cluster_id):
        time.sleep(0.05)
    for pid in tagged_processes(cluster_id):
        _signal_group(pid, signal.SIGKILL)
    return pids
