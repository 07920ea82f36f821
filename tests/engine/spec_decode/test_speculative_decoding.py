"""Speculative decoding through the engine (n-gram drafts): greedy output equals the
output without speculation token for token, however the engine batches, chunks, caches
prefixes or preempts, with n > 1, stop strings and logprobs; the live knob; the metrics.
(The verification's distribution is tested in test_rejection_sampler.py.)"""

from __future__ import annotations

import json
import math
import random

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config.model import ModelConfig
from kvpilot.engine.metrics.exporter import ServerMetrics
from kvpilot.engine.tiny.model import make_tiny_model

MAX_NEW = 24
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("spec") / "model", seed=3, arch="llama", layers=2,
                           hidden=128, heads=8, kv_heads=2, intermediate=256, vocab=512)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A smaller random model of the same tokenizer: its drafts are mostly rejected. Its KV
    layout (1 KV head) differs from the target's (2), as a real draft's does."""
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "model", seed=4, arch="llama", layers=1,
                           hidden=64, heads=4, kv_heads=1, intermediate=128, vocab=512)


def speculative_config(method: str, model_dir, small_draft) -> str:
    """ngram; the target as its own draft (every draft should be accepted: a test of the
    draft's KV bookkeeping); a small random draft (most rejected: a test of rollback)."""
    if method == "ngram":
        return NGRAM
    draft = model_dir if method == "self_draft" else small_draft
    return json.dumps({"model": str(draft), "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    phrase = [rng.randrange(10, 500) for _ in range(6)]
    shared = [rng.randrange(10, 500) for _ in range(40)]
    return [
        phrase * 5,  # repetitive: the n-gram proposer finds drafts at once
        [rng.randrange(10, 500) for _ in range(17)],
        shared + phrase * 2,
        [rng.randrange(10, 500) for _ in range(3)] * 8,
        shared + [rng.randrange(10, 500) for _ in range(2)],
    ]


CASES = {
    "plain": dict(enable_prefix_caching=False),
    "prefix_caching": dict(enable_prefix_caching=True),
    # A budget of 8 tokens: prompts are chunked and drafts are cut to fit the step.
    "chunked_prefill": dict(enable_prefix_caching=True, max_num_batched_tokens=8),
    # 10 blocks of 16 tokens: requests are preempted (their drafts dropped) and recomputed.
    "preemption": dict(enable_prefix_caching=True, max_model_len=128, kv_blocks=10),
}


def engine_args(model_dir, case: str, draft=None) -> dict:
    """A case's engine settings; with a draft model the cache gets the same number of
    blocks (each block then holds the draft's KV too)."""
    args = dict(CASES[case])
    if "kv_blocks" in args:
        per_token = sum(ModelConfig.from_dir(d).kv_bytes_per_token for d in (model_dir, draft) if d)
        args["kv_cache_memory"] = args.pop("kv_blocks") * 16 * per_token
    return dict(model=str(model_dir), dtype="float32", **args)


@pytest.fixture(scope="module")
def baseline(model_dir, prompts):
    """Each case's outputs without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return {case: [o.outputs[0].token_ids for o in LLM(**engine_args(model_dir, case)).generate(
        prompts, params, use_tqdm=False)] for case in CASES}


@pytest.mark.parametrize("method", ["ngram", "self_draft", "small_draft"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_equals_greedy_without_speculation(model_dir, small_draft, prompts, baseline, case, method):
    draft = {"self_draft": model_dir, "small_draft": small_draft}.get(method)
    llm = LLM(**engine_args(model_dir, case, draft),
              speculative_config=speculative_config(method, model_dir, small_draft))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == baseline[case]
    stats = llm.engine.stats()
    spec = stats.spec_decode
    assert spec.num_drafts > 0
    if method == "self_draft":
        assert spec.num_accepted_tokens == spec.num_draft_tokens, spec
    elif method == "ngram":
        assert spec.num_accepted_tokens > 0, "the repetitive prompts should be drafted for"
    assert spec.num_accepted_tokens <= spec.num_draft_tokens
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens
    assert spec.accepted_per_pos == sorted(spec.accepted_per_pos, reverse=True)  # a later position needs the earlier
    if case == "preemption":
        assert stats.num_preemptions_total > 0, "the small KV cache should have forced preemption"
    assert stats.kv_cache_usage == 0.0  # every block, the rolled-back drafts' included, is free again
    assert stats.generation_tokens_total == MAX_NEW * len(prompts)


def test_n_stop_strings_and_logprobs_match(model_dir, prompts):
    """n = 2 choices, stop strings cutting the output anywhere (also inside a run of
    accepted drafts) and the target's logprobs: as without speculation."""
    plain, spec = LLM(model=str(model_dir), dtype="float32"), LLM(model=str(model_dir), dtype="float32",
                                                                    speculative_config=NGRAM)
    full = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                          use_tqdm=False)
    decode = plain.get_tokenizer().decode
    # No stop, then the text of a span of each output's tokens (a long span inside a
    # repetitive run ends the output within a step's accepted drafts). Every (span, prompt)
    # pair is one request of a single batch per engine (was one generate call each).
    requests = []
    for span in (None, (3, 5), (10, 16), (14, 20)):
        stops = [decode(o.outputs[0].token_ids[span[0]:span[1]]) if span else None for o in full]
        for prompt, stop in zip(prompts, stops):
            if span and not stop.strip():
                continue
            requests.append((prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=2,
                                                    stop=[stop] if stop else None, logprobs=2)))
    assert len(requests) > len(prompts)  # some stop strings were used
    batch, params = [r[0] for r in requests], [r[1] for r in requests]
    a_all, b_all = (llm.generate(batch, params, use_tqdm=False) for llm in (plain, spec))
    for a, b in zip(a_all, b_all, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (y.text, y.token_ids, y.finish_reason, y.stop_reason) == (
                x.text, x.token_ids, x.finish_reason, x.stop_reason)
            assert [lp.token_id for lp in y.logprobs] == y.token_ids
            for lx, ly in zip(x.logprobs, y.logprobs):
                assert math.isclose(lx.logprob, ly.logprob, abs_tol=1e-4)
                assert [t for t, _ in ly.top] == [t for t, _ in lx.top]
    assert any(o.finish_reason == "stop" for r in b_all for o in r.outputs)  # a stop string cut one
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0
    assert spec.engine.stats().kv_cache_usage == 0.0


def test_sampling_with_speculation_is_seeded_and_reproducible(model_dir, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_NEW, ignore_eos=True, seed=7)
    runs = [[o.outputs[0].token_ids for o in LLM(model=str(model_dir), dtype="float32",
                                                  speculative_config=NGRAM).generate(prompts, params,
                                                                                     use_tqdm=False)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(len(t) == MAX_NEW and all(0 <= i < 512 for i in t) for t in runs[0])


def test_a_self_draft_is_accepted_when_sampling_too(model_dir, small_draft, prompts):
    """p == q: min(1, p/q) = 1, so a draft model identical to the target is always
    accepted, at any temperature; seeded runs repeat."""
    params = SamplingParams(temperature=0.9, max_tokens=MAX_NEW, ignore_eos=True, seed=11)
    runs = []
    for _ in range(2):
        llm = LLM(model=str(model_dir), dtype="float32",
                  speculative_config=speculative_config("self_draft", model_dir, small_draft))
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        spec = llm.engine.stats().spec_decode
        # Within float rounding of p == q (the two passes batch the same rows differently).
        assert spec.num_accepted_tokens >= 0.97 * spec.num_draft_tokens > 0, spec
    assert runs[0] == runs[1]


def test_a_draft_of_another_vocabulary_is_refused(model_dir, tmp_path):
    other = make_tiny_model(tmp_path / "other", layers=1, hidden=64, heads=4, kv_heads=2, intermediate=128,
                            vocab=600)
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft's vocabulary \(600\)"):
        LLM(model=str(model_dir), dtype="float32",
            speculative_config=json.dumps({"model": str(other), "num_speculative_tokens": 2}))


def test_the_live_knob_turns_speculation_off_and_back(model_dir, prompts):
    llm = LLM(model=str(model_dir), dtype="float32", speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    engine = llm.engine
    engine.update_limits(num_speculative_tokens=0)
    off = llm.generate(prompts, params, use_tqdm=False)
    assert engine.stats().spec_decode.num_drafts == 0
    engine.update_limits(num_speculative_tokens=2)
    on = llm.generate(prompts, params, use_tqdm=False)
    stats = engine.stats()
    assert stats.spec_decode.num_drafts > 0 and stats.num_speculative_tokens == 2
    assert stats.spec_decode.num_draft_tokens <= 2 * stats.spec_decode.num_drafts
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    for bad in (-1, 4, True, 1.5):  # 4: above the configured 3
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            engine.update_limits(num_speculative_tokens=bad, max_num_seqs=7)
        assert engine.num_speculative_tokens == 2 and engine.max_num_seqs != 7  # nothing applied
    with pytest.raises(ValueError, match="num_speculative_tokens: speculation is not configured"):
        LLM(model=str(model_dir), dtype="float32").engine.update_limits(num_speculative_tokens=1)


@pytest.mark.parametrize("value, field", [
    ('{"method": "ngram"}', "speculative_config.num_speculative_tokens"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "speculative_config.method"),
    ("not json", "speculative_config"),
])
def test_bad_speculative_config_names_the_field(model_dir, value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        LLM(model=str(model_dir), dtype="float32", speculative_config=value)


def test_metrics_have_vllm_names(model_dir, prompts):
    llm = LLM(model=str(model_dir), dtype="float32", speculative_config=NGRAM)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    metrics = ServerMetrics("m", 512)
    metrics.record_stats(stats)
    text = metrics.render().decode()
    spec = stats.spec_decode

    def value(series: str) -> float:
        return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series))
    assert value("vllm:spec_decode_num_drafts_total{") == spec.num_drafts
    assert value("vllm:spec_decode_num_draft_tokens_total{") == spec.num_draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens_total{") == spec.num_accepted_tokens
    for pos in range(3):
        assert value(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",'
                     f'position="{pos}"}}') == spec.accepted_per_pos[pos]
    assert value("kvpilot:num_speculative_tokens{") == 3


def test_greedy_equality_with_triton_kernels(model_dir, prompts, baseline):
    """The Triton backend (its CPU interpreter here): the verification's multi-token
    queries go through the prefill kernel."""
    pytest.importorskip("triton")
    llm = LLM(**engine_args(model_dir, "plain"), attention_backend="triton", speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts[2:3], params, use_tqdm=False)  # its output falls into a loop: drafts accepted
    assert [o.outputs[0].token_ids for o in outs] == baseline["plain"][2:3]
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
