"""Request traces for the simulator: JSONL files (one request per line) and a seeded
generator of them from phases of traffic.

A line: {"arrival": 1.25, "prompt_len": 812, "output_len": 128} with optional
"prompt_token_ids" (instead of prompt_len), "prefix_id" and "prefix_len" (the first
prefix_len prompt tokens are the same for every request with that prefix id: a system
prompt, a RAG preamble), "ignore_eos" (default true: output_len is exact) and
"service_tier" (OpenAI's: default, flex or priority; "flex" for batch traffic).

Block-level prefix identity, as Mooncake's traces carry it: "hash_ids" (one integer per
block of "block_size" prompt tokens, default 512) says which blocks two prompts share.
Two requests whose hash_ids agree on their first k entries have the same first k blocks
of tokens, so a replay hits the prefix cache exactly where the trace says."""

from __future__ import annotations

import hashlib
import json
import math
import random
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from ..metrics.buckets import SERVICE_TIERS
from ..config.simulation import OutputLengths

MAX_TRACE_TOKENS = 1 << 20  # no single prompt or output in a trace exceeds this
DEFAULT_HASH_BLOCK = 512  # Mooncake's traces: one hash id per 512 prompt tokens


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds from the start of the trace
    prompt_len: int
    output_len: int
    prefix_id: str | None = None
    prefix_len: int = 0
    prompt_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = True
    service_tier: str = "default"
    hash_ids: tuple[int, ...] | None = None  # one per block_size prompt tokens (the last may be partial)
    block_size: int = DEFAULT_HASH_BLOCK

    def token_ids(self, index: int, vocab: tuple[int, int]) -> list[int]:
        """The prompt's token ids: given ones, else deterministic ones, the shared prefix
        first (the same for every request with this prefix id)."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        low, span = vocab[0], vocab[1] - vocab[0]
        if self.hash_ids is not None:
            return _block_ids(self.hash_ids, self.block_size, self.prompt_len, index, low, span)
        shared = min(self.prefix_len, self.prompt_len) if self.prefix_id else 0
        ids = _random_ids(f"prefix:{self.prefix_id}", shared, low, span) if shared else []
        return ids + _random_ids(f"request:{index}", self.prompt_len - shared, low, span)

    def to_json(self) -> dict:
        out: dict = {"arrival": self.arrival}
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = list(self.prompt_token_ids)
        else:
            out["prompt_len"] = self.prompt_len
        out["output_len"] = self.output_len
        if self.prefix_id is not None:
            out["prefix_id"], out["prefix_len"] = self.prefix_id, self.prefix_len
        if not self.ignore_eos:
            out["ignore_eos"] = False
        if self.service_tier != "default":
            out["service_tier"] = self.service_tier
        if self.hash_ids is not None:
            out["hash_ids"] = list(self.hash_ids)
            if self.block_size != DEFAULT_HASH_BLOCK:
                out["block_size"] = self.block_size
        return out


def _block_ids(hash_ids: tuple[int, ...], block: int, n: int, index: int, low: int, span: int) -> list[int]:
    """n prompt token ids: block k is a pure function of hash_ids[k] (its first tokens when
    the prompt ends inside it); tokens past the last hashed block are the request's own."""
    ids: list[int] = []
    for h in hash_ids:
        if len(ids) >= n:
            break
        ids += _random_ids(f"block:{h}:{block}", min(block, n - len(ids)), low, span)
    return ids + _random_ids(f"request:{index}", n - len(ids), low, span)


def _random_ids(key: str, n: int, low: int, span: int) -> list[int]:
    """n token ids in [low, low + span), a pure function of key (SHAKE-128 as the stream)."""
    words = array("I", hashlib.shake_128(key.encode()).digest(4 * n))
    return [low + w % span for w in words]


def _int_field(obj: dict, key: str, where: str, minimum: int) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_TRACE_TOKENS:
        raise ValueError(f"{where}: {key} must be an integer in [{minimum}, {MAX_TRACE_TOKENS}], got {value!r}")
    return value


