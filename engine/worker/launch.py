"""Start a multi-process engine: check the split, start the other ranks, load rank 0's
shard in this process, and collect what every rank loaded."""

from __future__ import annotations

import atexit
import logging

from ..config.engine import EngineConfig
from ..config.model import ModelConfig
from ..parallel.sharding import check_divisible
from .ranks import WorkerProcesses

log = logging.getLogger("kvpilot.engine")


def start_parallel(config: EngineConfig, model_cfg: ModelConfig, model_dir: str):
    """Rank 0's ModelRunner, with the other ranks running in worker processes."""
    from .model_runner import ModelRunner

    if config.quantization is not None:
        raise ValueError(f"quantization={config.quantization!r}: the sharded loader reads float weights "
                         "only; serve a quantized model on one rank")
    if model_cfg.checkpoint_quantization is not None:
        raise ValueError("tensor_parallel_size/pipeline_parallel_size > 1: a quantized checkpoint is "
                         "not read by the sharded loader (float weights only); serve it on one rank")
    check_divisible(model_cfg, config.tensor_parallel_size, config.pipeline_parallel_size)
    workers = WorkerProcesses(config, model_cfg, model_dir)
    atexit.register(workers.shutdown)
    try:
        runner = ModelRunner(config, model_cfg, model_dir, workers.group)
        runner.workers = workers
        runner.rank_reports = workers.reports(runner)
    except BaseException:
        workers.shutdown()
        raise
    runner.weight_bytes = (sum(r["weight_bytes"] for r in runner.rank_reports)
                           + (runner.draft.weight_bytes if runner.draft is not None else 0))
    for r in runner.rank_reports:
        log.info("rank %d: %d layers, %d KV heads, %.1f MiB of weights, %.1f MiB read from the checkpoint",
                 r["rank"], r["layers"], r["kv_heads"], r["weight_bytes"] / 2**20,
                 (r["load_bytes_read"] or 0) / 2**20)
    return runner
