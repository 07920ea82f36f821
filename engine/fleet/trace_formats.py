"""Public LLM traces as simulator traces: one reader per format, and the options a user
applies on the way in (a window, a rate scale, clipping to the model's context), each
reported so a printed result says what was replayed.

Formats (the schemas as their owners publish them):
  kvpilot    kvpilot's JSONL (trace.py)
  azure2023  Azure LLM inference trace 2023 CSV: TIMESTAMP,ContextTokens,GeneratedTokens,
             TIMESTAMP like 2023-11-16 18:15:46.6805900 (Azure/AzurePublicDataset)
  azure2024  the 2024 week-long CSVs: the same columns, TIMESTAMP like
             2024-05-10 00:00:00.009930+00:00 (fraction optional)
  burstgpt   BurstGPT CSV: Timestamp (seconds),Model,Request tokens,Response tokens,
             Total tokens,Log Type; a row with 0 response tokens is a failed request
             and is skipped (HPMLL/BurstGPT)
  mooncake   Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids
             (one per 512-token block; kvcache-ai/Mooncake)
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from .trace import DEFAULT_HASH_BLOCK, MAX_TRACE_TOKENS, TraceRequest, parse_trace_line

FORMATS = ("kvpilot", "azure2023", "azure2024", "burstgpt", "mooncake")


@dataclass(frozen=True)
class TraceOptions:
    """What to replay of a trace file. `start_s`/`duration_s`: a window on the trace's own
    clock (arrivals before start_s are dropped, the rest shifted to 0); `rate_scale`:
    arrivals come this many times as fast (inter-arrival gaps divided by it); `max_context`:
    prompt + output clipped to fit (None: as given)."""

    fmt: str = "kvpilot"
    start_s: float = 0.0
    duration_s: float | None = None
    rate_scale: float = 1.0
    max_context: int | None = None
    block_size: int = DEFAULT_HASH_BLOCK  # mooncake's hash block

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"trace_format must be one of {list(FORMATS)}, got {self.fmt!r}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"trace_start must be a number of seconds >= 0, got {self.start_s!r}")
        if self.duration_s is not None and not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"trace_duration must be a positive number of seconds, got {self.duration_s!r}")
        if not (math.isfinite(self.rate_scale) and 0 < self.rate_scale <= 1000):
            raise ValueError(f"trace_rate_scale must be in (0, 1000], got {self.rate_scale!r}")
        if self.max_context is not None and not (isinstance(self.max_context, int) and self.max_context >= 2):
            raise ValueError(f"max_context must be an integer >= 2, got {self.max_context!r}")
        if not (isinstance(self.block_size, int) and self.block_size >= 1):
            raise ValueError(f"trace_block_size must be a positive integer, got {self.block_size!r}")


@dataclass
class LoadedTrace:
    """The requests to replay and what was done to get them (`notes`, one line each)."""

    requests: list[TraceRequest]
    source: str
    notes: list[str] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return self.requests[-1].arrival if self.requests else 0.0

    def summary(self) -> dict:
        n, d = len(self.requests), self.duration
        return {"source": self.source, "requests": n, "duration_s": d,
                "mean_rate_per_s": n / d if d > 0 else 0.0, "notes": list(self.notes)}


def parse_timestamp(text: str, where: str) -> float:
    """Seconds since the epoch of `YYYY-MM-DD HH:MM:SS[.fraction][+HH:MM]` (UTC when no
    offset): Azure's 2023 stamps carry 7 fraction digits, which datetime does not take."""
    text = text.strip()
    main, frac = text, 0.0
    tz = ""
    for sign in ("+", "-"):
        k = text.rfind(sign)
        if k > 10:  # past the date's own dashes
            main, tz = text[:k], text[k:]
            break
    if "." in main:
        main, digits = main.split(".", 1)
        if not digits.isdigit():
            raise ValueError(f"{where}: TIMESTAMP {text!r} is not YYYY-MM-DD HH:MM:SS[.fff]")
        frac = int(digits) / 10 ** len(digits)
    try:
        dt = datetime.fromisoformat(main + (tz or "+00:00"))
    except ValueError:
        raise ValueError(f"{where}: TIMESTAMP {text!r} is not YYYY-MM-DD HH:MM:SS[.fff]") from None
    return dt.astimezone(timezone.utc).timestamp() + frac


def _count(value: str, column: str, where: str) -> int:
    try:
        n = int(float(value))
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {column} must be a number of tokens, got {value!r}") from None
    if n < 0 or n > MAX_TRACE_TOKENS:
        raise ValueError(f"{where}: {column} must be in [0, {MAX_TRACE_TOKENS}], got {n}")
    return n


def _csv_rows(path: Path, columns: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in reader.fieldnames or []]
        missing = [c for c in columns if c not in header]
        if missing:
            raise ValueError(f"trace {path.name}: missing column(s) {missing}; the header is {header}")
        reader.fieldnames = header
        for n, row in enumerate(reader, 2):
            yield f"trace {path.name} line {n}", row


# Each reader yields (arrival seconds on the trace's clock, prompt, output, hash_ids or None).
Raw = tuple[float, int, int, "tuple[int, ...] | None"]


def _azure(path: Path, notes: list[str]) -> Iterator[Raw]:
    zero = 0
    for where, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        prompt = _count(row["ContextTokens"], "ContextTokens", where)
        output = _count(row["GeneratedTokens"], "GeneratedTokens", where)
        if prompt == 0 or output == 0:
            zero += 1
        yield parse_timestamp(row["TIMESTAMP"], where), max(prompt, 1), max(output, 1), None
    if zero:
        notes.append(f"{zero} rows with 0 context or generated tokens replayed with 1")


