"""Tensor parallelism in the timing model: one engine spread over N GPUs, Megatron-style,
as the real engine's --tensor-parallel-size spreads it.

Each GPU holds 1/N of every linear layer (q/k/v and gate/up split by column, o and down
by row), of the embedding and the LM head (by vocabulary) and of the KV cache (by KV
head), and the norms whole. So each GPU streams 1/N of the weights and computes 1/N of
the GEMMs and of attention, all at once; then the partial sums meet: an all-reduce of the
[tokens, hidden] activations after attention's o_proj and another after the MLP's
down_proj in every layer, one after the vocabulary-parallel embedding, and an all-gather
of the sampled rows' logits from the vocabulary-parallel LM head. None of it overlaps the
compute (vLLM's does not either), so it adds to the step.

A ring all-reduce of B bytes over N GPUs passes 2(N-1)/N x B through each GPU's link in
2(N-1) steps: 2(N-1)/N x B / bus bandwidth + 2(N-1) x step latency (the interconnect's
figures and their sources: hardware.py). An all-gather is the second half of it.

Pipeline parallelism is not modelled (its stages, micro-batches and bubble): a simulated
engine with pipeline_parallel_size > 1 is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config.engine import MAX_PARALLEL_SIZE
from .hardware import Accelerator, Interconnect, resolve_interconnect
from .shapes import ModelShape

if TYPE_CHECKING:
    from ..config.engine import EngineConfig


@dataclass(frozen=True)
class TensorParallel:
    """How many GPUs one engine spans and the link between them (None on one GPU)."""

    size: int = 1
    interconnect: Interconnect | None = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 1 <= self.size <= MAX_PARALLEL_SIZE:
            raise ValueError(f"tensor_parallel_size must be an integer in [1, {MAX_PARALLEL_SIZE}], got {self.size!r}")
        if self.size > 1 and self.interconnect is None:
            raise ValueError(f"tensor_parallel_size {self.size} needs an interconnect between its GPUs")

    def all_reduce_s(self, nbytes: float) -> float:
        n = self.size
        if n == 1:
            return 0.0
        link = self.interconnect
        return 2 * (n - 1) / n * nbytes / link.bus_bandwidth + 2 * (n - 1) * link.step_latency_s

    def all_gather_s(self, nbytes: float) -> float:
        """Every GPU ends with all `nbytes`, having passed on (N-1)/N of them in N-1 steps."""
        n = self.size
        if n == 1:
            return 0.0
        link = self.interconnect
        return (n - 1) / n * nbytes / link.bus_bandwidth + (n - 1) * link.step_latency_s

    def communication_s(self, model: ModelShape, num_tokens: int, num_sampled: int) -> float:
        """A step's collectives: 2 all-reduces a layer and the embedding's, of the step's
        activations in the model's dtype, and the sampled rows' logits gathered."""
        if self.size == 1 or num_tokens == 0:
            return 0.0
        activations = num_tokens * model.hidden_size * model.dtype_bytes
        logits = num_sampled * model.vocab_size * model.dtype_bytes
        return ((2 * model.num_layers + 1) * self.all_reduce_s(activations)
                + (self.all_gather_s(logits) if num_sampled else 0.0))

    def describe(self) -> str:
        if self.size == 1:
            return "one GPU"
        link = self.interconnect
        return (f"tensor_parallel_size {self.size} over {link.name} ({link.bus_bandwidth / 1e9:.0f} GB/s, "
                f"{link.step_latency_s * 1e6:g} us a ring step)")


SINGLE_GPU = TensorParallel()


def weight_bytes_per_gpu(model: ModelShape, size: int) -> int:
    """Each of `size` GPUs' share of the weights: 1/N of all but the norms, the norms whole."""
    norms = model.norm_params
    return (-(-(model.num_params - norms) // size) + norms) * model.dtype_bytes


def sizes_dividing(model: ModelShape) -> list[int]:
    """The tensor_parallel_size values the model's KV heads split evenly over."""
    return [n for n in range(1, MAX_PARALLEL_SIZE + 1) if model.num_kv_heads % n == 0]


def check_splits(model: ModelShape, size: int) -> None:
    """The real engine shards the KV cache by KV head: a count N does not divide is refused."""
    if model.num_kv_heads % size:
        raise ValueError(
            f"tensor_parallel_size ({size}) must divide {model.name}'s num_key_value_heads "
            f"({model.num_kv_heads}): each GPU holds an equal share of the KV heads; "
            f"one of {sizes_dividing(model)}")


def tensor_parallel(config: EngineConfig, model: ModelShape, acc: Accelerator) -> TensorParallel:
    """The simulated engine's layout, from its config; refused as the real engine refuses it."""
    if config.pipeline_parallel_size != 1:
        raise ValueError(
            f"pipeline_parallel_size={config.pipeline_parallel_size} is not modelled by --simulate "
            f"(its stages, micro-batches and pipeline bubble are not); simulate with "
            f"pipeline_parallel_size 1 and tensor_parallel_size {config.world_size} instead")
    size = config.tensor_parallel_size
    check_splits(model, size)
    if size == 1:
        return SINGLE_GPU
    sim = config.simulate
    return TensorParallel(size, resolve_interconnect((sim.interconnect if sim else None) or acc.interconnect))
