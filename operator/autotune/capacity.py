"""Capacity planning: the KV-cache sizing formula run backwards.

Forwards, a sequence of L tokens needs 2 (K and V) x layers x kv_heads x head_dim x
dtype bytes per token, allocated in whole blocks. Backwards: the bytes left for the KV
cache (a configured `kv_cache_memory`, or GPU memory x utilisation - weights - an
activation reserve) divided by the bytes one sequence needs at the observed p99 length
gives the number of sequences the cache can hold at once. Compared with `max_num_seqs`
that says which limit binds first:

- TuningBound: the cache holds more sequences than `max_num_seqs` admits, so the
  scheduler's cap binds and raising it is free capacity;
- HardwareBound: `max_num_seqs` admits more sequences than the cache holds, so the
  extra ones only get preempted; more throughput needs more memory or replicas.

Given the cache's element size (the pods' kvpilot:kv_cache_element_bytes), the plan also
says how many sequences an fp8 cache (one byte per element) would hold in the same bytes:
the field guide's first remedy for a cache pinned near full, which needs a restart, so
the autotuner advises it (advice.py) rather than applying it. Given the weights' bytes
(kvpilot:model_weight_bytes, the quantized size where the pods quantize), it says what the
weights take: on a GPU the cache gets what they leave of the memory share.

One engine over N GPUs (tensor/pipeline parallelism, resources.gpus: N) holds N GPUs' KV
cache: each GPU's memory share less its 1/N of the weights and its own activation reserve,
times N. The pods' own metrics already count it so (kvpilot:kv_cache_bytes is every rank's
together, kvpilot:kv_cache_bytes_per_token all KV heads), which is what the autotuner
plans from; `num_gpus` is for the formula from a config and a GPU's memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.engine.config.quantity import format_bytes, parse_bytes

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8": 1}


@dataclass(frozen=True)
class ModelShape:
    """The parts of a model's config that size its KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    weight_bytes: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, config: dict, dtype: str = "float32", weight_bytes: int = 0) -> ModelShape:
        """From a Hugging Face config.json dict (Llama/Qwen2 field names)."""
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            dtype_bytes=DTYPE_BYTES[dtype],
            weight_bytes=weight_bytes,
        )


# builtin:tiny: 4 layers, 4 KV heads of dim 32; in float32 that is 4 KiB per token.
TINY_FLOAT32 = ModelShape(num_layers=4, num_kv_heads=4, head_dim=32, dtype_bytes=4)


@dataclass(frozen=True)
class CapacityPlan:
    kv_cache_bytes: int
    bytes_per_token: int
    seq_len: int  # the length planned for (observed p99, rounded up to whole blocks)
    bytes_per_sequence: int
    max_concurrent_seqs: int  # sequences of seq_len the cache holds at once
    max_num_seqs: int
    bound: str  # "TuningBound" | "HardwareBound"
    summary: str
    fp8_max_concurrent_seqs: int | None = None  # the same with an fp8 cache; None: already fp8 or unknown
    weight_bytes: int | None = None

    def to_status(self) -> dict:
        extra = {"fp8MaxConcurrentSeqs": self.fp8_max_concurrent_seqs, "weightBytes": self.weight_bytes}
        return {
            "kvCacheBytes": self.kv_cache_bytes,
            "bytesPerToken": self.bytes_per_token,
            "seqLen": self.seq_len,
            "bytesPerSequence": self.bytes_per_sequence,
            "maxConcurrentSeqs": self.max_concurrent_seqs,
            "maxNumSeqs": self.max_num_seqs,
            "bound": self.bound,
            "summary": self.summary,
            **{k: v for k, v in extra.items() if v is not None},
        }