def _burstgpt(path: Path, notes: list[str]) -> Iterator[Raw]:
    failed = 0
    for where, row in _csv_rows(path, ("Timestamp", "Request tokens", "Response tokens")):
        prompt = _count(row["Request tokens"], "Request tokens", where)
        output = _count(row["Response tokens"], "Response tokens", where)
        if output == 0 or prompt == 0:
            failed += 1  # BurstGPT marks a failed request with 0 response tokens
            continue
        try:
            t = float(row["Timestamp"])
        except ValueError:
            raise ValueError(f"{where}: Timestamp must be seconds, got {row['Timestamp']!r}") from None
        yield t, prompt, output, None
    if failed:
        notes.append(f"{failed} failed requests (0 response tokens) skipped")


def _mooncake(path: Path, notes: list[str]) -> Iterator[Raw]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"trace {path.name} line {n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: a line must be a JSON object")
            for key in ("timestamp", "input_length", "output_length"):
                if key not in obj:
                    raise ValueError(f"{where}: missing {key}")
            ts = obj["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
                raise ValueError(f"{where}: timestamp must be milliseconds >= 0, got {ts!r}")
            hashes = obj.get("hash_ids", [])
            if not isinstance(hashes, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0
                                                   for h in hashes):
                raise ValueError(f"{where}: hash_ids must be a list of non-negative integers")
            prompt = _count(obj["input_length"], "input_length", where)
            output = _count(obj["output_length"], "output_length", where)
            yield ts / 1000.0, max(prompt, 1), max(output, 1), tuple(hashes)


def _kvpilot(path: Path, notes: list[str]) -> Iterator[TraceRequest]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield parse_trace_line(line, f"trace {path.name} line {n}")


def _clip(r: TraceRequest, ctx: int) -> TraceRequest | None:
    """r fitted into ctx tokens (prompt first, then output), or None when it already fits."""
    if r.prompt_len + r.output_len <= ctx:
        return None
    prompt = min(r.prompt_len, ctx - 1)
    hashes = r.hash_ids[:-(-prompt // r.block_size)] if r.hash_ids is not None else None
    ids = r.prompt_token_ids[:prompt] if r.prompt_token_ids is not None else None
    return TraceRequest(r.arrival, prompt, max(1, min(r.output_len, ctx - prompt)), r.prefix_id,
                        min(r.prefix_len, prompt), ids, r.ignore_eos, r.service_tier, hashes, r.block_size)


def load_trace(path: str | Path, opts: TraceOptions = TraceOptions()) -> LoadedTrace:
    """The trace's requests after the window, rate scale and clipping, sorted by arrival;
    ValueError names the file and line of a bad row."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"trace: cannot read {p}: no such file")
    notes: list[str] = []
    if opts.fmt == "kvpilot":
        stream: Iterator = ((r.arrival, r) for r in _kvpilot(p, notes))
    else:
        reader = {"azure2023": _azure, "azure2024": _azure, "burstgpt": _burstgpt, "mooncake": _mooncake}[opts.fmt]
        stream = ((t, (t, prompt, output, hashes)) for t, prompt, output, hashes in reader(p, notes))
    # The window is on the clock of the file's first row (the published traces are in
    # arrival order), so a week-long file streams through without being held whole.
    rows: list = []
    first = end = None
    seen = 0
    for t, item in stream:
        seen += 1
        if first is None:
            first = t + opts.start_s
            end = None if opts.duration_s is None else first + opts.duration_s
        if t >= first and (end is None or t < end):
            rows.append((t, item))
    if seen == 0:
        raise ValueError(f"trace: {p} holds no requests")
    rows.sort(key=lambda x: x[0])
    t0 = first
    out: list[TraceRequest] = []
    for t, item in rows:
        arrival = round((t - t0) / opts.rate_scale, 6)
        if isinstance(item, TraceRequest):
            r = TraceRequest(arrival, *_fields(item))
        else:
            _, prompt, output, hashes = item
            if hashes is not None and len(hashes) > -(-prompt // opts.block_size):
                hashes = hashes[:-(-prompt // opts.block_size)]
            r = TraceRequest(arrival, prompt, output, hash_ids=hashes, block_size=opts.block_size)
        out.append(r)
    if not out:
        raise ValueError(f"trace: the window [{opts.start_s:g}s, +{opts.duration_s}s) of {p.name} holds no requests")
    if opts.start_s or opts.duration_s is not None:
        notes.append(f"window: {opts.start_s:g}s to "
                     f"{'the end' if opts.duration_s is None else f'{opts.start_s + opts.duration_s:g}s'} "
                     f"of the trace ({len(out)} of {seen} requests)")
    if opts.rate_scale != 1.0:
        notes.append(f"rate scaled x{opts.rate_scale:g} (inter-arrival gaps / {opts.rate_scale:g})")
    if opts.max_context is not None:
        clipped = 0
        for k, r in enumerate(out):
            c = _clip(r, opts.max_context)
            if c is not None:
                out[k], clipped = c, clipped + 1
        notes.append(f"clipped to the model's context of {opts.max_context} tokens: {clipped} requests")
    return LoadedTrace(out, f"{p.name} ({opts.fmt})", notes)


def _fields(r: TraceRequest) -> tuple:
    return (r.prompt_len, r.output_len, r.prefix_id, r.prefix_len, r.prompt_token_ids, r.ignore_eos,
            r.service_tier, r.hash_ids, r.block_size)