def parse_trace_line(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a trace line must be a JSON object")
    known = {"arrival", "prompt_len", "prompt_token_ids", "output_len", "prefix_id", "prefix_len", "ignore_eos",
             "service_tier", "hash_ids", "block_size"}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    for key in ("arrival", "output_len"):
        if key not in obj:
            raise ValueError(f"{where}: missing {key}")
    arrival = obj["arrival"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) or arrival < 0:
        raise ValueError(f"{where}: arrival must be a non-negative number of seconds, got {arrival!r}")
    ids = obj.get("prompt_token_ids")
    if ids is not None:
        if "prompt_len" in obj:
            raise ValueError(f"{where}: give prompt_len or prompt_token_ids, not both")
        if not isinstance(ids, list) or not ids or len(ids) > MAX_TRACE_TOKENS or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of non-negative integers")
        prompt_len = len(ids)
    elif "prompt_len" in obj:
        prompt_len = _int_field(obj, "prompt_len", where, 1)
    else:
        raise ValueError(f"{where}: missing prompt_len (or prompt_token_ids)")
    prefix_id = obj.get("prefix_id")
    if prefix_id is not None and (not isinstance(prefix_id, str) or not prefix_id):
        raise ValueError(f"{where}: prefix_id must be a non-empty string")
    prefix_len = _int_field(obj, "prefix_len", where, 0) if "prefix_len" in obj else 0
    if prefix_len and prefix_id is None:
        raise ValueError(f"{where}: prefix_len needs a prefix_id")
    if prefix_len > prompt_len:
        raise ValueError(f"{where}: prefix_len ({prefix_len}) exceeds the prompt's {prompt_len} tokens")
    ignore_eos = obj.get("ignore_eos", True)
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"{where}: ignore_eos must be true or false")
    tier = obj.get("service_tier", "default")
    if tier not in SERVICE_TIERS:
        raise ValueError(f"{where}: service_tier must be one of {list(SERVICE_TIERS)}, got {tier!r}")
    hash_ids, block = _hash_ids(obj, where, prompt_len, prefix_id)
    return TraceRequest(float(arrival), prompt_len, _int_field(obj, "output_len", where, 1),
                        prefix_id, prefix_len, tuple(ids) if ids is not None else None, ignore_eos, tier,
                        hash_ids, block)


def _hash_ids(obj: dict, where: str, prompt_len: int, prefix_id) -> tuple[tuple[int, ...] | None, int]:
    block = _int_field(obj, "block_size", where, 1) if "block_size" in obj else DEFAULT_HASH_BLOCK
    raw = obj.get("hash_ids")
    if raw is None:
        if "block_size" in obj:
            raise ValueError(f"{where}: block_size needs hash_ids")
        return None, block
    if prefix_id is not None or "prompt_token_ids" in obj:
        raise ValueError(f"{where}: hash_ids cannot be given with prefix_id or prompt_token_ids")
    if not isinstance(raw, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in raw):
        raise ValueError(f"{where}: hash_ids must be a list of non-negative integers")
    if len(raw) > -(-prompt_len // block):
        raise ValueError(f"{where}: hash_ids has {len(raw)} blocks of {block} tokens, more than the prompt's "
                         f"{prompt_len} tokens fill")
    return tuple(raw), block


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of a JSONL trace, sorted by arrival; ValueError names the line."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"trace: cannot read {p}: {exc.strerror}") from None
    out = [parse_trace_line(line, f"trace {p.name} line {n}")
           for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not out:
        raise ValueError(f"trace: {p} holds no requests")
    return sorted(out, key=lambda r: r.arrival)


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> int:
    n = 0
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r.to_json()) + "\n")
            n += 1
    return n


# --- generating traces ------------------------------------------------------------------

