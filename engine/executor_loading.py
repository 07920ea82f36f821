"""Which executor runs the forward pass: the real model, or the simulated accelerator's
timing model (apart from executor.py, whose protocol both implementations import)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config.engine import EngineConfig
    from .core.executor import Executor
    from .core.tokenizer import Tokenizer


def load_executor(config: EngineConfig, clock) -> tuple[Executor, Tokenizer]:
    """The real model (torch, imported only here) or, with `config.simulate`, the timing
    model of an accelerator (no torch, no weights, no KV bytes)."""
    if config.simulate is not None:
        from .sim.executor import SimulatedExecutor

        executor = SimulatedExecutor.load(config, clock)
        return executor, executor.tokenizer
    from .config.model import ModelConfig
    from .worker.model_runner import ModelRunner
    from .loader.source import resolve_model
    from .core.tokenizer import Tokenizer

    model_dir = resolve_model(config.model)
    model_config = ModelConfig.from_dir(model_dir, config.quantization)
    tokenizer = Tokenizer.from_dir(model_dir)
    # gpu_check (and a test) run the multi-process code path with one rank this way: the
    # process group (NCCL on CUDA), the sharded loader and the step protocol, no worker.
    if config.world_size > 1 or os.environ.get("KVPILOT_PARALLEL_EXECUTOR") == "1":
        from .worker.launch import start_parallel

        return start_parallel(config, model_config, str(model_dir)), tokenizer
    return ModelRunner(config, model_config, str(model_dir)), tokenizer
