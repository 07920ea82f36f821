"""q/k/v and gate/up are fused into one weight each at load time, from the checkpoint's
separate tensors: the logits equal transformers' (unfused) model, and a checkpoint
missing one shard or carrying a stray tensor is refused by name."""
from __future__ import annotations

import pytest
import torch

from kvpilot.engine.attention.layer import PagedAttention
from kvpilot.engine.config.model import ModelConfig
from kvpilot.engine.worker.model_runner import _prefill_meta
from kvpilot.engine.models.llama import LlamaForCausalLM
from kvpilot.engine.tiny.model import make_tiny_model
from kvpilot.engine.loader.weights import iter_safetensors

SHAPES = {"llama-gqa": dict(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96),
          "qwen2-bias": dict(arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96)}
BLOCK = 16


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", vocab=512, seed=3,
                           **SHAPES[request.param])


def _ours(model_dir) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(model_dir)
    model = LlamaForCausalLM.build(cfg, PagedAttention("torch"), cfg.max_position_embeddings,
                                   torch.float32, torch.device("cpu"))
    model.load_weights(iter_safetensors(model_dir))
    return model


def test_fused_projections_give_the_unfused_models_logits(model_dir):
    from transformers import AutoModelForCausalLM

    ours, cfg = _ours(model_dir), ModelConfig.from_dir(model_dir)
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n, _ in ours.named_parameters())
    ids = torch.randint(16, 512, (37,), generator=torch.Generator().manual_seed(0))
    blocks = -(-len(ids) // BLOCK)
    shape = (blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
    with torch.inference_mode():
        hidden = ours(ids, torch.arange(len(ids)), caches, _prefill_meta(len(ids), BLOCK, ids.device, "torch"))
        logits = ours.compute_logits(hidden)  # [T, vocab]
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        expected = ref(ids[None]).logits[0]
    # float32 on the CPU; one fused matmul sums in another order than three.
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_a_missing_shard_or_a_stray_tensor_is_refused_by_name(model_dir):
    weights = dict(iter_safetensors(model_dir))
    without_v = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    with pytest.raises(ValueError, match=r"missing tensors: \['model.layers.1.self_attn.v_proj.weight'\]"):
        _ours(model_dir).load_weights(without_v.items())
    without_up = {k: v for k, v in weights.items() if k != "model.layers.0.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight"):
        _ours(model_dir).load_weights(without_up.items())
    stray = {**weights, "model.layers.0.self_attn.w_proj.weight": torch.zeros(64, 64)}
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.w_proj.weight'"):
        _ours(model_dir).load_weights(stray.items())
    wrong = {**weights, "model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 64)}
    with pytest.raises(ValueError, match=r"k_proj.weight' has shape \(3, 64\)"):
        _ours(model_dir).load_weights(wrong.items())