@dataclass(frozen=True)
class Phase:
    """A stretch of traffic: arrivals at `rate` per second (Poisson at burstiness 1;
    gamma-distributed gaps otherwise, burstier below 1, as vLLM's bench does), lengths
    from distributions, and optionally a shared prefix on a fraction of the requests."""

    duration: float
    rate: float
    input: str = "uniform:128:1024"
    output: str = "uniform:64:512"
    burstiness: float = 1.0
    prefix_len: int = 0
    prefix_groups: int = 1
    prefix_fraction: float = 1.0
    name: str = ""
    service_tier: str = "default"  # every request of the phase is sent with it
    input_lengths: OutputLengths = field(init=False, repr=False, compare=False)
    output_lengths: OutputLengths = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = f"phase {self.name or '?'}"
        for key in ("duration", "rate", "burstiness"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (
                    key != "rate" and v == 0):
                raise ValueError(f"{where}: {key} must be a positive number, got {v!r}")
        if not isinstance(self.prefix_len, int) or not 0 <= self.prefix_len <= MAX_TRACE_TOKENS:
            raise ValueError(f"{where}: prefix_len must be an integer >= 0, got {self.prefix_len!r}")
        if not isinstance(self.prefix_groups, int) or self.prefix_groups < 1:
            raise ValueError(f"{where}: prefix_groups must be an integer >= 1, got {self.prefix_groups!r}")
        if not 0 <= self.prefix_fraction <= 1:
            raise ValueError(f"{where}: prefix_fraction must be in [0, 1], got {self.prefix_fraction!r}")
        if self.service_tier not in SERVICE_TIERS:
            raise ValueError(f"{where}: service_tier must be one of {list(SERVICE_TIERS)}, got {self.service_tier!r}")
        object.__setattr__(self, "input_lengths", OutputLengths.parse(self.input, f"{where}: input"))
        object.__setattr__(self, "output_lengths", OutputLengths.parse(self.output, f"{where}: output"))

    @classmethod
    def parse(cls, text: str) -> Phase:
        """`duration=600 rate=4 input=lognormal:1000:0.6 output=uniform:50:300 ...`"""
        kwargs: dict = {}
        types = {"duration": float, "rate": float, "burstiness": float, "prefix_len": int,
                 "prefix_groups": int, "prefix_fraction": float, "input": str, "output": str, "name": str,
                 "service_tier": str}
        for item in text.split():
            key, sep, value = item.partition("=")
            if not sep or key not in types:
                raise ValueError(f"phase: {item!r} is not KEY=VALUE with KEY one of {sorted(types)}")
            try:
                kwargs[key] = types[key](value)
            except ValueError:
                raise ValueError(f"phase: {key}={value!r} is not a {types[key].__name__}") from None
        for key in ("duration", "rate"):
            if key not in kwargs:
                raise ValueError(f"phase: {text!r} needs {key}=")
        return cls(**kwargs)


def generate(phases: list[Phase], seed: int = 0, max_len: int | None = None) -> Iterator[TraceRequest]:
    """Requests phase after phase; lengths are clipped so prompt + output fit max_len."""
    rng = random.Random(seed)
    start = 0.0
    for k, ph in enumerate(phases):
        t = start
        end = start + ph.duration
        while ph.rate > 0:
            shape = ph.burstiness
            t += rng.gammavariate(shape, 1.0 / (ph.rate * shape))
            if t >= end:
                break
            prompt = ph.input_lengths.sample(rng.random())
            output = ph.output_lengths.sample(rng.random())
            prefix_id, prefix_len = None, 0
            if ph.prefix_len and rng.random() < ph.prefix_fraction:
                prefix_id = f"p{k}-{rng.randrange(ph.prefix_groups)}"
                prefix_len = ph.prefix_len
                prompt = max(prompt, prefix_len + 1)
            if max_len is not None:
                prompt = min(prompt, max_len - 1)
                output = max(1, min(output, max_len - prompt))
                prefix_len = min(prefix_len, prompt)
            yield TraceRequest(round(t, 6), prompt, output, prefix_id, prefix_len, service_tier=ph.service_tier)
        start = end
