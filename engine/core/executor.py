"""The boundary between the engine core and whatever runs the model's forward pass.

Two implementations: `ModelRunner` (the real model in torch) and the simulator's
`SimulatedExecutor` (a timing model, no torch). The engine core (scheduler, KV cache
manager, output processor) never imports torch, so the simulated path stays small."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .outputs import TokenLogprob
from .request import Request
from .scheduler import SchedulerOutput


@dataclass
class StepResult:
    """One step's sampled tokens, on the host, one row per request that sampled (in
    scheduled order): its new tokens, one, or with speculation the accepted drafts and
    one more."""

    requests: list[Request]
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob]] | None = None  # aligned with token_ids; None when no request asked


class EngineDeadError(RuntimeError):
    """The executor cannot run any step again (a tensor/pipeline-parallel rank died, or a
    collective broke mid-step): never one request's fault, so never isolated to one."""


class Executor(Protocol):
    vocab_size: int  # token ids a prompt may hold
    max_position_embeddings: int
    kv_bytes_per_block: int
    kv_cache_element_bytes: int  # one K or V element of the paged cache (1 for fp8)
    weight_bytes: int

    def describe(self) -> str:
        """Where the forward pass runs, for the start-up log line."""

    def kv_cache_budget(self) -> int:
        """Bytes the KV cache may take (before rounding down to whole blocks)."""

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def counters(self) -> dict[str, float]:
        """Cumulative figures of the executor's own, exported as kvpilot: metrics."""

    def release_loader_threads(self) -> None:
        """Called on the thread that loaded the model when stepping moves to another
        (the server's engine thread): free what only the loading thread would use."""

    def make_generator(self, seed: int) -> Any:
        """A per-request random generator for a seeded request (None if not needed)."""

    def run(self, out: SchedulerOutput) -> StepResult:
        """Run one step; each scheduled request's block table is `request.kv.block_ids`."""

    def failure(self) -> str | None:
        """Why the executor can no longer run steps (a tensor-parallel rank died), or None."""

    def shutdown(self) -> None:
        """Release what outlives the object: other ranks' processes."""

