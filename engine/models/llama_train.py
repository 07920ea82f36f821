"""A plain, differentiable Llama-family forward over padded batches, for training tiny models.

The serving model (llama.py) runs over a flattened batch with a paged KV cache and fused,
in-place projections that autograd cannot follow; this one computes the same network
(RMSNorm, rotate-half RoPE from rotary.py, grouped-query causal attention, SwiGLU) on
`[batch, seq]` token ids with unfused parameters named as in Hugging Face checkpoints, so
its `state_dict()` is a checkpoint and a checkpoint loads with `load_state_dict`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config.model import ModelConfig
from .llama import RMSNorm
from .rotary import RotaryEmbedding


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, seq, D] in the rotate-half layout; cos/sin [seq, D / 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        # The serving cache's storage rounding of K (after RoPE) and V, for scoring what a
        # quantized KV cache serves (bench quantization's fp8-kv): decoding reads every
        # position's K/V, its own included, back from the cache. None: float.
        self.kv_round: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # [batch, seq, hidden]
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # [batch, heads, seq, D]
        if self.kv_round is not None:
            k, v = self.kv_round(k), self.kv_round(v)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [batch, heads, seq, D]
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """`model.*` of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TrainableLlama(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The serving model's own tables: rope scaling and theta mean the same here.
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.rotary.build(torch.device("cpu"))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [batch, seq] -> logits [batch, seq, vocab] (float32)."""
        seq = input_ids.shape[1]
        cos, sin = self.rotary.cos[:seq], self.rotary.sin[:seq]  # [seq, D / 2]
        x = self.model.embed_tokens(input_ids)  # [batch, seq, hidden]
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x)).float()

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """Parameters under their checkpoint names (a tied lm_head is not stored)."""
        tensors = {name: p.detach().clone() for name, p in self.named_parameters()}
        if self.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        return tensors

    def load_checkpoint(self, tensors: dict[str, torch.Tensor]) -> None:
        expected = set(self.checkpoint())
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
            raise ValueError(f"checkpoint tensors differ: missing {missing[:5]}, unexpected {extra[:5]}")
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[name].copy_(tensor)
