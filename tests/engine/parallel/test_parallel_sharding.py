"""Tensor/pipeline parallelism without processes: the split plan, the refusals, the sharded
reader's bytes and padding, and the micro-batch split of a step."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from kvpilot.engine.config.engine import EngineConfig
from kvpilot.engine.config.model import ModelConfig
from kvpilot.engine.loader.sharded_reader import SafetensorsFile, ShardedCheckpoint
from kvpilot.engine.parallel.sharding import ModelShard, check_divisible, stage_layers
from kvpilot.engine.worker.step_inputs import StepInputs
from kvpilot.engine.tiny.model import make_tiny_model


@pytest.fixture(scope="module")
def odd_vocab_model(tmp_path_factory):
    """Vocabulary 1001 (not divisible by 2 or 4), tied embeddings off, Qwen2 biases."""
    return make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", arch="qwen2", layers=3, hidden=64,
                           heads=4, kv_heads=2, intermediate=96, vocab=1001)


def test_stage_layers_cover_every_layer_once():
    assert [stage_layers(5, 2, s) for s in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layers(4, 4, s) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for n, p in ((7, 3), (32, 5), (80, 8)):
        spans = [stage_layers(n, p, s) for s in range(p)]
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert max(e - s for s, e in spans) - min(e - s for s, e in spans) <= 1


def test_splits_the_model_cannot_compute_are_refused_naming_the_field(odd_vocab_model):
    cfg = ModelConfig.from_dir(odd_vocab_model)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 does not divide the model's num_key_value_heads \(2\)"):
        check_divisible(cfg, 4, 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide the model's num_attention_heads"):
        check_divisible(cfg, 3, 1)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 4 is more than the model's num_hidden_layers \(3\)"):
        check_divisible(cfg, 1, 4)
    check_divisible(cfg, 2, 3)


@pytest.mark.parametrize("bad, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (dict(pipeline_parallel_size=True), "pipeline_parallel_size must be a positive integer"),
    (dict(tensor_parallel_size=17), "tensor_parallel_size must be at most 16"),
    (dict(pipeline_micro_batches=0), "pipeline_micro_batches must be a positive integer"),
    (dict(tensor_parallel_size=2, quantization="int8"), "quantization='int8' with tensor_parallel_size"),
])
def test_engine_config_bounds_the_parallel_sizes(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="builtin:tiny", **bad)


def test_shard_slices_follow_megatron():
    shard = ModelShard(tp_size=2, tp_rank=1)
    assert shard.slice_of("model.layers.0.self_attn.q_proj.weight", (64, 64)) == (0, 32, 32)
    assert shard.slice_of("model.layers.0.self_attn.k_proj.bias", (32,)) == (0, 16, 16)
    assert shard.slice_of("model.layers.0.self_attn.o_proj.weight", (64, 64)) == (1, 32, 32)
    assert shard.slice_of("model.layers.0.mlp.down_proj.weight", (64, 96)) == (1, 48, 48)
    assert shard.slice_of("model.layers.0.mlp.up_proj.weight", (96, 64)) == (0, 48, 48)
    assert shard.slice_of("model.layers.0.input_layernorm.weight", (64,)) is None
    assert shard.slice_of("model.norm.weight", (64,)) is None
    assert shard.slice_of("lm_head.weight", (1001, 64)) == (0, 501, 501)  # padded: ceil(1001 / 2)


def test_pipeline_stages_read_only_their_layers(odd_vocab_model):
    cfg = ModelConfig.from_dir(odd_vocab_model)
    first, last = (ModelShard.plan(cfg, 1, 0, 2, s) for s in (0, 1))
    assert first.local_name("model.layers.1.mlp.up_proj.weight", cfg) == "model.layers.1.mlp.up_proj.weight"
    assert first.local_name("model.layers.2.mlp.up_proj.weight", cfg) is None
    assert last.local_name("model.layers.2.mlp.up_proj.weight", cfg) == "model.layers.0.mlp.up_proj.weight"
    assert first.local_name("lm_head.weight", cfg) is None and last.local_name("lm_head.weight", cfg) == "lm_head.weight"
    assert last.local_name("model.embed_tokens.weight", cfg) is None  # untied: the first stage's only


def test_sharded_reader_reads_each_slice_once_and_pads_the_vocabulary(odd_vocab_model):
    cfg = ModelConfig.from_dir(odd_vocab_model)
    path = odd_vocab_model / "model.safetensors"
    header = SafetensorsFile(path).bytes_read  # 8 + the JSON header
    full = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            full[name] = f.get_tensor(name)
    total = sum(t.numel() * t.element_size() for t in full.values())
    reads = []
    for rank in range(2):
        shard = ModelShard.plan(cfg, 2, rank, 1, 0)
        checkpoint = ShardedCheckpoint(odd_vocab_model, cfg, shard)
        got = dict(checkpoint)
        for name, tensor in got.items():
            cut = shard.slice_of(name, tuple(full[name].shape))
            if cut is None:
                assert torch.equal(tensor, full[name]), name
                continue
            dim, start, length = cut
            want = full[name].narrow(dim, start, min(length, full[name].shape[dim] - start))
            assert torch.equal(tensor.narrow(dim, 0, want.shape[dim]), want), name
            if tensor.shape[dim] > want.shape[dim]:  # the vocabulary's padding rows
                assert name in ("model.embed_tokens.weight", "lm_head.weight")
                assert not tensor.narrow(dim, want.shape[dim], tensor.shape[dim] - want.shape[dim]).any()
        reads.append(checkpoint.bytes_read - header)
    replicated = sum(t.numel() * t.element_size() for n, t in full.items() if "norm" in n)
    # Every byte of a sharded tensor is read by exactly one rank; the norms by both.
    assert sum(reads) == total + replicated
    assert all(r <= total / 2 + replicated for r in reads), (reads, total)


def _step() -> StepInputs:
    # Three sequences: a 3-token prefill chunk (no sample), a decode with 2 drafts, a decode.
    qlens, seq_lens = [3, 3, 1], [3, 9, 5]
    ends = torch.cumsum(torch.tensor(qlens), 0)
    return StepInputs(torch.arange(7), torch.arange(7), torch.arange(7), torch.zeros(3, 1, dtype=torch.int32),
                      seq_lens, qlens, torch.cat([torch.zeros(1, dtype=torch.long), ends]).to(torch.int32),
                      [3, 6], [], [[11, 12], []])


def test_micro_batches_keep_the_steps_logit_rows_in_order():
    step = _step()
    assert step.logit_rows() == [3, 4, 5, 6]
    for parts in (1, 2, 3, 8):
        split = step.split(parts)
        assert len(split) == min(parts, 3)
        assert sum(len(p.seq_lens) for p in split) == 3
        offset, rows = 0, []
        for p in split:
            assert int(p.query_start_loc[0]) == 0 and int(p.query_start_loc[-1]) == p.input_ids.shape[0]
            rows += [r + offset for r in p.logit_rows()]
            offset += p.input_ids.shape[0]
        assert rows == step.logit_rows()
