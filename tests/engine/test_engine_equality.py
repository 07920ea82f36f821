"""Greedy outputs equal transformers' greedy outputs, token for token, however the
engine batches, chunks, caches prefixes or preempts."""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config.model import ModelConfig
from kvpilot.engine.tiny.model import make_tiny_model

MAX_NEW = 12
SHAPES = {
    # Llama with GQA (8 query heads sharing 2 KV heads) and Qwen2 (q/k/v biases).
    "llama": dict(arch="llama", layers=2, hidden=128, heads=8, kv_heads=2, intermediate=256, vocab=1024),
    "qwen2": dict(arch="qwen2", layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=1024),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", seed=1, **SHAPES[request.param])


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    # Mixed lengths around block boundaries; two share a 40-token prefix.
    shared = [rng.randrange(10, 1000) for _ in range(40)]
    return [
        [rng.randrange(10, 1000) for _ in range(3)],
        [rng.randrange(10, 1000) for _ in range(17)],
        shared + [rng.randrange(10, 1000) for _ in range(9)],
        [rng.randrange(10, 1000) for _ in range(65)],
        shared + [rng.randrange(10, 1000) for _ in range(2)],
    ]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    """Greedy continuation by transformers, one prompt at a time, no padding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            result = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )
            outs.append(result[0, len(prompt):].tolist())
    return outs


# Each case squeezes the engine differently; the tokens must not change.
CASES = {
    "plain": dict(enable_prefix_caching=False),
    "prefix_caching": dict(enable_prefix_caching=True),
    "chunked_prefill": dict(enable_prefix_caching=True, max_num_batched_tokens=8),
    # 8 blocks of 16 tokens: the batch cannot all fit, so requests are preempted and recomputed.
    "preemption": dict(enable_prefix_caching=False, max_model_len=128, kv_blocks=8),
    "preemption_prefix": dict(enable_prefix_caching=True, max_model_len=128, kv_blocks=8),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_equals_transformers(model_dir, prompts, reference, case):
    args = dict(CASES[case])
    if "kv_blocks" in args:
        per_token = ModelConfig.from_dir(model_dir).kv_bytes_per_token
        args["kv_cache_memory"] = args.pop("kv_blocks") * 16 * per_token
    llm = LLM(model=str(model_dir), dtype="float32", **args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == reference
    stats = llm.engine.stats()
    if case.startswith("preemption"):
        assert stats.num_preemptions_total > 0, "the tiny KV cache should have forced preemption"
    if case == "prefix_caching":
        assert stats.prefix_cache_hits_total >= 32
    # Everything is released once the batch is done.
    assert stats.kv_cache_usage == 0.0


def test_greedy_equals_transformers_with_triton_kernels(model_dir, prompts, reference):
    """The Triton backend (run by Triton's CPU interpreter here) through the same
    engine: two short prompts keep the interpreted run affordable."""
    pytest.importorskip("triton")
    llm = LLM(model=str(model_dir), dtype="float32", attention_backend="triton",
              max_num_batched_tokens=16)  # the 17-token prompt is chunked: prefill + decode kernels
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference[:2]
