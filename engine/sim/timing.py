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
- a fixed host overhead per step, per sequence and per token;
- over N GPUs (tensor parallelism, parallel.py): each GPU's 1/N share of the above, then
  the all-reduces and the logits' all-gather across the interconnect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import Accelerator
from .parallel import SINGLE_GPU, TensorParallel, sizes_dividing, weight_bytes_per_gpu
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
    communication_s: float = 0.0  # tensor parallelism's all-reduces and all-gather

    @property
    def total_s(self) -> float:
        return (self.overhead_s + self.gemm_s + self.attention_s + self.lm_head_s + self.sampling_s
                + self.communication_s)


def _roofline(flops: float, nbytes: float, rate: float, bandwidth: float) -> tuple[float, bool]:
    compute, memory = flops / rate, nbytes / bandwidth
    return max(compute, memory), memory >= compute


def step_cost(model: ModelShape, acc: Accelerator, batch: BatchShape, tp: TensorParallel = SINGLE_GPU) -> StepCost:
    """One step's time; over tp.size GPUs, each GPU's share plus the collectives."""
    m, b, n = model, batch, tp.size
    if b.num_tokens == 0:
        return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, True, True)
    wb = ab = m.dtype_bytes
    h, d = m.hidden_size, m.head_dim
    # One GPU's share: heads, KV heads, MLP columns, linear weights and vocabulary (1/N each).
    heads, kv_heads = m.num_heads / n, m.num_kv_heads / n
    params, vocab = m.linear_params_per_layer / n, m.vocab_size / n
    bw = acc.effective_bandwidth
    # Activations each token moves through the layer's GEMMs and their elementwise neighbours.
    act_elems = 5 * h + (heads + 2 * kv_heads) * d + 3 * m.intermediate_size / n
    gemm, gemm_mem = _roofline(2 * b.num_tokens * params, params * wb + b.num_tokens * act_elems * ab,
                               acc.effective_gemm_flops, bw)
    attn, attn_mem = _roofline(
        4 * heads * d * b.attention_pairs,
        b.kv_tokens_read * 2 * kv_heads * d * ab
        + b.num_tokens * (2 * heads + 2 * kv_heads) * d * ab
        + b.attention_pairs * heads * acc.attention_score_bytes,
        acc.effective_attention_flops, bw)
    s = b.num_sampled
    lm_head = _roofline(2 * s * h * vocab, h * vocab * wb + s * vocab * LOGIT_BYTES,
                        acc.effective_gemm_flops, bw)[0] if s else 0.0
    sampling = 2 * s * m.vocab_size * LOGIT_BYTES / bw  # on the first GPU, over the gathered logits
    overhead = (acc.step_overhead_s + acc.per_seq_overhead_s * b.num_seqs
                + acc.per_token_overhead_s * b.num_tokens)
    return StepCost(overhead, m.num_layers * gemm, m.num_layers * attn, lm_head, sampling,
                    gemm_mem, attn_mem, tp.communication_s(m, b.num_tokens, s))


def step_time(model: ModelShape, acc: Accelerator, batch: BatchShape, tp: TensorParallel = SINGLE_GPU) -> float:
    return step_cost(model, acc, batch, tp).total_s


