"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flattened token batch.

Parameter names follow the Hugging Face checkpoints, so weights load by name.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import PagedAttention
from ..attention_metadata import AttentionMetadata
from ..model_config import ModelConfig
from .rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, as the reference implementation does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, attn: PagedAttention) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = attn

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v, kv[0], kv[1], meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, attn: PagedAttention) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rotary, attn)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: PagedAttention, max_positions: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = rotary
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, attn) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: PagedAttention, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, attn, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def build(
        cls, cfg: ModelConfig, attn: PagedAttention, max_positions: int,
        dtype: torch.dtype, device: torch.device,
    ) -> LlamaForCausalLM:
        """Allocate on the target device without a throwaway random init."""
        with torch.device("meta"):
            model = cls(cfg, attn, max_positions)
        model = model.to_empty(device=device).to(dtype)
        if cfg.tie_word_embeddings:  # to_empty replaces parameters one module at a time
            model.lm_head.weight = model.model.embed_tokens.weight
        model.model.rotary.build(device)
        return model.eval()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.model.embed_tokens(input_ids)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(positions, x, kv, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name not in params:
                if self.config.tie_word_embeddings and name == "lm_head.weight":
                    continue
                raise ValueError(f"checkpoint has an unexpected tensor {name!r}")
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:5]}")
