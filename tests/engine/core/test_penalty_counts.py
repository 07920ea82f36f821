"""Penalty counts grow with each request's new tokens; they always equal a count from
scratch, and the batch the sampler sees equals one built from the whole history."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.sample.penalties import PenaltyCounts
from kvpilot.engine.core.request import Request
from kvpilot.engine.sample.sampler import SamplingBatch
from kvpilot.engine.core.sampling_params import SamplingParams

VOCAB = 40
CPU = torch.device("cpu")


def _from_scratch(prompt: list[int], output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).float()
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[prompt] = True
    return counts, mask


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
       chunks=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=5), max_size=12))
def test_incremental_counts_equal_a_count_from_scratch(prompt, chunks):
    state = PenaltyCounts.of_prompt(prompt, VOCAB, CPU)
    output: list[int] = []
    for chunk in chunks:  # a step may add no token (a chunked prefill) or several
        output += chunk
        state.update(output)
        counts, mask = _from_scratch(prompt, output)
        assert torch.equal(state.output_counts, counts) and torch.equal(state.prompt_mask, mask)


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=3, max_size=3), min_size=1,
                      max_size=8))
def test_the_batch_rows_follow_each_request_and_skip_the_unpenalized(steps):
    params = [SamplingParams(frequency_penalty=0.5), SamplingParams(), SamplingParams(presence_penalty=1.0)]
    reqs = [Request(f"r{i}", [i, i + 1], p, max_tokens=100, stop_token_ids=frozenset())
            for i, p in enumerate(params)]
    for tokens in steps:
        for r, t in zip(reqs, tokens):
            r.output_token_ids.append(t)
        batch = SamplingBatch.build(reqs, VOCAB, CPU)
        for i, r in enumerate(reqs):
            counts, mask = _from_scratch(r.prompt_token_ids, r.output_token_ids)
            if not r.sampling_params.has_penalties:
                counts, mask = torch.zeros(VOCAB), torch.zeros(VOCAB, dtype=torch.bool)
            assert torch.equal(batch.output_counts[i], counts)
            assert torch.equal(batch.prompt_mask[i], mask)
    assert reqs[1].sample.penalty_counts is None