class StepTimer:
    """step_time for one (model, accelerator, parallelism), its constants computed once: the
    simulator asks it every step. Each term is the same expression, evaluated in the same
    order, as step_cost's, so the times are bit-identical (tests/engine/sim/test_sim_timing.py)."""

    def __init__(self, model: ModelShape, acc: Accelerator, tp: TensorParallel = SINGLE_GPU) -> None:
        m, n = model, tp.size
        self.model, self.tp = model, tp
        self.ab = m.dtype_bytes
        h, self.d = m.hidden_size, m.head_dim
        self.heads, self.kv_heads = m.num_heads / n, m.num_kv_heads / n
        self.params, self.vocab = m.linear_params_per_layer / n, m.vocab_size / n
        self.h, self.full_vocab, self.layers = h, m.vocab_size, m.num_layers
        self.bw, self.gemm_flops, self.attn_flops = (acc.effective_bandwidth, acc.effective_gemm_flops,
                                                     acc.effective_attention_flops)
        self.act_elems = 5 * h + (self.heads + 2 * self.kv_heads) * self.d + 3 * m.intermediate_size / n
        self.weights = self.params * self.ab  # params * wb, step_cost's first byte term
        self.attn_per_pair = 4 * self.heads * self.d
        self.qo_heads = 2 * self.heads + 2 * self.kv_heads
        self.score_bytes = acc.attention_score_bytes
        self.head_bytes = h * self.vocab * self.ab
        self.overheads = acc.step_overhead_s, acc.per_seq_overhead_s, acc.per_token_overhead_s
        # decode(): per batch size, the terms that do not depend on the context.
        self._decode_terms: dict[int, tuple[float, float, float, float, float]] = {}

    def __call__(self, b: BatchShape) -> float:
        t = b.num_tokens
        if t == 0:
            return 0.0
        head, qo_bytes, lm_head, sampling, comm = self._context_free(b.num_seqs, t, b.num_sampled)
        attn = self._attention(b.attention_pairs, b.kv_tokens_read, qo_bytes)
        return head + self.layers * attn + lm_head + sampling + comm

    def decode(self, num_seqs: int, context_tokens: int) -> float:
        """self(BatchShape(num_seqs, num_seqs, num_seqs, context_tokens, context_tokens)), a step
        in which each sequence decodes one token, to the bit, with the terms that do not
        depend on the context kept per batch size (the fleet's fast-forward asks this for
        every step of a run)."""
        terms = self._decode_terms.get(num_seqs)
        if terms is None:
            terms = self._decode_terms[num_seqs] = self._context_free(num_seqs, num_seqs, num_seqs)
        head, qo_bytes, lm_head, sampling, comm = terms
        return head + self.layers * self._attention(context_tokens, context_tokens, qo_bytes) + lm_head + sampling + comm

    def _context_free(self, num_seqs: int, t: int, s: int) -> tuple[float, float, float, float, float]:
        """step_cost's terms that do not depend on the context, for num_seqs sequences, t new
        tokens and s sampled: (overhead + layers x GEMMs, the query and output bytes the
        attention moves, the LM head, sampling, communication)."""
        ab, d, bw = self.ab, self.d, self.bw
        gemm = max(2 * t * self.params / self.gemm_flops, (self.weights + t * self.act_elems * ab) / bw)
        lm_head = max(2 * s * self.h * self.vocab / self.gemm_flops,
                      (self.head_bytes + s * self.vocab * LOGIT_BYTES) / bw) if s else 0.0
        sampling = 2 * s * self.full_vocab * LOGIT_BYTES / bw
        step, per_seq, per_token = self.overheads
        overhead = step + per_seq * num_seqs + per_token * t
        return (overhead + self.layers * gemm, t * self.qo_heads * d * ab, lm_head, sampling,
                self.tp.communication_s(self.model, t, s))

    def _attention(self, pairs: int, reads: int, qo_bytes: float) -> float:
        """One layer's attention: compute or memory bound, whichever is slower."""
        ab, d = self.ab, self.d
        return max(self.attn_per_pair * pairs / self.attn_flops,
                   (reads * 2 * self.kv_heads * d * ab + qo_bytes + pairs * self.heads * self.score_bytes) / self.bw)


# --- memory -------------------------------------------------------------------------------

