"""argmax_rows equals torch's argmax: ties, NaN, infinities, partial last chunks."""

import torch
from hypothesis import given, settings, strategies as st

from kvpilot.engine.sample.argmax_rows import CHUNK, argmax_rows


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 5 * CHUNK + 7), seed=st.integers(0, 2**31 - 1),
       levels=st.integers(1, 4), specials=st.lists(
           st.tuples(st.integers(0, 5), st.integers(0, 10**6),
                     st.sampled_from([float("nan"), float("inf"), float("-inf")])), max_size=4))
def test_equals_torch_argmax(rows, vocab, seed, levels, specials):
    g = torch.Generator().manual_seed(seed)
    # Few distinct values: many ties, so "the first index" is exercised.
    x = torch.randint(0, levels, (rows, vocab), generator=g).float()
    for r, c, value in specials:
        x[r % rows, c % vocab] = value
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_all_minus_infinity_and_strided_input():
    x = torch.full((3, 32000), float("-inf"))
    assert argmax_rows(x).tolist() == [0, 0, 0]
    y = torch.randn(32001, 4).t()  # rows that are not contiguous
    assert torch.equal(argmax_rows(y), y.argmax(dim=-1))
