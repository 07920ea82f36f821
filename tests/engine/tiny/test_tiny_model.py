"""make_tiny_model writes models transformers loads; resolve_model finds and caches them."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file

from kvpilot.engine.loader import source as model_source
from kvpilot.engine.config.model import ModelConfig
from kvpilot.engine.loader.source import resolve_model
from kvpilot.engine.tiny.model import make_tiny_model
from kvpilot.engine.core.tokenizer import Tokenizer

SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512)


def _hf_greedy(model_dir, prompt="The capital of France is", n=24):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    ids = hf_tok(prompt, return_tensors="pt").input_ids
    out: list[int] = []
    with torch.inference_mode():  # plain greedy loop: generate() has a slow first call
        logits = model(ids).logits
        step = logits
        for _ in range(n):
            out.append(int(step[0, -1].argmax()))
            step = model(torch.cat([ids, torch.tensor([out])], dim=1)).logits
    return model, logits, out


def test_default_model_files_and_config(tiny_model_dir):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "generation_config.json"}
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["torch_dtype"] == "float32" and config["vocab_size"] == 4096
    mc = ModelConfig.from_dir(tiny_model_dir)
    assert (mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads,
            mc.head_dim, mc.intermediate_size, mc.vocab_size) == (4, 256, 8, 4, 32, 688, 4096)
    assert mc.kv_bytes_per_token == 4096
    assert (mc.bos_token_id, mc.eos_token_ids) == (0, (1,))
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 0, "eos_token_id": [1, 3]}
    tok_config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_default_model_runs_in_transformers(tiny_model_dir):
    model, logits, out = _hf_greedy(tiny_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert logits.shape[-1] == 4096 and torch.isfinite(logits).all()
    # Greedy decoding of random weights must not collapse into one repeated token.
    assert len(set(out)) >= 12, out
    assert Tokenizer.from_dir(tiny_model_dir).decode(out)


@pytest.mark.parametrize("arch,cls", [("qwen2", "Qwen2ForCausalLM"), ("mistral", "MistralForCausalLM")])
def test_other_architectures_load(arch, cls, tiny_qwen2_dir, tmp_path):
    folder = tiny_qwen2_dir if arch == "qwen2" else make_tiny_model(tmp_path / arch, arch=arch, **SMALL)
    model, logits, out = _hf_greedy(folder)
    assert type(model).__name__ == cls
    assert torch.isfinite(logits).all() and len(set(out)) >= 8
    weights = load_file(str(folder / "model.safetensors"))
    has_bias = "model.layers.0.self_attn.q_proj.bias" in weights
    assert has_bias == (arch == "qwen2")
    assert ModelConfig.from_dir(folder).attention_bias == (arch == "qwen2")


def test_tied_bf16_rope_scaled_padded_vocab(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    folder = make_tiny_model(tmp_path / "m", **{**SMALL, "vocab": 20000}, dtype="bfloat16",
                             tie_word_embeddings=True, rope_scaling=scaling)
    weights = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in weights
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    config = ModelConfig.from_dir(folder)
    assert config.torch_dtype == "bfloat16" and config.tie_word_embeddings
    assert config.rope_scaling["rope_type"] == "llama3"
    # The stdlib corpus yields fewer merges than 20000: the model's vocabulary is padded.
    tok = Tokenizer.from_dir(folder)
    assert config.vocab_size == 20000 > tok.vocab_size
    model, logits, out = _hf_greedy(folder)
    assert logits.shape[-1] == 20000 and torch.isfinite(logits.float()).all()
    assert len(set(out)) >= 8


def test_seeded_and_reproducible(tmp_path):
    a = load_file(str(make_tiny_model(tmp_path / "a", **SMALL, seed=3) / "model.safetensors"))
    b = load_file(str(make_tiny_model(tmp_path / "b", **SMALL, seed=3) / "model.safetensors"))
    c = load_file(str(make_tiny_model(tmp_path / "c", **SMALL, seed=4) / "model.safetensors"))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


def test_writes_into_existing_dir_and_replaces_weights(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    make_tiny_model(folder, **SMALL, shard_size_bytes=20_000)
    assert (folder / "model.safetensors.index.json").is_file()
    make_tiny_model(folder, **SMALL)
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "notes.txt",
                     "tokenizer.json", "tokenizer_config.json"]
    assert not list(tmp_path.glob(".m.tmp-*"))  # no temporary folder left behind
    assert make_tiny_model(tmp_path / "empty", **SMALL) == tmp_path / "empty"


@pytest.mark.parametrize("kwargs,field", [
    (dict(arch="gpt2"), "arch"),
    (dict(hidden=250), "hidden"),
    (dict(hidden=24, heads=8, kv_heads=4), "head dim"),
    (dict(heads=8, kv_heads=3), "kv_heads"),
    (dict(layers=0), "layers"),
    (dict(intermediate=-1), "intermediate"),
    (dict(vocab=100), "vocab"),
    (dict(dtype="int8"), "dtype"),
    (dict(seed="x"), "seed"),
    (dict(rope_theta=0), "rope_theta"),
    (dict(rope_scaling={"factor": 2.0}), "rope_scaling"),
    (dict(max_position_embeddings=0), "max_position_embeddings"),
    (dict(shard_size_bytes=0), "shard_size_bytes"),
])
def test_invalid_arguments_name_the_field(kwargs, field, tmp_path):
    with pytest.raises(ValueError, match=field):
        make_tiny_model(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


# -- resolve_model ---------------------------------------------------------------------


def test_resolve_paths(tiny_model_dir, tmp_path):
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    assert resolve_model(f"file://{tiny_model_dir}") == tiny_model_dir
    (tmp_path / "file").write_text("x")
    cases = {
        str(tmp_path / "nope"): "not a directory",
        str(tmp_path / "file"): "not a directory",
        str(tmp_path): "has no config.json",
        "builtin:huge": "not a built-in model",
        "gs://models/llama": "unsupported scheme",
        "file://relative/path": "absolute path",
        "": "expected a Hugging Face model directory",
    }
    for model, message in cases.items():
        with pytest.raises(ValueError, match=message) as info:
            resolve_model(model)
        assert "model=" in str(info.value) and "config.json" in str(info.value)


def test_builtin_tiny_is_created_once(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "cache"))
    import kvpilot.engine.tiny.model as tiny_model

    calls = []
    real = tiny_model.make_tiny_model

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny_model, "make_tiny_model", counting)
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model("builtin:tiny")))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = tmp_path / "cache" / "models" / model_source.BUILTIN_MODELS["builtin:tiny"]
    assert results == [expected] * 3
    assert calls == [{"seed": 0}]
    mtime = (expected / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("builtin:tiny") == expected and len(calls) == 1
    assert (expected / "model.safetensors").stat().st_mtime_ns == mtime
    config = ModelConfig.from_dir(expected)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (4, 256, 4096)
    # The same model the session fixture makes with the defaults and seed 0.
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (expected / name).read_bytes() == (tiny_model_dir / name).read_bytes()
