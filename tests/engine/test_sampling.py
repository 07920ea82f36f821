"""Sampling parameters, the sampler, seeded reproducibility and stop strings."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.core.request import Request, SampleState
from kvpilot.engine.sample.sampler import Sampler, SamplingBatch


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=50), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(seed="x"), "seed"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(n=True), "n"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_vllm_spelling_of_disabled_top_k():
    assert SamplingParams(top_k=-1).top_k == 0


def _req(params: SamplingParams, out=(), prompt=(1, 2), stop_ids=frozenset({0}), gen=None) -> Request:
    r = Request("r", list(prompt), params, params.max_tokens or 16, stop_ids, sample=SampleState(generator=gen))
    r.output_token_ids = list(out)
    return r


def test_top_k_one_is_greedy_and_min_tokens_masks_stop():
    logits = torch.randn(3, 50)
    logits[:, 0] = 100.0  # the stop token dominates
    reqs = [
        _req(SamplingParams(temperature=1.0, top_k=1)),
        _req(SamplingParams(temperature=0.0, min_tokens=3), out=[5]),
        _req(SamplingParams(temperature=0.0)),
    ]
    out = Sampler()(logits, SamplingBatch.build(reqs, 50, torch.device("cpu")))
    assert out.token_ids[0].item() == 0
    assert out.token_ids[1].item() == logits[1, 1:].argmax().item() + 1  # stop masked
    assert out.token_ids[2].item() == 0


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=1)
    seen = set()
    for seed in range(200):
        req = _req(params, gen=torch.Generator().manual_seed(seed))
        seen.add(Sampler()(logits, SamplingBatch.build([req], 4, torch.device("cpu"))).token_ids.item())
    assert seen == {0, 1}


def test_penalties_discourage_repeats():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 1.0
    req = _req(SamplingParams(temperature=0.0, frequency_penalty=2.0), out=[3, 3])
    out = Sampler()(logits, SamplingBatch.build([req], 10, torch.device("cpu")))
    assert out.token_ids.item() != 3


def test_logprobs_are_raw_model_logprobs():
    logits = torch.randn(2, 30)
    reqs = [_req(SamplingParams(temperature=0.0, logprobs=3)), _req(SamplingParams(temperature=0.0))]
    out = Sampler()(logits, SamplingBatch.build(reqs, 30, torch.device("cpu")))
    expected = torch.log_softmax(logits, -1)
    assert torch.allclose(out.top_logprobs[0], expected[0].topk(3).values)
    assert torch.allclose(out.logprob, expected.max(-1).values)


@pytest.fixture(scope="module")
def llm():
    return LLM(model="builtin:tiny", dtype="float32", max_model_len=512)


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    first = llm.generate(["Once upon a time", "The quick brown fox"], params, use_tqdm=False)
    # Same seed in a different batch (alone, after other work): the same tokens.
    llm.generate(["unrelated warm-up"], SamplingParams(temperature=1.0, max_tokens=5), use_tqdm=False)
    again = llm.generate(["The quick brown fox"], params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[1].outputs[0].token_ids
    other = llm.generate(["The quick brown fox"], SamplingParams(
        temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert other[0].outputs[0].token_ids != first[1].outputs[0].token_ids


def test_n_children_differ_and_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a = llm.generate(["Hello"], params, use_tqdm=False)[0]
    b = llm.generate(["Hello"], params, use_tqdm=False)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_stop_strings_cut_exactly(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = llm.generate(["def main():"], greedy, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 12
    stop = full[5:9]  # a substring that first occurs at or before index 5
    first = full.find(stop)
    cut = llm.generate(["def main():"], SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.text == full[:first]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(["def main():"], SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False)[0].outputs[0]
    assert kept.text == full[: first + len(stop)]


def test_max_tokens_and_length_errors_name_both_numbers(llm):
    with pytest.raises(ValueError, match=r"500.*100.*600.*512"):
        llm.generate([[11] * 500], SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(), use_tqdm=False)
