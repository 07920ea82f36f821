"""tiny_train: trained tiny models, their held-out split, recipe checks, and the built-in
trained model (the one slow test: it fills the cache that later runs and other tests reuse)."""

from __future__ import annotations

import json
import re
import string
import sysconfig
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cli import main
from kvpilot.engine.config.model import ModelConfig
from kvpilot.engine.loader.source import resolve_model
from kvpilot.engine.models.llama_train import TrainableLlama
from kvpilot.engine.tiny.tokenizer import train_tokenizer
from kvpilot.engine.tiny.train import (TRAINING_REPORT, TrainConfig, corpus_split,
                                       encode_files, heldout_perplexity, heldout_windows,
                                       lr_at, make_trained_model, train)

SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512)
QUICK = dict(steps=15, batch_size=4, seq_len=64, lr=3e-3)
PYTHON_MARKERS = ("self", "return", "None", "if ", "def ", " = ", "):", "\n    ", "(", ")", ".")
IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"


def _cli_flags(shape: dict, recipe: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()] + [
        f"--train-{k.replace('_', '-')}={v}" for k, v in recipe.items()]


@pytest.fixture(scope="module")
def trained_twice(tmp_path_factory):
    """The same small recipe and seed trained twice: through the API and through the CLI."""
    root = tmp_path_factory.mktemp("tiny-train")
    api = make_trained_model(root / "api", train_config=TrainConfig(**QUICK, eval_tokens=4096),
                             seed=0, progress=False, **SMALL)
    assert main(["make-tiny-model", str(root / "cli"), "--train", *_cli_flags(SMALL, QUICK)]) == 0
    return api, root / "cli"


# -- the held-out split and the recipe ---------------------------------------------------


def test_heldout_split_is_disjoint_fixed_and_covers_the_stdlib():
    train_files, held_files = corpus_split()
    assert not set(train_files) & set(held_files)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert sorted(train_files + held_files) == sorted(stdlib.glob("*.py"))
    assert 0.03 < len(held_files) / (len(train_files) + len(held_files)) < 0.25
    assert corpus_split() == (train_files, held_files)


def test_lr_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_fraction=0.1, min_lr_fraction=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)


@pytest.mark.parametrize("kwargs, field", [
    (dict(steps=0), "steps"), (dict(batch_size=True), "batch_size"), (dict(seq_len=-4), "seq_len"),
    (dict(lr=0.0), "lr"), (dict(lr="fast"), "lr"), (dict(warmup_fraction=1.5), "warmup_fraction"),
    (dict(min_lr_fraction=-0.1), "min_lr_fraction"), (dict(weight_decay=float("nan")), "weight_decay"),
    (dict(eval_tokens=64, seq_len=64), "eval_tokens"),
])
def test_bad_recipe_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**kwargs)


def test_seq_len_beyond_the_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="seq_len=64 exceeds max_position_embeddings=32"):
        make_trained_model(tmp_path / "m", train_config=TrainConfig(seq_len=64), progress=False,
                           max_position_embeddings=32, **SMALL)
    assert not (tmp_path / "m").exists() and list(tmp_path.iterdir()) == []


def test_cli_flag_errors_name_the_flag(tmp_path, capsys):
    assert main(["make-tiny-model", str(tmp_path / "m"), "--train-steps", "5"]) == 2
    assert "--train-steps: only with --train" in capsys.readouterr().err
    assert main(["make-tiny-model", str(tmp_path / "m"), "--train", "--train-lr", "-1"]) == 2
    assert "lr must be a number" in capsys.readouterr().err
    assert main(["make-tiny-model", str(tmp_path / "m"), "--train", "--train-batch-size", "0"]) == 2
    assert "batch_size must be a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


# -- a small model, trained a few steps ------------------------------------------------


def test_training_lowers_loss_and_heldout_perplexity(trained_twice):
    report = json.loads((trained_twice[0] / TRAINING_REPORT).read_text())
    assert report["recipe"]["steps"] == QUICK["steps"] and report["seed"] == 0
    assert report["train_loss_last_tenth"] < report["train_loss_first"] - 1.0
    assert report["heldout_perplexity_after"] < report["heldout_perplexity_before"] / 4


def test_same_seed_same_bytes_and_the_tokenizer_is_make_tiny_models(trained_twice):
    api, cli = trained_twice
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (api / name).read_bytes() == (cli / name).read_bytes(), name
    saved = Tokenizer.from_file(str(api / "tokenizer.json"))
    assert saved.to_str() == train_tokenizer(SMALL["vocab"]).to_str()


