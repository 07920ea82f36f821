"""Deterministic pseudo-random output tokens for simulated requests.

Every value is a pure function of the request's seed and the token's position (a
counter-based hash, no generator state), so a request yields the same tokens whatever
the batch, the clock or a preemption does to it, and the virtual-clock simulator and the
real-time server agree token for token."""

from __future__ import annotations

from ..config.simulation import OutputLengths
from ..core.outputs import TokenLogprob

_MASK = (1 << 64) - 1
_EOS_SALT = 0x5EED_E05
_LOGPROB_SALT = 0x10_6900B


def mix64(x: int) -> int:
    """SplitMix64's finaliser: a well-mixed 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, salt: int) -> float:
    """A uniform draw in [0, 1) fixed by (seed, salt)."""
    return mix64((seed * 0x100000001B3) ^ salt) / 2.0**64


class TokenSource:
    """Output token ids drawn from [low, high) (the tokenizer's ordinary tokens, so the
    text decodes), with EOS at the request's drawn length unless it ignores EOS."""

    def __init__(self, low: int, high: int, eos_token_id: int | None, lengths: OutputLengths) -> None:
        if high <= low:
            raise ValueError(f"token range [{low}, {high}) is empty")
        self.low, self.span = low, high - low
        self.eos_token_id = eos_token_id
        self.lengths = lengths

    def eos_at(self, seed: int) -> int:
        """The output length (1-based count) at which this request's EOS comes."""
        return self.lengths.sample(uniform(seed, _EOS_SALT))

    def token(self, seed: int, index: int, ignore_eos: bool, min_tokens: int = 0) -> int:
        """The token at output position `index` (0-based)."""
        if not ignore_eos and self.eos_token_id is not None:
            if index + 1 == max(self.eos_at(seed), min_tokens + 1):
                return self.eos_token_id
        return self.low + mix64((seed << 20) ^ index) % self.span

    def next_tokens(self, requests: list) -> list[list[int]]:
        """Each request's token at its next output position, as token() gives it ([t] per
        request): tokens_ignoring_eos for the requests that ignore EOS (most traces'), the
        rest ask token()."""
        token, run = self.token, self.tokens_ignoring_eos
        out = []
        for r in requests:
            p = r.sampling_params
            if p.ignore_eos or self.eos_token_id is None:
                out.append(run(r.seed, len(r.output_token_ids), 1))
            else:
                out.append([token(r.seed, len(r.output_token_ids), p.ignore_eos, p.min_tokens)])
        return out

    def tokens_ignoring_eos(self, seed: int, start: int, count: int) -> list[int]:
        """The tokens at output positions start .. start + count - 1 of a request that
        ignores EOS (or with no EOS id), as token() gives them: SplitMix64 inlined, since the
        simulator draws one for every sequence of every step (the fleet's fast-forward, a
        run at a time)."""
        low, span, out = self.low, self.span, []
        for index in range(start, start + count):
            x = (((seed << 20) ^ index) + 0x9E3779B97F4A7C15) & _MASK
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
            out.append(low + (x ^ (x >> 31)) % span)
        return out

    def logprob(self, seed: int, index: int, token: int, top: int) -> TokenLogprob:
        """Plausible, deterministic logprobs: the chosen token and `top` alternatives."""
        chosen = -3.0 * uniform(seed, _LOGPROB_SALT ^ index)
        alternatives = [(token, chosen)] + [
            (self.low + mix64((seed << 21) ^ (index << 5) ^ j) % self.span, chosen - 0.5 * j)
            for j in range(1, top)]
        return TokenLogprob(token, chosen, alternatives[:top])