def activation_peak_bytes(model: ModelShape, max_num_batched_tokens: int, max_num_seqs: int,
                          tensor_parallel_size: int = 1) -> int:
    """The forward's peak working memory at a full token budget on one GPU (what vLLM's
    start-up profile measures): the MLP's gate/up output and its product (1/N of the
    columns each), a few hidden-sized buffers, and float32 logits for every sequence that
    may sample (whole on the first GPU, which gathers them)."""
    m, t = model, max_num_batched_tokens
    per_token = (3 * -(-m.intermediate_size // tensor_parallel_size) + 4 * m.hidden_size) * m.dtype_bytes
    return t * per_token + max_num_seqs * m.vocab_size * LOGIT_BYTES


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU's memory (budget, weights, activations, reserve) and the KV cache all the
    engine's GPUs hold together (num_gpus x what each has left)."""

    budget_bytes: int  # memory x gpu_memory_utilization, each GPU
    weight_bytes: int  # each GPU's share
    reserved_bytes: int
    activation_bytes: int
    kv_cache_bytes: int  # all GPUs together: what the engine's block pool is sized from
    num_gpus: int = 1

    def describe(self) -> str:
        gib = 2**30
        each = self.kv_cache_bytes // self.num_gpus
        split = (f" + KV cache {each / gib:.1f} GiB, on each of {self.num_gpus} GPUs: KV cache "
                 f"{self.kv_cache_bytes / gib:.1f} GiB in all" if self.num_gpus > 1
                 else f" + KV cache {self.kv_cache_bytes / gib:.1f} GiB")
        return (f"{self.budget_bytes / gib:.1f} GiB usable = weights {self.weight_bytes / gib:.1f} GiB"
                f" + activations {self.activation_bytes / gib:.2f} GiB + reserved "
                f"{self.reserved_bytes / gib:.2f} GiB{split}")


def _kv_per_gpu(model: ModelShape, acc: Accelerator, gpu_memory_utilization: float, max_num_batched_tokens: int,
                max_num_seqs: int, num_gpus: int) -> tuple[int, int, int, int]:
    """(budget, weights, activations, KV cache) of one of num_gpus GPUs; the KV cache may
    come out negative."""
    budget = int(acc.memory_bytes * gpu_memory_utilization)
    weights = weight_bytes_per_gpu(model, num_gpus)
    activations = activation_peak_bytes(model, max_num_batched_tokens, max_num_seqs, num_gpus)
    return budget, weights, activations, budget - weights - activations - acc.reserved_bytes


def smallest_fitting_size(model: ModelShape, acc: Accelerator, gpu_memory_utilization: float,
                          max_num_batched_tokens: int, max_num_seqs: int) -> int | None:
    """The fewest GPUs (a tensor_parallel_size the KV heads split over) that leave a KV cache."""
    for n in sizes_dividing(model):
        if _kv_per_gpu(model, acc, gpu_memory_utilization, max_num_batched_tokens, max_num_seqs, n)[3] > 0:
            return n
    return None


def plan_memory(model: ModelShape, acc: Accelerator, gpu_memory_utilization: float,
                max_num_batched_tokens: int, max_num_seqs: int, tp: TensorParallel = SINGLE_GPU) -> MemoryPlan:
    """KV capacity = N x (memory x utilisation - each GPU's weight share - activation peak
    - reserve). ValueError, with the numbers and the tensor_parallel_size that would fit,
    when nothing is left for the cache."""
    budget, weights, activations, kv = _kv_per_gpu(model, acc, gpu_memory_utilization, max_num_batched_tokens,
                                                   max_num_seqs, tp.size)
    gib = 2**30

    def remedy() -> str:
        fits = smallest_fitting_size(model, acc, gpu_memory_utilization, max_num_batched_tokens, max_num_seqs)
        if fits is not None and fits > tp.size:
            return f"; tensor_parallel_size {fits} (--tensor-parallel-size) would leave one"
        return ""

    if weights > acc.memory_bytes:
        where = ("it does not fit one accelerator" if tp.size == 1
                 else f"at tensor_parallel_size {tp.size} each GPU's share is {weights / gib:.1f} GiB")
        raise ValueError(
            f"simulate_model: {model.name}'s weights take {model.weight_bytes / gib:.1f} GiB but the "
            f"{acc.name} has {acc.memory_bytes / gib:.1f} GiB: {where}{remedy()}")
    if kv <= 0:
        shares = f" on each of {tp.size} GPUs" if tp.size > 1 else ""
        raise ValueError(
            f"simulate_model: {model.name} on the {acc.name} leaves no KV cache{shares}: "
            f"{budget / gib:.1f} GiB usable (gpu_memory_utilization {gpu_memory_utilization:g}) "
            f"- weights {weights / gib:.1f} GiB - activations {activations / gib:.2f} GiB - "
            f"reserved {acc.reserved_bytes / gib:.2f} GiB = {kv / gib:.2f} GiB{remedy()}")
    return MemoryPlan(budget, weights, acc.reserved_bytes, activations, kv * tp.size, tp.size)


def decode_roofline_tokens_per_s(model: ModelShape, acc: Accelerator, batch: int, context: int,
                                 tp: TensorParallel = SINGLE_GPU) -> float:
    """Output tokens/s of steady decode at `batch` sequences of `context` tokens."""
    t = step_time(model, acc, BatchShape.of([(1, context)] * batch), tp)
    return batch / t if t > 0 else math.inf
