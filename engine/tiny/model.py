"""Write a small random-initialised Hugging Face-format causal LM, with a real tokenizer.

The directory `make_tiny_model` writes loads in `transformers.AutoModelForCausalLM` and
`AutoTokenizer` as well as in kvpilot: config.json, model.safetensors (or shards plus
model.safetensors.index.json), tokenizer.json (byte-level BPE trained at creation time on
source files of Python's own standard library), tokenizer_config.json (ChatML chat
template) and generation_config.json.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .tokenizer import (BOS_TOKEN, EOS_TOKEN, IM_END, MIN_VOCAB, SPECIAL_TOKENS,
                             tokenizer_config, train_tokenizer)
from ..config.validation import positive_int

ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "mistral": ("MistralForCausalLM", "mistral"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Files the weights go in, to clean up stale ones when writing over an old model.
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    arch: str = "llama",
    layers: int = 4,
    hidden: int = 256,
    heads: int = 8,
    kv_heads: int = 4,
    intermediate: int = 688,
    vocab: int = 4096,
    seed: int = 0,
    dtype: str = "float32",
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    shard_size_bytes: int | None = None,
) -> Path:
    """Write a random model of the given shape to `out_dir` and return its path.

    Special token ids: 0 `<|begin_of_text|>` (BOS, added by encode), 1 `<|end_of_text|>`,
    2 `<|im_start|>`, 3 `<|im_end|>`; generation_config stops on 1 and 3. The tokenizer
    learns up to `vocab` entries; when the corpus yields fewer (large `vocab`), the
    model's vocabulary is still `vocab` and the ids past the tokenizer decode to "".

    Files appear atomically: everything is written to a temporary folder next to
    `out_dir` and renamed into place, so a concurrent reader never sees half a model.
    """
    _validate(arch, layers, hidden, heads, kv_heads, intermediate, vocab, seed, dtype,
              max_position_embeddings, rope_theta, rope_scaling, shard_size_bytes)
    out = Path(out_dir).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab, arch)
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config = _hf_config(arch, layers, hidden, heads, kv_heads, intermediate, vocab, dtype,
                        max_position_embeddings, tie_word_embeddings, rope_theta, rope_scaling,
                        ids)
    tensors = _init_weights(config, seed, DTYPES[dtype])

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(max_position_embeddings, arch))
        _write_json(tmp / "generation_config.json", {
            "bos_token_id": ids[BOS_TOKEN],
            "eos_token_id": [ids[EOS_TOKEN], ids[IM_END]],
        })
        _save_weights(tmp, tensors, shard_size_bytes)
        _write_json(tmp / "config.json", config)
        for path in tmp.iterdir():  # mkdtemp and safetensors create owner-only files
            path.chmod(0o644)
        tmp.chmod(0o755)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _validate(arch, layers, hidden, heads, kv_heads, intermediate, vocab, seed, dtype,
              max_position_embeddings, rope_theta, rope_scaling, shard_size_bytes) -> None:
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; choose one of {sorted(ARCHS)}")
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads),
                        ("kv_heads", kv_heads), ("intermediate", intermediate),
                        ("vocab", vocab), ("max_position_embeddings", max_position_embeddings)):
        positive_int(name, value)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed={seed!r} must be an integer")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
    if (hidden // heads) % 2:
        raise ValueError(f"hidden/heads={hidden // heads} (the head dim) must be even for RoPE")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be divisible by kv_heads={kv_heads}")
    if vocab < MIN_VOCAB:
        raise ValueError(f"vocab={vocab} must be at least {MIN_VOCAB} (256 bytes + special tokens)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    if not isinstance(rope_theta, (int, float)) or isinstance(rope_theta, bool) or rope_theta <= 0:
        raise ValueError(f"rope_theta={rope_theta!r} must be a positive number")
    if rope_scaling is not None and not (
        isinstance(rope_scaling, dict) and ("rope_type" in rope_scaling or "type" in rope_scaling)
    ):
        raise ValueError(f"rope_scaling={rope_scaling!r} must be None or a dict with 'rope_type'")
    if shard_size_bytes is not None and (
        not isinstance(shard_size_bytes, int) or isinstance(shard_size_bytes, bool)
        or shard_size_bytes < 1
    ):
        raise ValueError(f"shard_size_bytes={shard_size_bytes!r} must be None or a positive integer")


def _hf_config(arch, layers, hidden, heads, kv_heads, intermediate, vocab, dtype,
               max_position_embeddings, tie_word_embeddings, rope_theta, rope_scaling,
               ids) -> dict[str, Any]:
    architecture, model_type = ARCHS[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": float(rope_theta),
        "rope_scaling": rope_scaling,
        "attention_dropout": 0.0,
        "tie_word_embeddings": bool(tie_word_embeddings),
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    else:  # mistral: full attention (no sliding window) keeps the engine's job plain
        config.update(sliding_window=None)
    return config


def _init_weights(config: dict[str, Any], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random weights in HF's parameter names, drawn in a fixed order from one generator.

    Scales are chosen so that every sub-layer changes the residual stream noticeably
    (the output depends on the context, not only on the last token) and logits spread
    over a few units, so greedy decoding is varied and ties are far apart.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    layers = config["num_hidden_layers"]
    bias = config["model_type"] == "qwen2"

    # Each tensor is cast as soon as it is drawn: a 1B-parameter shape stays in budget.
    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm_weight(scale: float = 1.0) -> torch.Tensor:
        return (scale * (1.0 + torch.randn(hidden, generator=gen) * 0.05)).to(dtype)

    # Tied embeddings: a token's own embedding would dominate its logits and greedy
    # decoding would repeat it, so keep embeddings small and let the final norm's
    # weight bring the logits back to a spread of a few units.
    tied = config["tie_word_embeddings"]
    embed_std = 0.25 / math.sqrt(hidden) if tied else 1.0
    final_norm_scale = 12.0 if tied else 1.0

    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=embed_std)
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm_weight()
        for name, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            out[p + f"self_attn.{name}.weight"] = normal(rows, hidden, std=1.0 / math.sqrt(hidden))
            if bias:
                out[p + f"self_attn.{name}.bias"] = normal(rows, std=0.1)
        out[p + "self_attn.o_proj.weight"] = normal(hidden, q_out, std=1.0 / math.sqrt(q_out))
        out[p + "post_attention_layernorm.weight"] = norm_weight()
        out[p + "mlp.gate_proj.weight"] = normal(inter, hidden, std=1.0 / math.sqrt(hidden))
        out[p + "mlp.up_proj.weight"] = normal(inter, hidden, std=1.0 / math.sqrt(hidden))
        out[p + "mlp.down_proj.weight"] = normal(hidden, inter, std=1.0 / math.sqrt(inter))
    out["model.norm.weight"] = norm_weight(final_norm_scale)
    if not tied:
        out["lm_head.weight"] = normal(config["vocab_size"], hidden, std=3.0 / math.sqrt(hidden))
    return out


def _save_weights(folder: Path, tensors: dict[str, torch.Tensor], shard_size_bytes: int | None) -> None:
    metadata = {"format": "pt"}
    if shard_size_bytes is None:
        save_file(tensors, str(folder / "model.safetensors"), metadata=metadata)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_size_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(folder / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _is_weight_file(name: str) -> bool:
    return name in _WEIGHT_FILES or (name.startswith("model-") and name.endswith(".safetensors"))


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished folder to `out`; into an existing non-empty one, file by file."""
    try:
        os.rename(tmp, out)  # replaces `out` if it is an empty directory
        return
    except OSError:
        if not out.is_dir():
            raise
    # `out` holds other files: replace ours one by one (each atomically), config.json
    # last, and drop weight files of an earlier model that the new one does not have.
    new = {p.name for p in tmp.iterdir()}
    for name in sorted(new - {"config.json"}):
        os.replace(tmp / name, out / name)
    for old in out.iterdir():
        if _is_weight_file(old.name) and old.name not in new:
            old.unlink()
    os.replace(tmp / "config.json", out / "config.json")
