"""The shape of a Hugging Face causal LM, read once from its config.json."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..quant.checkpoint import CheckpointQuantization, decoder_in_features, decoder_plan, quant_method
from ..quant.formats import PARSERS, READ, is_readable, parse_checkpoint

# HF `architectures` entry -> our model family. Mistral is Llama-shaped.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}

# config.json dtype names -> bytes per element (torch types live in device.py).
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
ROPE_TYPES = ("default", "linear", "llama3")  # what models/rotary.py computes


def unimplemented(raw: dict[str, Any], quantized_checkpoints: bool = False) -> str | None:
    """Why the engine would compute a different network than this config.json describes
    (a field it does not implement), or None. Such a model is refused, never served wrong.
    quantized_checkpoints: let the formats of quant_formats.py through (the engine reads
    them, after their own checks; the simulator models float weights only)."""
    window = raw.get("sliding_window")
    # Mistral applies a window whenever one is set; Qwen2 only with use_sliding_window
    # (false unless given, as in transformers' Qwen2Config).
    qwen2 = "Qwen2ForCausalLM" in (raw.get("architectures") or [])
    if window and raw.get("use_sliding_window", not qwen2) and window < raw.get("max_position_embeddings", 0):
        return (f"sliding_window={window} (attention limited to the last {window} tokens) is not "
                f"implemented: outputs past the window would differ from the model's")
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if raw.get(key):
            return f"{key}={raw[key]} (a mixture of experts) is not implemented; only dense decoders are"
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        return f"hidden_act={act!r} is not implemented (only silu)"
    if raw.get("mlp_bias"):
        return "mlp_bias=true is not implemented"
    if raw.get("quantization_config") and not (quantized_checkpoints and is_readable(raw)):
        read = (f"{READ} checkpoints are, and float32, bfloat16 and float16 weights"
                if quantized_checkpoints else "only float32, bfloat16 and float16 weights")
        return (f"quantization_config (quant_method={quant_method(raw)!r}): this quantized format is "
                f"not read ({read}); serve the float checkpoint, with --quantization int8 or int4 to "
                f"quantize it at load")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        return f"rope_scaling type {rope_type!r} is not implemented (only {', '.join(ROPE_TYPES)})"
    return None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # A quantized checkpoint's format and schemes (its decoder linears are integers).
    checkpoint_quantization: CheckpointQuantization | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V cache one token takes in the model's own dtype, all layers."""
        elem = DTYPE_BYTES[self.torch_dtype]
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem

    @classmethod
    def from_dict(cls, raw: dict[str, Any], quantization: str | None = None) -> ModelConfig:
        """`quantization`: the engine's quantize-at-load scheme, which needs float weights, or
        a checkpoint format (vLLM's names: compressed-tensors, gptq, awq), which needs a
        checkpoint in that format: the checkpoint's own config wins over the flag."""
        if quantization in PARSERS:
            if quant_method(raw) != quantization:
                has = (f"quantization_config (quant_method={quant_method(raw)!r})"
                       if raw.get("quantization_config") else "no quantization_config")
                raise ValueError(f"quantization={quantization!r} names the checkpoint's format, but "
                                 f"config.json has {has}")
        elif quantization and raw.get("quantization_config"):
            hint = (f"; or drop quantization: {quant_method(raw)} checkpoints are served as they are"
                    if is_readable(raw) else "")
            raise ValueError(
                f"quantization={quantization!r} quantizes float weights at load, but config.json has "
                f"quantization_config (quant_method={quant_method(raw)!r}): its weights are already "
                f"quantized; give the float checkpoint{hint}")
        archs = raw.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            raise ValueError(
                f"config.json: architectures={archs!r} is not supported; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        why = unimplemented(raw, quantized_checkpoints=True)
        if why is not None:
            raise ValueError(f"config.json: {why}")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
        # transformers >= 5 writes rope settings as one `rope_parameters` dict.
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"config.json: torch_dtype={dtype!r} is not supported")
        config = cls(
            architecture=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            torch_dtype=dtype,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )
        qc = parse_checkpoint(raw)
        if qc is None:
            return config
        # At start-up, before any weight is read: schemes the engine's layout cannot hold.
        decoder_plan(qc, config.num_hidden_layers, decoder_in_features(config))
        return dataclasses.replace(config, checkpoint_quantization=qc)

    @classmethod
    def from_dir(cls, model_dir: str | Path, quantization: str | None = None) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model: {model_dir} has no config.json")
        return cls.from_dict(json.loads(path.read_text()), quantization)
