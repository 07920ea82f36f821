"""The request mix of `kvpilot bench soak`: deterministic from a seed, every request valid.

Both generation endpoints, streaming or not, `n` 1-3, stop strings, logprobs, seeds,
`ignore_eos`, usage chunks, text and token-id prompts; a share of streaming requests is
marked to be cancelled (the client disconnects after a few chunks)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .serve import MIN_TOKEN_ID

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
WORDS = ("the", "model", "cache", "block", "token", "serve", "queue", "batch", "river", "stone",
         "light", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "paged", "attention",
         "what", "is", "a", "good", "name", "for", "seven", "blue", "ships", "and", "an", "owl")
# Strings the tiny random model's output holds often ("e", "\n") or never ("zqx"), so some
# requests stop on a string, some mid-token, some run to max_tokens.
STOP_SETS = (["e"], ["\n"], ["on", "ed"], ["the", "."], ["zqx"], ["a", "i", "o"])
CANCEL_MIN_TOKENS = 16  # a request cancelled after at most a quarter of its output


@dataclass(frozen=True)
class SoakRequest:
    index: int
    endpoint: str  # a key of ENDPOINTS
    stream: bool
    n: int
    logprobs: bool
    include_usage: bool
    body: dict
    cancel_after: int | None = None  # content chunks to read before disconnecting

    @property
    def kind(self) -> str:
        return f"{self.endpoint}/{'stream' if self.stream else 'json'}"

    @property
    def path(self) -> str:
        return ENDPOINTS[self.endpoint]


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_request(index: int, rng: random.Random, *, model: str, vocab_size: int, max_tokens: int,
                 cancel_fraction: float) -> SoakRequest:
    cancel = rng.random() < cancel_fraction
    endpoint = rng.choice(tuple(ENDPOINTS))
    stream = cancel or rng.random() < 0.5
    n = rng.randint(1, 3)
    body: dict = {"model": model, "n": n, "stream": stream}
    include_usage = stream and rng.random() < 0.5
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if endpoint == "completions" and rng.random() < 0.25:
        high = max(vocab_size, MIN_TOKEN_ID + 1)
        body["prompt"] = [rng.randrange(MIN_TOKEN_ID, high) for _ in range(rng.randint(4, 96))]
    elif endpoint == "completions":
        body["prompt"] = _text(rng, 3, 60)
    else:
        messages = [{"role": "system", "content": _text(rng, 3, 12)}] if rng.random() < 0.3 else []
        if rng.random() < 0.2:
            messages += [{"role": "user", "content": _text(rng, 2, 10)},
                         {"role": "assistant", "content": _text(rng, 2, 10)}]
        body["messages"] = messages + [{"role": "user", "content": _text(rng, 2, 40)}]
    temperature = rng.choice((0.0, 0.7, 1.0))
    body["temperature"] = temperature
    if temperature and rng.random() < 0.5:
        body["seed"] = rng.randrange(1 << 31)
    logprobs = rng.random() < 0.3
    if logprobs and endpoint == "completions":
        body["logprobs"] = rng.randint(0, 3)
    elif logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = rng.randint(0, 3)
    cancel_after = None
    if cancel:  # long enough and with nothing to end it early, so the disconnect is mid-stream
        tokens = max(max_tokens, CANCEL_MIN_TOKENS)
        body["ignore_eos"] = True
        cancel_after = rng.randint(1, tokens // 4)
    else:
        tokens = rng.randint(1, max_tokens)
        if rng.random() < 0.3:
            body["stop"] = rng.choice(STOP_SETS)
        if rng.random() < 0.2:
            body["ignore_eos"] = True
    length_field = "max_completion_tokens" if endpoint == "chat" and rng.random() < 0.5 else "max_tokens"
    body[length_field] = tokens
    return SoakRequest(index, endpoint, stream, n, logprobs, include_usage, body, cancel_after)


def make_requests(count: int, seed: int, *, model: str, vocab_size: int, max_tokens: int,
                  cancel_fraction: float) -> list[SoakRequest]:
    rng = random.Random(seed)
    return [make_request(i, rng, model=model, vocab_size=vocab_size, max_tokens=max_tokens,
                         cancel_fraction=cancel_fraction) for i in range(count)]
