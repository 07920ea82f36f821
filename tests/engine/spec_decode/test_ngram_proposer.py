"""propose_ngram: longest suffix n-gram first, its most recent earlier occurrence, the
tokens after it (continued periodically past the sequence's end), [] without a match; and a reference
(plain Python) implementation agrees on random sequences, long ones included."""

import numpy as np
import pytest

from kvpilot.engine.spec_decode.ngram_proposer import propose_ngram


def _reference(tokens, k, min_n, max_n):
    """The definition, literally: n from max_n down, the latest start before the suffix's."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        pattern = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == pattern:
                follow = start + n  # past the end, the sequence repeats with period length - follow
                return [tokens[follow + j % (length - follow)] for j in range(k)]
    return []


def test_match_returns_the_following_tokens():
    #          0  1  2  3  4  5  6  7  8
    tokens = [5, 1, 2, 3, 9, 8, 7, 1, 2]
    assert propose_ngram(tokens, k=3, min_n=1, max_n=4) == [3, 9, 8]


def test_most_recent_occurrence_wins():
    # "1 2" occurs at 0 (followed by 10) and at 3 (followed by 20): the later one wins.
    tokens = [1, 2, 10, 1, 2, 20, 7, 1, 2]
    assert propose_ngram(tokens, k=1, min_n=1, max_n=2) == [20]


def test_longest_n_wins_over_a_more_recent_shorter_match():
    # "3 1 2" at 0 is followed by 30; "1 2" alone, more recently at 5, by 40.
    tokens = [3, 1, 2, 30, 0, 1, 2, 40, 3, 1, 2]
    assert propose_ngram(tokens, k=1, min_n=1, max_n=3) == [30]
    assert propose_ngram(tokens, k=1, min_n=1, max_n=2) == [40]


def test_no_match():
    assert propose_ngram([1, 2, 3, 4, 5], k=4, min_n=1, max_n=4) == []
    assert propose_ngram([7], k=4, min_n=1, max_n=4) == []
    assert propose_ngram([], k=4, min_n=1, max_n=4) == []


def test_min_n_refuses_shorter_matches():
    tokens = [1, 2, 9, 5, 2]  # only the 1-gram "2" occurs earlier
    assert propose_ngram(tokens, k=2, min_n=1, max_n=3) == [9, 5]
    assert propose_ngram(tokens, k=2, min_n=2, max_n=3) == []


def test_max_n_caps_the_pattern():
    # With max_n=1 the last token alone decides: its latest earlier occurrence is at 4.
    tokens = [4, 5, 6, 0, 6, 1, 4, 5, 6]
    assert propose_ngram(tokens, k=1, min_n=1, max_n=1) == [1]
    assert propose_ngram(tokens, k=1, min_n=1, max_n=3) == [0]


def test_k_truncated_at_the_end_and_overlapping_the_suffix():
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    # "1 2 3 1 2" (max_n=5) last occurred at 0; the 3 tokens after it run into the suffix.
    assert propose_ngram(tokens, k=3, min_n=1, max_n=5) == [3, 1, 2]
    # Past the sequence's end the drafts continue with the period (here 3).
    assert propose_ngram(tokens, k=7, min_n=1, max_n=5) == [3, 1, 2, 3, 1, 2, 3]
    # Every token equal: the latest occurrence ends one before the last token, period 1.
    assert propose_ngram([7] * 10, k=4, min_n=1, max_n=4) == [7, 7, 7, 7]


def test_ndarray_input():
    tokens = np.array([5, 1, 2, 3, 9, 8, 7, 1, 2], dtype=np.int64)
    assert propose_ngram(tokens, k=2, min_n=2, max_n=2) == [3, 9]


@pytest.mark.parametrize("args, field", [
    (dict(k=0, min_n=1, max_n=2), "k"),
    (dict(k=True, min_n=1, max_n=2), "k"),
    (dict(k=2, min_n=0, max_n=2), "min_n"),
    (dict(k=2, min_n=1, max_n=2.0), "max_n"),
    (dict(k=2, min_n=3, max_n=2), "min_n"),
])
def test_bad_arguments_name_the_field(args, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        propose_ngram([1, 2, 1, 2], **args)


def test_agrees_with_the_reference_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(400):
        vocab = int(rng.integers(1, 6))
        tokens = rng.integers(0, vocab, int(rng.integers(0, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        assert propose_ngram(tokens, k, min_n, max_n) == _reference(tokens, k, min_n, max_n), (
            tokens, k, min_n, max_n)


def test_long_sequence():
    # 32k tokens of a 32k vocabulary (ids >= 100), with a 6-token phrase planted twice and,
    # later, its tokens 2..5 with another continuation; the sequence ends with the
    # phrase's first 5 tokens. max_n=5 finds the later full phrase, max_n=4 the later copy.
    rng = np.random.default_rng(1)
    tokens = rng.integers(100, 32000, 32768).tolist()
    phrase = [1, 2, 3, 4, 5, 6]
    tokens[1000:1007] = phrase + [50]
    tokens[9000:9007] = phrase + [60]
    tokens[20000:20005] = phrase[1:5] + [70]
    tokens[-5:] = phrase[:5]
    assert propose_ngram(tokens, k=3, min_n=1, max_n=5) == [6, 60, tokens[9007]]
    assert propose_ngram(tokens, k=3, min_n=1, max_n=4) == [70, tokens[20005], tokens[20006]]
    assert propose_ngram(tokens, k=2, min_n=5, max_n=5) == [6, 60]
    assert propose_ngram(tokens[:-5] + [7, 8, 9, 10, 11], k=2, min_n=2, max_n=4) == []
