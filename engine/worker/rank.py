"""A worker process: one rank of a tensor/pipeline-parallel engine (ranks 1..N-1; rank 0
is the driver). It joins the process group, loads its shard, then runs what rank 0 sends
until told to stop. It never samples and holds no request state."""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys

log = logging.getLogger("kvpilot.engine")

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL this process when the driver dies (even by SIGKILL): no orphaned ranks."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        pass


def worker_main(config, model_dir: str, rank: int, init_method: str, parent_pid: int) -> None:
    _die_with_parent()
    if os.getppid() != parent_pid:  # the driver died before prctl took effect
        os._exit(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; the driver decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from .device import pick_device
    from ..config.model import ModelConfig
    from .model_runner import ModelRunner
    from ..parallel.group import Layout, ParallelGroup, tensor_slot_bytes
    from .parallel_step import run_parallel_step

    layout = Layout(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    device = pick_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
    model_cfg = ModelConfig.from_dir(model_dir)
    group = ParallelGroup.join(layout, init_method, device, tensor_slot_bytes(config, model_cfg))
    group.alive = lambda: os.getppid() == parent_pid
    runner = ModelRunner(config, model_cfg, model_dir, group)
    with torch.inference_mode():
        while True:
            message = group.broadcast_object()
            kind = message[0]
            if kind == "step":
                run_parallel_step(runner, message[1])
            elif kind == "allocate":
                runner.allocate_kv_cache(message[1])
            elif kind == "budget":
                group.all_reduce_min(runner.rank_kv_cache_budget())
            elif kind == "report":
                group.gather_to_driver(runner.rank_report())
            elif kind == "stop":
                break
            else:
                raise RuntimeError(f"rank {rank}: unknown message {kind!r}")
    group.close()


def main() -> None:
    """`python -m kvpilot.engine.worker.rank RANK INIT_METHOD PARENT_PID`, the engine's
    settings pickled on stdin (a fresh interpreter: nothing of the driver's __main__ runs)."""
    rank, init_method, parent_pid = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    config, model_dir = pickle.load(sys.stdin.buffer)
    worker_main(config, model_dir, rank, init_method, parent_pid)


if __name__ == "__main__":
    main()
