"""Rotary position embedding (rotate-half layout, as HF Llama/Qwen2), with rope scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`,
        # interpolate smoothly in between.
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    # ModelConfig refuses other types at load (model_config.ROPE_TYPES); this is the backstop.
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device) -> None:
        """Fill the float32 cos/sin tables (after the model is moved to its device). The
        rotate-half layout repeats each frequency in both halves, so half a row is kept."""
        inv_freq = _inv_freq(self.head_dim, self.theta, self.scaling).to(device)  # [D / 2]
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, D / 2]
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The step's cos/sin rows, gathered once and shared by every layer."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [T, 1, D / 2]
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, sin


RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin: each [T, 1, D / 2]


def apply_rotary(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """x [T, heads, D] rotated in the rotate-half layout: with x = (x1, x2),
    (x1 * cos - x2 * sin, x2 * cos + x1 * sin). A new tensor; x is left alone."""
    cos, sin = rope
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, heads, D]
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)
    return out
