"""The driver's side of a multi-process engine: starts ranks 1..N-1, joins them as rank 0,
sends each step once, and watches the processes. A rank that exits while the engine runs
is a fatal fault of the whole engine (its layers or heads are gone): `failure` says which,
and the server turns /health to 503 and exits non-zero (Kubernetes restarts the pod)."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time

import torch

from ..core.executor import EngineDeadError
from ..parallel.group import Layout, ParallelGroup, free_port, tensor_slot_bytes
from .parallel_step import run_parallel_step

log = logging.getLogger("kvpilot.engine")

START_TIMEOUT_S = 600.0  # joining the group; loading a large shard comes after it


class WorkerProcesses:
    def __init__(self, config, model_cfg, model_dir: str) -> None:
        self.layout = Layout(0, config.tensor_parallel_size, config.pipeline_parallel_size)
        self.failure: str | None = None
        self._stopping = False
        init_method = f"tcp://127.0.0.1:{free_port()}"
        settings = pickle.dumps((config, model_dir))
        # A fresh interpreter per rank: never fork a process holding torch's threads, and
        # (unlike multiprocessing's spawn) never re-run the caller's __main__.
        self.processes = []
        for r in range(1, self.layout.world_size):
            p = subprocess.Popen([sys.executable, "-m", "kvpilot.engine.worker.rank", str(r),
                                  init_method, str(os.getpid())], stdin=subprocess.PIPE)
            p.stdin.write(settings)
            p.stdin.close()
            self.processes.append(p)
        self._exited = threading.Event()
        for p in self.processes:
            threading.Thread(target=self._wait_for, args=(p,), name=f"kvpilot-rank-watch-{p.pid}",
                             daemon=True).start()
        log.info("started %d worker processes (ranks 1..%d, pids %s)", len(self.processes),
                 len(self.processes), ", ".join(str(p.pid) for p in self.processes))
        self.group = self._join(config, init_method, tensor_slot_bytes(config, model_cfg))
        self.group.alive = lambda: self.failure is None and self._dead() is None

    def _join(self, config, init_method: str, slot_bytes: int) -> ParallelGroup:
        """Rank 0's join, while watching the workers: one that dies while starting is an
        error naming it, not a wait for the rendezvous' timeout."""
        from .device import pick_device

        device = pick_device(config.device)
        if device.type == "cuda":
            device = torch.device("cuda", 0)
        box: dict = {}

        def join() -> None:
            try:
                box["group"] = ParallelGroup.join(self.layout, init_method, device, slot_bytes)
            except Exception as exc:  # reported below
                box["error"] = exc

        thread = threading.Thread(target=join, name="kvpilot-rank-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while thread.is_alive():
            dead = self._dead()
            if dead:
                self.shutdown()
                raise RuntimeError(f"tensor/pipeline-parallel {dead} while starting; see its log above")
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"the engine's {self.layout.world_size} ranks did not meet within "
                                   f"{START_TIMEOUT_S:g} s")
            self._exited.wait(timeout=0.1)
        if "error" in box:
            self.shutdown()
            raise RuntimeError(f"joining the engine's process group failed: {box['error']}")
        return box["group"]

    def _dead(self) -> str | None:
        for rank, p in enumerate(self.processes, start=1):
            if p.poll() is not None:
                return f"rank {rank} (pid {p.pid}) exited with code {p.returncode}"
        return None

    def _wait_for(self, process: subprocess.Popen) -> None:
        process.wait()
        self._exited.set()
        if self._stopping or self.failure is not None:
            return
        self.failure = self._dead() or "a rank exited"
        log.error("engine failed: %s; every rank holds part of every step, so the engine "
                  "cannot go on without it", self.failure)

    # --- what rank 0 sends ---------------------------------------------------------
    def run_step(self, runner, step) -> torch.Tensor | None:
        """Send the step to every rank, run rank 0's part; the logits. Any failure here is
        the engine's: the other ranks may be waiting inside a collective rank 0 left."""
        self._check()
        try:
            self.group.broadcast_object(("step", step.for_ranks()))
            return run_parallel_step(runner, step)
        except Exception as exc:
            # A dead peer breaks the collective a moment before its exit is seen: name it.
            self._exited.wait(timeout=1.0)
            if self.failure is None:
                self.failure = self._dead() or f"rank 0's part of a step failed: {type(exc).__name__}: {exc}"
            raise EngineDeadError(f"engine failed: {self.failure}") from exc

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._check()
        self.group.broadcast_object(("allocate", num_blocks))

    def kv_cache_budget(self, runner) -> int:
        """The engine's KV bytes on CUDA: the smallest rank's budget on every rank."""
        self._check()
        self.group.broadcast_object(("budget",))
        return self.group.all_reduce_min(runner.rank_kv_cache_budget()) * self.layout.world_size

    def reports(self, runner) -> list[dict]:
        """Every rank's `rank_report()`, by rank."""
        self._check()
        self.group.broadcast_object(("report",))
        return self.group.gather_to_driver(runner.rank_report())

    def _check(self) -> None:
        if self.failure is not None:
            raise EngineDeadError(f"engine failed: {self.failure}")

    def shutdown(self) -> None:
        """Stop every rank: ask, then wait briefly, then kill."""
        if self._stopping:
            return
        self._stopping = True
        group = getattr(self, "group", None)
        if group is not None and self.failure is None:
            try:
                group.broadcast_object(("stop",))
            except Exception as exc:  # a rank already gone: kill the rest below
                log.warning("stopping ranks: %s", exc)
        # Asked to stop, ranks exit at once; after a failure the rest may sit in a collective
        # that never completes: no grace then.
        deadline = time.monotonic() + (5.0 if self.failure is None else 0.0)
        for p in self.processes:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5.0)
        if group is not None:
            group.close()
