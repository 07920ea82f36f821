"""Deterministic pseudo-random output tokens for simulated requests.

Every value is a pure function of the request's seed and the token's position (a
counter-based hash, no generator state), so a request yields the same tokens whatever
the batch, the clock or a preemption does to it, and the virtual-clock simulator and the
real-time server agree token for token."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

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


@dataclass(frozen=True)
class OutputLengths:
    """Where EOS comes for a request that does not ignore it: `KIND:ARGS` with
    fixed:N, uniform:LO:HI, exponential:MEAN or lognormal:MEDIAN:SIGMA."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, field: str = "simulate_output_len") -> OutputLengths:
        kind, _, rest = str(text).partition(":")
        args = rest.split(":") if rest else []
        arity = {"fixed": 1, "uniform": 2, "exponential": 1, "lognormal": 2}
        if kind not in arity:
            raise ValueError(f"{field}: unknown distribution {kind!r}; use fixed:N, uniform:LO:HI, "
                             f"exponential:MEAN or lognormal:MEDIAN:SIGMA")
        if len(args) != arity[kind]:
            raise ValueError(f"{field}: {kind} takes {arity[kind]} number(s), got {text!r}")
        try:
            values = [float(v) for v in args]
        except ValueError:
            raise ValueError(f"{field}: {text!r} has a value that is not a number") from None
        if any(not math.isfinite(v) or v <= 0 for v in values):
            raise ValueError(f"{field}: values must be positive and finite, got {text!r}")
        if kind == "uniform" and values[0] > values[1]:
            raise ValueError(f"{field}: uniform:LO:HI needs LO <= HI, got {text!r}")
        return cls(kind, *values)

    def sample(self, u: float) -> int:
        """The length at quantile u in [0, 1); at least 1."""
        if self.kind == "fixed":
            n = self.a
        elif self.kind == "uniform":
            n = self.a + u * (self.b - self.a + 1)
        elif self.kind == "exponential":
            n = -self.a * math.log1p(-u)
        else:
            n = self.a * math.exp(self.b * NormalDist().inv_cdf(min(max(u, 1e-12), 1 - 1e-12)))
        return max(1, int(n))

    def __str__(self) -> str:
        args = [self.a] + ([self.b] if self.kind in ("uniform", "lognormal") else [])
        return self.kind + "".join(f":{v:g}" for v in args)


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

    def logprob(self, seed: int, index: int, token: int, top: int) -> TokenLogprob:
        """Plausible, deterministic logprobs: the chosen token and `top` alternatives."""
        chosen = -3.0 * uniform(seed, _LOGPROB_SALT ^ index)
        alternatives = [(token, chosen)] + [
            (self.low + mix64((seed << 21) ^ (index << 5) ^ j) % self.span, chosen - 0.5 * j)
            for j in range(1, top)]
        return TokenLogprob(token, chosen, alternatives[:top])
