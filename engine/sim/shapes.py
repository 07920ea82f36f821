"""Model shapes for the timing model: any Hugging Face config.json (no weights needed),
or a named preset with the published config of a well-known model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.model import DTYPE_BYTES, unimplemented
from ..config.validation import positive_int


def _dense(arch: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
           vocab: int, max_positions: int) -> dict[str, Any]:
    return {"architectures": [arch], "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "vocab_size": vocab, "max_position_embeddings": max_positions,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


# The config.json fields the timing model reads, from the models' published configs.
PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B-Instruct
    "llama-3.1-8b": _dense("LlamaForCausalLM", 4096, 14336, 32, 32, 8, 128256, 131072),
    # meta-llama/Llama-3.1-70B-Instruct (needs tensor parallelism on 80 GB parts)
    "llama-3.1-70b": _dense("LlamaForCausalLM", 8192, 28672, 80, 64, 8, 128256, 131072),
    # Qwen/Qwen2.5-7B-Instruct
    "qwen2.5-7b": _dense("Qwen2ForCausalLM", 3584, 18944, 28, 28, 4, 152064, 32768),
    # mistralai/Mistral-7B-Instruct-v0.3 (no sliding window)
    "mistral-7b": _dense("MistralForCausalLM", 4096, 14336, 32, 32, 8, 32768, 32768),
}

_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class ModelShape:
    """What a dense decoder's step costs depend on."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    tokenizer_dir: str | None = None  # a model directory with tokenizer.json, if given one

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def linear_params_per_layer(self) -> int:
        """q, k, v, o and the gated MLP's three projections."""
        h, d = self.hidden_size, self.head_dim
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * d
        return qkv + self.num_heads * d * h + 3 * h * self.intermediate_size

    @property
    def num_params(self) -> int:
        h = self.hidden_size
        per_layer = self.linear_params_per_layer + 2 * h  # plus two RMSNorm weights
        if self.attention_bias:
            per_layer += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + embed + lm_head + h

    @property
    def norm_params(self) -> int:
        """The RMSNorm weights (two a layer and the final one): every tensor-parallel rank
        holds them whole, as it does nothing else."""
        return (2 * self.num_layers + 1) * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_config(cls, raw: dict[str, Any], name: str, dtype: str = "auto",
                    tokenizer_dir: str | None = None) -> ModelShape:
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise ValueError(f"simulate_model: {name}: config.json is missing {', '.join(missing)}")
        # Never model a different network than the config describes (nor serve one).
        why = unimplemented(raw)
        if why is not None:
            raise ValueError(f"simulate_model: {name}: config.json: {why}")

        def positive(key: str, value: Any) -> int:
            return positive_int(key, value, where=f"simulate_model: {name}: ")

        heads = positive("num_attention_heads", raw["num_attention_heads"])
        hidden = positive("hidden_size", raw["hidden_size"])
        kv_heads = positive("num_key_value_heads", raw.get("num_key_value_heads") or heads)
        head_dim = positive("head_dim", raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ValueError(f"simulate_model: {name}: num_attention_heads ({heads}) must be a "
                             f"multiple of num_key_value_heads ({kv_heads})")
        if dtype == "auto":
            dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
            if dtype == "float32":
                dtype = "bfloat16"  # GPUs serve float32 checkpoints in bf16 (vLLM's auto)
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"simulate_model: {name}: torch_dtype {dtype!r} is not supported; "
                             f"one of {sorted(DTYPE_BYTES)}")
        archs = raw.get("architectures") or []
        return cls(
            name=name, hidden_size=hidden,
            intermediate_size=positive("intermediate_size", raw["intermediate_size"]),
            num_layers=positive("num_hidden_layers", raw["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            vocab_size=positive("vocab_size", raw["vocab_size"]),
            max_position_embeddings=positive("max_position_embeddings",
                                             raw.get("max_position_embeddings", 4096)),
            dtype=dtype, tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias="Qwen2ForCausalLM" in archs or bool(raw.get("attention_bias", False)),
            tokenizer_dir=tokenizer_dir,
        )


def resolve_model_shape(spec: str, dtype: str = "auto") -> ModelShape:
    """A preset name, a config.json file, or a model directory holding one."""
    if spec in PRESETS:
        return ModelShape.from_config(PRESETS[spec], spec, dtype)
    path = Path(spec)
    if spec.startswith("builtin:"):
        from ..loader.source import resolve_model

        path = resolve_model(spec)
    tokenizer_dir = None
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            tokenizer_dir = str(path)
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"simulate_model: {spec!r} is neither a preset ({', '.join(PRESETS)}) "
                         f"nor a config.json file or a directory holding one")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"simulate_model: cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"simulate_model: {path} must hold a JSON object")
    return ModelShape.from_config(raw, spec, dtype, tokenizer_dir)
