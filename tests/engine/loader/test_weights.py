"""iter_safetensors: one file, shards by index, or any *.safetensors; CPU tensors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from kvpilot.engine.tiny.model import make_tiny_model
from kvpilot.engine.loader.weights import iter_safetensors, safetensors_files

SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, arch="qwen2")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    single = make_tiny_model(root / "single", **SMALL, seed=7)
    sharded = make_tiny_model(root / "sharded", **SMALL, seed=7, shard_size_bytes=60_000)
    return single, sharded


def test_sharded_round_trip_equals_unsharded(pair):
    single, sharded = pair
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    a, b = dict(iter_safetensors(single)), dict(iter_safetensors(sharded))
    assert a.keys() == b.keys() == index["weight_map"].keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())
    for name in a:
        assert a[name].device.type == "cpu" and torch.equal(a[name], b[name]), name


def test_sharded_loads_in_transformers(pair):
    from transformers import AutoModelForCausalLM

    single, sharded = pair
    m1 = AutoModelForCausalLM.from_pretrained(single)
    m2 = AutoModelForCausalLM.from_pretrained(sharded)
    ids = torch.tensor([[0, 100, 200, 300]])
    with torch.inference_mode():
        assert torch.equal(m1(ids).logits, m2(ids).logits)


def test_unindexed_files_and_errors(pair, tmp_path):
    single, sharded = pair
    loose = tmp_path / "loose"
    shutil.copytree(sharded, loose)
    (loose / "model.safetensors.index.json").unlink()
    assert len(safetensors_files(loose)) == len(list(sharded.glob("*.safetensors")))
    assert dict(iter_safetensors(loose)).keys() == dict(iter_safetensors(single)).keys()

    broken = tmp_path / "broken"
    shutil.copytree(sharded, broken)
    next(broken.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="missing shards"):
        safetensors_files(broken)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        list(iter_safetensors(empty))


def test_prefers_single_file_and_keeps_dtype(tmp_path):
    save_file({"a": torch.ones(2, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "other.safetensors"))
    out = dict(iter_safetensors(tmp_path))
    assert list(out) == ["a"] and out["a"].dtype == torch.bfloat16
