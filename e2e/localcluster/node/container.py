"""One container of a pod, run as a local process (its own session, so that
stopping it stops its children), with restart back-off, probes and the
pieces of a containerStatus."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from .probes import ProbeState

LAUNCHER = Path(__file__).with_name("launch.py")
BACKOFF_START, BACKOFF_MAX = 1.0, 60.0  # the kubelet uses 10s..300s


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _new_session() -> None:
    os.setsid()
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # die with the node agent's thread


class Container:
    def __init__(self, spec: dict, *, init: bool, log_dir: Path):
        self.spec, self.name, self.init = spec, spec["name"], init
        self.log = log_dir / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None
        self.started_at: str | None = None
        self.run_since = 0.0
        self.restart_count = 0
        self.waiting: tuple[str, str] | None = ("ContainerCreating", "")
        self.terminated: dict | None = None
        self.last_terminated: dict | None = None
        self.next_start = 0.0
        self.backoff = BACKOFF_START
        self.kill_reason: str | None = None
        self.startup = ProbeState(spec.get("startupProbe"), initial=None)
        self.readiness = ProbeState(spec.get("readinessProbe"), initial=False)
        self.liveness = ProbeState(spec.get("livenessProbe"), initial=True)

    # --- process ---------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, launch_spec: dict, spec_file: Path, launcher_env: dict[str, str]) -> None:
        spec_file.write_text(json.dumps(launch_spec))
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            log.write(f"==== {now_iso()} start #{self.restart_count}: {launch_spec['argv']}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(LAUNCHER), str(spec_file)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=launcher_env, cwd="/", preexec_fn=_new_session)
        (spec_file.parent / f"{self.name}.pid").write_text(str(self.proc.pid))
        t = time.monotonic()
        self.started_at, self.run_since = now_iso(), t
        self.waiting, self.terminated = None, None
        self.kill_reason = None
        self.startup.reset(t)
        self.readiness.reset(t)
        self.liveness.reset(t)

    def signal(self, sig: int) -> None:
        if self.running:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def reap(self) -> bool:
        """Notices an exit; returns True if the process just ended."""
        if self.proc is None or self.proc.poll() is None:
            return False
        code = self.proc.returncode
        # Children left in the session go with it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        term = {"exitCode": code if code >= 0 else 128 - code,
                "reason": self.kill_reason or ("Completed" if code == 0 else "Error"),
                "startedAt": self.started_at, "finishedAt": now_iso(),
                "containerID": f"process://{self.proc.pid}"}
        if code < 0:
            term["signal"] = -code
        self.terminated, self.proc = term, None
        ran = time.monotonic() - self.run_since
        if ran > 60:
            self.backoff = BACKOFF_START
        return True

    def schedule_restart(self) -> None:
        self.last_terminated, self.terminated = self.terminated, None
        self.restart_count += 1
        self.next_start = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, BACKOFF_MAX)
        self.waiting = ("CrashLoopBackOff", f"back-off {self.backoff / 2:.0f}s restarting failed container")

    # --- status ----------------------------------------------------------
    @property
    def started(self) -> bool:
        return self.running and self.startup.result is True

    @property
    def ready(self) -> bool:
        return self.started and self.readiness.result is True

    def status(self) -> dict:
        st: dict = {"name": self.name, "image": self.spec.get("image", ""), "imageID": "",
                    "ready": self.ready, "restartCount": self.restart_count}
        if not self.init:
            st["started"] = self.started
        if self.running:
            st["state"] = {"running": {"startedAt": self.started_at}}
            st["containerID"] = f"process://{self.proc.pid}"
        elif self.terminated is not None:
            st["state"] = {"terminated": self.terminated}
            st["containerID"] = self.terminated["containerID"]
        else:
            reason, msg = self.waiting or ("ContainerCreating", "")
            st["state"] = {"waiting": {"reason": reason, **({"message": msg} if msg else {})}}
        st["lastState"] = {"terminated": self.last_terminated} if self.last_terminated else {}
        return st
