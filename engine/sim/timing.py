"""The timing model: how long one engine step takes on an accelerator, from the step's
shape alone, and how much KV cache the accelerator's memory leaves. Pure functions.

A step runs every layer once over all its new tokens. Each kernel is bound either by
compute or by memory, so each costs max(FLOPs / effective FLOP/s, bytes / effective
bandwidth) (a roofline per kernel, summed over the sequential kernels of a layer):
- the layer's GEMMs (q/k/v, o, gate/up, down): 2 x tokens x parameters FLOPs; bytes are
  the weights, read once per step whatever the batch (why batching decode is nearly
  free until it turns compute-bound), plus the activations in and out;
- attention: 4 x heads x head_dim FLOPs per (query, key) pair, so quadratic in the
  chunk length for prefill; bytes are each sequence's K/V read (once per 128-query tile,
  as FlashAttention-style kernels do), plus q, o and the new K/V written, plus the score
  matrix where an implementation materialises it (the accelerator's
  attention_score_bytes per pair and head: 0 for fused kernels);
- the LM head over the sampled rows only, and sampling over their logits;
- a fixed host overhead per step, per sequence and per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import Accelerator
from .shapes import ModelShape

QUERY_TILE = 128  # queries per attention tile: K/V are re-read once per tile
LOGIT_BYTES = 4  # logits are float32


@dataclass(frozen=True)
class BatchShape:
    """One step, aggregated: what the time depends on."""

    num_seqs: int
    num_tokens: int  # new tokens, all sequences
    num_sampled: int  # sequences whose last position is sampled this step
    attention_pairs: int  # sum over new tokens of the context each attends to (itself included)
    kv_tokens_read: int  # K/V token reads, summed over sequences and query tiles

    @classmethod
    def of(cls, requests: list[tuple[int, int]], num_sampled: int | None = None) -> BatchShape:
        """From (new tokens, context length after the step) per sequence."""
        pairs = reads = tokens = 0
        for new, end in requests:  # per sequence per step in the simulator: keep it lean
            tokens += new
            if new == 1:
                pairs += end
                reads += end
            else:
                pairs += new * (end - new) + new * (new + 1) // 2
                reads += end * -(-new // QUERY_TILE)
        return cls(len(requests), tokens, len(requests) if num_sampled is None else num_sampled,
                   pairs, reads)


@dataclass(frozen=True)
class StepCost:
    overhead_s: float
    gemm_s: float  # all layers
    attention_s: float  # all layers
    lm_head_s: float
    sampling_s: float
    gemm_memory_bound: bool
    attention_memory_bound: bool

    @property
    def total_s(self) -> float:
        return self.overhead_s + self.gemm_s + self.attention_s + self.lm_head_s + self.sampling_s


def _roofline(flops: float, nbytes: float, rate: float, bandwidth: float) -> tuple[float, bool]:
    compute, memory = flops / rate, nbytes / bandwidth
    return max(compute, memory), memory >= compute


def step_cost(model: ModelShape, acc: Accelerator, batch: BatchShape) -> StepCost:
    m, b = model, batch
    if b.num_tokens == 0:
        return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, True, True)
    wb = ab = m.dtype_bytes
    h, d = m.hidden_size, m.head_dim
    bw = acc.effective_bandwidth
    # Activations each token moves through the layer's GEMMs and their elementwise neighbours.
    act_elems = 5 * h + (m.num_heads + 2 * m.num_kv_heads) * d + 3 * m.intermediate_size
    gemm, gemm_mem = _roofline(2 * b.num_tokens * m.linear_params_per_layer,
                               m.linear_params_per_layer * wb + b.num_tokens * act_elems * ab,
                               acc.effective_gemm_flops, bw)
    attn, attn_mem = _roofline(
        4 * m.num_heads * d * b.attention_pairs,
        b.kv_tokens_read * 2 * m.num_kv_heads * d * ab
        + b.num_tokens * (2 * m.num_heads + 2 * m.num_kv_heads) * d * ab
        + b.attention_pairs * m.num_heads * acc.attention_score_bytes,
        acc.effective_attention_flops, bw)
    s = b.num_sampled
    lm_head = _roofline(2 * s * h * m.vocab_size, h * m.vocab_size * wb + s * m.vocab_size * LOGIT_BYTES,
                        acc.effective_gemm_flops, bw)[0] if s else 0.0
    sampling = 2 * s * m.vocab_size * LOGIT_BYTES / bw
    overhead = (acc.step_overhead_s + acc.per_seq_overhead_s * b.num_seqs
                + acc.per_token_overhead_s * b.num_tokens)
    return StepCost(overhead, m.num_layers * gemm, m.num_layers * attn, lm_head, sampling,
                    gemm_mem, attn_mem)


def step_time(model: ModelShape, acc: Accelerator, batch: BatchShape) -> float:
    return step_cost(model, acc, batch).total_s


# --- memory -------------------------------------------------------------------------------

def activation_peak_bytes(model: ModelShape, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The forward's peak working memory at a full token budget (what vLLM's start-up
    profile measures): the MLP's gate/up output and its product, a few hidden-sized
    buffers, and float32 logits for every sequence that may sample."""
    m, t = model, max_num_batched_tokens
    per_token = (3 * m.intermediate_size + 4 * m.hidden_size) * m.dtype_bytes
    return t * per_token + max_num_seqs * m.vocab_size * LOGIT_BYTES


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int  # memory x gpu_memory_utilization
    weight_bytes: int
    reserved_bytes: int
    activation_bytes: int
    kv_cache_bytes: int

    def describe(self) -> str:
        gib = 2**30
        return (f"{self.budget_bytes / gib:.1f} GiB usable = weights {self.weight_bytes / gib:.1f} GiB"
                f" + activations {self.activation_bytes / gib:.2f} GiB + reserved "
                f"{self.reserved_bytes / gib:.2f} GiB + KV cache {self.kv_cache_bytes / gib:.1f} GiB")


def plan_memory(model: ModelShape, acc: Accelerator, gpu_memory_utilization: float,
                max_num_batched_tokens: int, max_num_seqs: int) -> MemoryPlan:
    """KV capacity = memory x utilisation - weights - activation peak - reserve.
    ValueError, with the numbers, when nothing is left for the cache."""
    budget = int(acc.memory_bytes * gpu_memory_utilization)
    weights = model.weight_bytes
    gib = 2**30
    if weights > acc.memory_bytes:
        raise ValueError(
            f"simulate_model: {model.name}'s weights take {weights / gib:.1f} GiB but the "
            f"{acc.name} has {acc.memory_bytes / gib:.1f} GiB: it does not fit one accelerator")
    activations = activation_peak_bytes(model, max_num_batched_tokens, max_num_seqs)
    kv = budget - weights - activations - acc.reserved_bytes
    if kv <= 0:
        raise ValueError(
            f"simulate_model: {model.name} on the {acc.name} leaves no KV cache: "
            f"{budget / gib:.1f} GiB usable (gpu_memory_utilization {gpu_memory_utilization:g}) "
            f"- weights {weights / gib:.1f} GiB - activations {activations / gib:.2f} GiB - "
            f"reserved {acc.reserved_bytes / gib:.2f} GiB = {kv / gib:.2f} GiB")
    return MemoryPlan(budget, weights, acc.reserved_bytes, activations, kv)


def decode_roofline_tokens_per_s(model: ModelShape, acc: Accelerator, batch: int, context: int) -> float:
    """Output tokens/s of steady decode at `batch` sequences of `context` tokens."""
    t = step_time(model, acc, BatchShape.of([(1, context)] * batch))
    return batch / t if t > 0 else math.inf