def test_another_seed_draws_other_windows():
    stream = torch.arange(5000) % 97  # [tokens]
    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=97,
                                     hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))
    recipe = TrainConfig(steps=3, batch_size=2, seq_len=16, eval_tokens=32)

    def weights(seed: int) -> torch.Tensor:
        torch.manual_seed(0)  # the same start; only the data order follows `seed`
        model = TrainableLlama(cfg, 16)
        train(model, stream, recipe, seed, progress=False)
        return model.lm_head.weight.detach().clone()

    assert torch.equal(weights(1), weights(1))
    assert not torch.equal(weights(1), weights(2))


def test_trained_weights_give_the_same_logits_in_transformers(trained_twice):
    from transformers import AutoModelForCausalLM

    folder = trained_twice[0]
    ours = TrainableLlama(ModelConfig.from_dir(folder), 128)
    ours.load_checkpoint(load_file(str(folder / "model.safetensors")))
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([train_tokenizer(SMALL["vocab"]).encode("def f(x):\n    return x + 1\n").ids])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=2e-4, rtol=1e-4)


def test_engine_generates_what_the_training_forward_predicts(trained_twice):
    folder = trained_twice[0]
    ours = TrainableLlama(ModelConfig.from_dir(folder), 128)
    ours.load_checkpoint(load_file(str(folder / "model.safetensors")))
    llm = LLM(model=str(folder), dtype="float32", max_model_len=128)
    out = llm.generate(["import os\n"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    ids = list(out.prompt_token_ids)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(ours(torch.tensor([ids]))[0, -1].argmax()))
    assert out.outputs[0].token_ids == ids[len(out.prompt_token_ids):]


# -- the built-in trained model (trains once, about 3 minutes on 2 cores) --------------


def _looks_like_python(text: str, stdlib_words: set[str]) -> bool:
    """Printable, made of words the stdlib sources use, with some Python punctuation or
    keywords. An untrained model strings BPE pieces into non-words ("information_versionyn")."""
    printable = sum(c in string.printable for c in text) / max(1, len(text))
    words = re.findall(IDENTIFIER, text)
    known = sum(w in stdlib_words for w in words) / max(1, len(words))
    return printable > 0.95 and len(words) >= 5 and known > 0.8 and sum(
        m in text for m in PYTHON_MARKERS) >= 2


def test_builtin_tiny_trained_learns_python():
    trained, untrained = resolve_model("builtin:tiny-trained"), resolve_model("builtin:tiny")
    assert (trained / "tokenizer.json").read_bytes() == (untrained / "tokenizer.json").read_bytes()
    report = json.loads((trained / TRAINING_REPORT).read_text())
    assert report["recipe"] == asdict(TrainConfig()), "recipe changed: bump the cache name"

    # The report's numbers, recomputed here from the two folders' weights.
    tokenizer = train_tokenizer(4096)
    windows = heldout_windows(encode_files(tokenizer, corpus_split()[1]), 256, 8192)
    perplexity = {}
    for name, folder in (("trained", trained), ("untrained", untrained)):
        model = TrainableLlama(ModelConfig.from_dir(folder), 256)
        model.load_checkpoint(load_file(str(folder / "model.safetensors")))
        perplexity[name] = heldout_perplexity(model, windows)
    assert perplexity["trained"] < 300 < 4096 < perplexity["untrained"]  # 4096: a uniform guess
    assert report["heldout_perplexity_after"] < 300 < report["heldout_perplexity_before"]

    # Greedy text judged by words: most prompts must give Python-looking text (on this
    # machine all do), and the untrained model, from the same prompts, none.
    stdlib_words = {w for f in sum(corpus_split(), []) for w in re.findall(IDENTIFIER, f.read_text(errors="replace"))}
    prompts = ["def __init__(self", "class Error(Exception):\n    ",
               "    def close(self):\n        ", "def read_file(path):\n    "]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    passed = {}
    for name in ("builtin:tiny-trained", "builtin:tiny"):
        llm = LLM(model=name, dtype="float32", max_model_len=256)
        texts = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        passed[name] = [_looks_like_python(t, stdlib_words) for t in texts]
        assert texts[0] and all(texts), (name, texts)
    assert sum(passed["builtin:tiny-trained"]) >= 3 and passed["builtin:tiny-trained"][0], passed
    assert sum(passed["builtin:tiny"]) == 0, passed
