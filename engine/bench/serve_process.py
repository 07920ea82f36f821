"""A `kvpilot serve` subprocess on a free local port, for benchmarks and tests that need a
server of their own (and its process id, to read its memory from /proc)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

READY_DEADLINE_S = 300.0
STOP_DEADLINE_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a local process (VmRSS in /proc/PID/status); None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class ServeProcess:
    """`kvpilot serve ARGS` on 127.0.0.1 and a free port, logging to `log_path`, with `env`
    added to this process's environment. Use as a context manager: entering launches it and
    waits until /health answers 200, leaving sends SIGTERM (the server drains) and kills it
    if it outlives STOP_DEADLINE_S."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = Path(log_path)
        self.env = env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the server is not started")
        return self.proc.pid

    def launch(self) -> None:
        """Starts the process without waiting for it (wait_ready does)."""
        cmd = [sys.executable, "-m", "kvpilot.engine.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--disable-uvicorn-access-log", *self.args]
        env = {**os.environ, **self.env} if self.env else None
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, deadline_s: float = READY_DEADLINE_S) -> None:
        """Polls /health until it answers 200; raises if the process exits or the deadline passes."""
        import httpx

        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpilot serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # a poll interval under a deadline, not a wait for an outcome
        raise TimeoutError(f"kvpilot serve was not healthy after {deadline_s} s:\n{self.log_tail()}")

    def start(self, deadline_s: float = READY_DEADLINE_S) -> None:
        self.launch()
        try:
            self.wait_ready(deadline_s)
        except BaseException:
            self.stop(signal.SIGKILL)
            raise

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_DEADLINE_S) -> int | None:
        """Sends `sig` and waits up to `timeout` s, then kills; the exit code (None: never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> ServeProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
