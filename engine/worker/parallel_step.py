"""One step on one rank: its part of the forward pass, and on rank 0 the logits.

Without pipeline stages every rank runs the whole step over its tensor slice (the
all-reduces inside the layers keep their hidden states equal) and the LM head's vocabulary
slices are gathered. With stages the step is cut into micro-batches of whole sequences;
stage s runs micro-batch i while stage s + 1 runs i - 1 (sends do not wait), and the last
stage sends each micro-batch's logits to rank 0. The idle share of a stage is then the
GPipe bubble, (p - 1) / (m + p - 1) for p stages and m micro-batches of equal cost."""

from __future__ import annotations

import time

import torch

from .step_inputs import StepInputs


def micro_batches(configured: int | None, pp_size: int) -> int:
    return configured if configured is not None else pp_size


def run_parallel_step(runner, step: StepInputs) -> torch.Tensor | None:
    """This rank's part of `step`; on rank 0 the logits of `step.logit_rows()`
    ([rows, vocab] float32, None when no row samples), None elsewhere."""
    started = time.perf_counter()
    try:
        return _run(runner, step)
    finally:
        runner.parallel_step_seconds += time.perf_counter() - started


def _run(runner, step: StepInputs) -> torch.Tensor | None:
    group = runner.group
    lay = group.layout
    dev = runner.device
    if lay.pp_size == 1:
        hidden = runner.forward(step, runner.model, runner.kv_caches)  # [num_tokens, hidden]
        rows = step.logit_rows()
        if not rows:
            return None
        logits = runner.model.compute_logits(hidden[torch.tensor(rows, device=dev)])  # [rows, vocab]
        return logits if lay.rank == 0 else None
    cfg = runner.model_cfg
    parts = step.split(micro_batches(runner.config.pipeline_micro_batches, lay.pp_size))
    pending = []  # sends in flight: their tensors stay referenced until they complete
    idle = 0.0
    for part in parts:
        hidden = None
        if not lay.is_first_stage:
            t0 = time.perf_counter()
            hidden = group.recv((part.input_ids.shape[0], cfg.hidden_size), runner.dtype,
                                lay.rank_of(lay.stage - 1))  # [tokens, hidden]
            idle += time.perf_counter() - t0
        out = runner.forward(part, runner.model, runner.kv_caches, hidden)  # [tokens, hidden]
        if not lay.is_last_stage:
            pending.append((group.send(out, lay.rank_of(lay.stage + 1)), out))
            continue
        rows = part.logit_rows()
        if rows:
            logits = runner.model.compute_logits(out[torch.tensor(rows, device=dev)])  # [rows, vocab]
            if lay.tp_rank == 0:
                pending.append((group.send(logits, 0), logits))
    result = None
    if lay.rank == 0:
        last = lay.rank_of(lay.pp_size - 1, 0)
        t0 = time.perf_counter()
        got = [group.recv((len(part.logit_rows()), cfg.vocab_size), torch.float32, last)
               for part in parts if part.logit_rows()]
        idle += time.perf_counter() - t0
        result = torch.cat(got) if got else None
    for work, _ in pending:
        work.wait()
    runner.pipeline_idle_seconds += idle
    return result
