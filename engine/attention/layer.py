"""Paged attention behind one function, with two backends reading the same cache.

`torch`: plain torch (cpu_attention.py: planned once per step, gathered into a reused
workspace, SDPA per length group or per prefill).
`triton`: the kernels in kvpilot.kernels, imported only when chosen.
"""

from __future__ import annotations

from typing import Callable

import torch

from .metadata import AttentionMetadata
from .cpu import TorchPagedAttention
from .cpu_decode_kernel import DecodeKernel
from kvpilot.kernels.kv_cache_dtype import is_fp8, quantize_fp8


def resolve_backend(name: str, device: torch.device) -> str:
    """auto: triton on CUDA, torch on the CPU (both read a model-dtype or an fp8 cache)."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


class PagedAttention:
    """Writes the step's new K/V into the paged cache, then attends over it."""

    def __init__(self, backend: str) -> None:
        if backend not in ("triton", "torch"):
            raise ValueError(f"attention_backend must be auto, triton or torch, got {backend!r}")
        self.backend = backend
        self._torch = TorchPagedAttention()  # its decode kernel: use_decode_kernel()
        if backend == "triton":
            from kvpilot.kernels.kv_cache_write import write_kv_cache
            from kvpilot.kernels.paged_decode_attention import paged_decode_attention
            from kvpilot.kernels.paged_prefill_attention import paged_prefill_attention

            self._write: Callable = write_kv_cache
            self._decode: Callable = paged_decode_attention
            self._prefill: Callable = paged_prefill_attention

    def use_decode_kernel(self, kernel: DecodeKernel | None) -> None:
        self._torch.decode_kernel = kernel

    @property
    def decode_kernel(self) -> DecodeKernel | None:
        return self._torch.decode_kernel if self.backend == "torch" else None

    def __call__(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,  # fp8 caches' K/V scales (ignored for a model-dtype cache)
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if self.backend == "torch":
            write_kv_cache_torch(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
            if meta.torch_plan is None:
                raise RuntimeError("the torch attention backend needs AttentionMetadata.torch_plan")
            return self._torch(query, key, value, k_cache, v_cache, meta.torch_plan, scale,
                               k_scale, v_scale)
        self._write(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        if meta.is_decode_only:
            return self._decode(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                max_seq_len=meta.max_seq_len, k_scale=k_scale, v_scale=v_scale,
            )
        return self._prefill(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, meta.max_query_len, scale, k_scale=k_scale, v_scale=v_scale,
        )


def write_kv_cache_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter the step's K/V into their slots; into an fp8 cache as x / scale, saturated."""
    if is_fp8(k_cache):
        # As bytes: index_copy_ has no float8 kernel on the CPU.
        key, value = quantize_fp8(key, k_scale).view(torch.uint8), quantize_fp8(value, v_scale).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)
