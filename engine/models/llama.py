"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flattened token batch.

Parameter names follow the Hugging Face checkpoints, so weights load by name.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.layer import PagedAttention
from ..attention.metadata import AttentionMetadata
from ..config.model import ModelConfig
from ..parallel.sharding import ModelShard
from .rotary import RopeTables, RotaryEmbedding, apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]
WHOLE = ModelShard()  # one process holds the whole model


def _all_reduce(group, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's partial sums added over the tensor-parallel ranks."""
    return x if group is None else group.all_reduce(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, as the reference implementation does.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """Column-parallel q/k/v (whole heads per rank), row-parallel o: with tensor parallelism
    a rank attends over its own heads and its own slice of the KV cache."""

    def __init__(self, cfg: ModelConfig, attn: PagedAttention, shard: ModelShard = WHOLE,
                 group=None) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads // shard.tp_size
        self.num_kv_heads = cfg.num_key_value_heads // shard.tp_size
        self.group = group
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul: the checkpoint's q_proj/k_proj/v_proj rows, stacked at load.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.attn = attn
        # This layer's fp8 KV cache scales (vLLM's k_scale / v_scale; float32 values, read only
        # with --kv-cache-dtype fp8): 1.0 without calibration, as vLLM uses; a checkpoint's
        # calibrated scales would be set here at load.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self, rope: RopeTables, x: torch.Tensor, kv: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 * KVH) * D]
        # q and k rotated together: one pass over both.
        qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(
            t, self.num_heads + self.num_kv_heads, self.head_dim), rope)  # [T, H + KVH, D]
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # [T, H, D], [T, KVH, D]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v, kv[0], kv[1], meta, self.scale, self.k_scale, self.v_scale)  # [T, H, D]
        return _all_reduce(self.group, self.o_proj(o.reshape(t, self.num_heads * self.head_dim)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ModelShard = WHOLE, group=None) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size // shard.tp_size
        self.group = group
        # gate and up in one matmul: the checkpoint's gate_proj then up_proj rows.
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return _all_reduce(self.group, self.down_proj(F.silu(gate).mul_(up)))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the (padded) vocabulary; ids outside them look up zeros, and
    the all-reduce adds the one rank's row that holds each id."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: ModelShard, group) -> None:
        super().__init__()
        self.first, rows = shard.vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = ids - self.first  # [T]
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.group.all_reduce(x.masked_fill_(outside[:, None], 0))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: PagedAttention, shard: ModelShard = WHOLE,
                 group=None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, attn, shard, group)
        self.mlp = MLP(cfg, shard, group)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, rope: RopeTables, x: torch.Tensor, kv: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        # In place: the residual stream is this forward's own tensor (the embedding's output).
        x += self.self_attn(rope, self.input_layernorm(x), kv, meta)
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class LlamaModel(nn.Module):
    """The decoder, or one rank's part of it (`shard`): a pipeline stage's layers (numbered
    from 0 here), the embedding on the first stage, the final norm on the last."""

    def __init__(self, cfg: ModelConfig, attn: PagedAttention, max_positions: int,
                 shard: ModelShard = WHOLE, group=None) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = None
        if shard.has_embedding:
            self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if shard.tp_size == 1
                                 else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard, group))
        self.layers = nn.ModuleList(DecoderLayer(cfg, attn, shard, group)
                                    for _ in range(shard.num_layers(cfg)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if shard.has_head else None


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: PagedAttention, max_positions: int,
                 shard: ModelShard = WHOLE, group=None) -> None:
        super().__init__()
        self.config = cfg
        self.shard = shard
        self.group = group
        self.model = LlamaModel(cfg, attn, max_positions, shard, group)
        self.lm_head = None
        if shard.has_head:
            rows = cfg.vocab_size if shard.tp_size == 1 else shard.vocab_rows(cfg.vocab_size)[1]
            self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)
        self._tie()

    def _tie(self) -> None:
        if self.config.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def build(
        cls, cfg: ModelConfig, attn: PagedAttention, max_positions: int,
        dtype: torch.dtype, device: torch.device, shard: ModelShard = WHOLE, group=None,
    ) -> LlamaForCausalLM:
        """Allocate on the target device without a throwaway random init."""
        with torch.device("meta"):
            model = cls(cfg, attn, max_positions, shard, group)
        model = model.to_empty(device=device).to(dtype)
        model._tie()  # to_empty replaces parameters one module at a time
        model.model.rotary.build(device)
        return model.eval()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,  # [T, hidden]: the previous pipeline stage's output
    ) -> torch.Tensor:  # [T, hidden]: normed on the last stage
        x = self.model.embed_tokens(input_ids) if hidden is None else hidden
        rope = self.model.rotary.tables(positions, x.dtype)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(rope, x, kv, meta)
        return x if self.model.norm is None else self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        logits = self.lm_head(hidden).float()  # [N, vocab / tp, padded]
        if self.shard.tp_size == 1:
            return logits
        return self.group.gather_last_dim(logits)[:, :self.config.vocab_size]  # [N, vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a Hugging Face checkpoint's tensors in by name; q/k/v and gate/up go into
        their rows of the fused projections. Every parameter row must come from it."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int]] = set()  # (parameter, first row) of each copied tensor
        expected: set[tuple[str, int]] = set()
        shards = self._fused_shards()
        for name, (rows_of, _) in shards.items():
            expected |= {(name, start) for start, _ in rows_of.values()}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            target, start, rows = self._destination(name, shards)
            if target not in params:
                if self.config.tie_word_embeddings and name == "lm_head.weight":
                    continue
                raise ValueError(f"checkpoint has an unexpected tensor {name!r}")
            param = params[target]
            dest = param if rows is None else param[start:start + rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(dest.shape)}"
                )
            with torch.no_grad():
                dest.copy_(tensor)
            loaded.add((target, start))
        expected |= {(n, 0) for n in params if n not in shards}
        if self.config.tie_word_embeddings:
            expected.discard(("lm_head.weight", 0))
        missing = sorted(self._source_name(n, start, shards) for n, start in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:5]}")

    def _fused_shards(self) -> dict[str, tuple[dict[str, tuple[int, int]], str]]:
        """Fused parameter -> ({checkpoint projection: (first row, rows)}, the part after it)."""
        shards = {}
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = {"q_proj": (0, attn.q_size), "k_proj": (attn.q_size, attn.kv_size),
                   "v_proj": (attn.q_size + attn.kv_size, attn.kv_size)}
            # None: a quantized checkpoint's layer, loaded by quant_checkpoint_load.py.
            if attn.qkv_proj is not None:
                for part in ("weight", "bias") if attn.qkv_proj.bias is not None else ("weight",):
                    shards[f"model.layers.{i}.self_attn.qkv_proj.{part}"] = (qkv, part)
            inter = mlp.intermediate_size
            if mlp.gate_up_proj is not None:
                shards[f"model.layers.{i}.mlp.gate_up_proj.weight"] = (
                    {"gate_proj": (0, inter), "up_proj": (inter, inter)}, "weight")
        return shards

    @staticmethod
    def _destination(name: str, shards) -> tuple[str, int, int | None]:
        """(parameter, first row, rows) a checkpoint tensor goes to; rows None: all of it."""
        prefix, _, rest = name.rpartition(".")
        module_path, _, proj = prefix.rpartition(".")
        fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                 "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}.get(proj)
        if fused is not None:
            target = f"{module_path}.{fused}.{rest}"
            if target in shards:
                start, rows = shards[target][0][proj]
                return target, start, rows
        return name, 0, None

    @staticmethod
    def _source_name(param: str, start: int, shards) -> str:
        if param not in shards:
            return param
        rows_of, part = shards[param]
        proj = next(p for p, (s, _) in rows_of.items() if s == start)
        module_path = param.rsplit(".", 2)[0]
        return f"{module_path}.{proj}.{part}"
