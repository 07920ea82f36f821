"""SIGTERM ends `kvpilot` while it starts. In a container kvpilot is PID 1, and the kernel
drops a signal that PID 1 has no handler for: without one, a pod deleted while the engine
imports torch, downloads or loads its weights waits out its whole grace period."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvpilot.engine.cli as cli
from kvpilot.engine.bench.serve_process import free_port
from server_harness import wait_for

SLOW_START = ["serve", "--simulate", "h100-80gb", "--simulate-model", "llama-3.1-8b",
              "--simulate-load-seconds", "600"]  # ten minutes of (simulated) weight loading


def test_sigterm_before_the_command_handles_it_is_exit_143_in_one_line(capsys, monkeypatch):
    def starting(args):
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before the next bytecode
        raise AssertionError("still running after SIGTERM")
    args = argparse.Namespace(func=starting, log_level="WARNING", command="starting")
    monkeypatch.setattr(cli, "_parse", lambda argv: (args, "kvpilot starting"))
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main([]) == 143
    assert capsys.readouterr().err.strip() == "kvpilot: terminated (SIGTERM)"
    assert signal.getsignal(signal.SIGTERM) is before  # main() leaves the process as it found it


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="runs kvpilot as PID 1 of a new PID namespace (root and util-linux's unshare)")
def test_as_pid_1_a_starting_server_ends_at_sigterm(tmp_path):
    """As in a pod: kvpilot is PID 1 of its PID namespace, and the signal comes from outside
    it (the container runtime's kill)."""
    kvpilot = Path(sys.executable).with_name("kvpilot")
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", str(kvpilot), *SLOW_START,
                                 "--port", str(free_port())], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "simulating model loading" in log.read_text() or proc.poll() is not None, 60,
                 what="the server to be loading its model")
        assert proc.poll() is None, log.read_text()[-2000:]
        (pid1,) = (int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
        os.kill(pid1, signal.SIGTERM)
        t = time.monotonic()
        proc.wait(timeout=30)
        took = time.monotonic() - t
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    assert proc.returncode == 143 and "kvpilot: terminated (SIGTERM)" in text and "Traceback" not in text, text
    assert took < 10, f"SIGTERM took {took:.1f} s to end a starting server"