def kv_cache_bytes(
    shape: ModelShape | None,
    *,
    kv_cache_memory: int | str | None = None,
    gpu_memory_bytes: int | None = None,
    gpu_memory_utilization: float | None = None,
    activation_reserve_bytes: int = 0,
    num_gpus: int = 1,
) -> int:
    """Bytes available to the KV cache: the configured amount, else what the GPU shares
    leave after the weights and each GPU's activation reserve (never negative).
    `gpu_memory_bytes` and `activation_reserve_bytes` are one GPU's; the engine spans
    `num_gpus` of them and splits the weights over them."""
    if kv_cache_memory is not None:
        return parse_bytes("kv_cache_memory", kv_cache_memory)
    if shape is None or gpu_memory_bytes is None or gpu_memory_utilization is None:
        raise ValueError("need kv_cache_memory, or a model shape with gpu_memory_bytes and gpu_memory_utilization")
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"num_gpus must be a positive integer, got {num_gpus!r}")
    budget = num_gpus * (gpu_memory_bytes * gpu_memory_utilization - activation_reserve_bytes) - shape.weight_bytes
    return max(0, int(budget))


def plan_capacity(
    shape: ModelShape | None = None,
    *,
    seq_len: float,
    max_num_seqs: int,
    block_size: int = 16,
    kv_cache_memory: int | str | None = None,
    gpu_memory_bytes: int | None = None,
    gpu_memory_utilization: float | None = None,
    activation_reserve_bytes: int = 0,
    bytes_per_token: int | None = None,
    kv_element_bytes: int | None = None,
    weight_bytes: int | None = None,
    num_gpus: int = 1,
) -> CapacityPlan:
    """How many sequences of `seq_len` tokens fit in the KV cache, and which limit binds.

    `seq_len` is rounded up to whole blocks, since the cache hands out blocks, not tokens.
    Any model works without its config: pass the pod's own `kvpilot:kv_cache_bytes` as
    `kv_cache_memory` and `kvpilot:kv_cache_bytes_per_token` as `bytes_per_token`
    (`shape` may then be None); the shape is needed only for the GPU formula.
    `kv_element_bytes` (the cache's element size) adds what an fp8 cache would hold, and
    `weight_bytes` what the weights take, to the plan and its summary. `num_gpus` is how
    many GPUs one engine spans, for the GPU formula (the pods' metrics already count them).
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    total = kv_cache_bytes(
        shape,
        kv_cache_memory=kv_cache_memory,
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        activation_reserve_bytes=activation_reserve_bytes,
        num_gpus=num_gpus,
    )
    if bytes_per_token is None and shape is None:
        raise ValueError("need bytes_per_token or a model shape")
    per_token = int(bytes_per_token) if bytes_per_token is not None else shape.kv_bytes_per_token
    if per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {per_token}")
    tokens = math.ceil(seq_len / block_size) * block_size
    per_seq = per_token * tokens
    fits = total // per_seq
    bound = "TuningBound" if fits > max_num_seqs else "HardwareBound"
    head = (f"KV cache {format_bytes(total)} at {format_bytes(per_token)}/token holds "
            f"{fits} sequences of {tokens} tokens ({format_bytes(per_seq)} each)")
    if fits == 0:
        summary = f"{head}: not even one sequence fits; the deployment needs more memory"
    elif bound == "TuningBound":
        summary = (f"{head}; max_num_seqs={max_num_seqs} binds first, so raising it "
                   f"(up to {fits}) is free capacity: tuning-bound")
    else:
        summary = (f"{head}; max_num_seqs={max_num_seqs} admits more than fit, so the cache "
                   f"binds and more throughput needs memory or replicas: hardware-bound")
    fp8_fits = None
    if kv_element_bytes is not None and kv_element_bytes > 1:
        fp8_fits = int(total // (per_token // int(kv_element_bytes) * tokens))
        summary += (f"; an fp8 KV cache ({format_bytes(per_token // int(kv_element_bytes))}/token) would "
                    f"hold {fp8_fits}")
    if weight_bytes:
        summary += f"; the weights take {format_bytes(weight_bytes)}"
    return CapacityPlan(
        kv_cache_bytes=total,
        bytes_per_token=per_token,
        seq_len=tokens,
        bytes_per_sequence=per_seq,
        max_concurrent_seqs=int(fits),
        max_num_seqs=max_num_seqs,
        bound=bound,
        summary=summary,
        fp8_max_concurrent_seqs=fp8_fits,
        weight_bytes=int(weight_bytes) if weight_bytes else None,
    )
