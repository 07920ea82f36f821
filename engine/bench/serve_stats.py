"""Per-request results of `bench serve` and their vLLM-style summary."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_tokens: int | None = None
    ttft: float | None = None  # seconds
    latency: float | None = None  # seconds, end to end
    itl: list[float] = field(default_factory=list)  # seconds between streamed chunks
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.success or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"goodput takes KEY:MS with KEY in {GOODPUT_KEYS}, got {item!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"goodput {key} needs milliseconds, got {value!r}") from None
        if slos[key] <= 0:
            raise ValueError(f"goodput {key} must be positive, got {value}")
    return slos


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0  # linear interpolation, as numpy.percentile
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def latency_stats(prefix: str, seconds: list[float], out: dict) -> None:
    """mean/median/std/p95/p99 of `seconds`, in ms, under vLLM's key names."""
    ms = [s * 1000.0 for s in seconds]
    out[f"mean_{prefix}_ms"] = statistics.fmean(ms) if ms else 0.0
    out[f"median_{prefix}_ms"] = statistics.median(ms) if ms else 0.0
    out[f"std_{prefix}_ms"] = statistics.pstdev(ms) if ms else 0.0
    out[f"p95_{prefix}_ms"] = _pct(ms, 95)
    out[f"p99_{prefix}_ms"] = _pct(ms, 99)


def throughput_stats(duration: float, completed: int, failed: int, input_tokens: int,
                     output_tokens: int, errors: set[str]) -> dict:
    """The counts and rates of a run, under vLLM's key names."""
    def rate(n: float) -> float:
        return n / duration if duration > 0 else 0.0

    return {
        "duration": duration, "completed": completed, "failed": failed,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": rate(completed), "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
        "errors": sorted(errors)[:10],
    }


def summarize(results: list[RequestResult], duration: float, goodput: dict[str, float]) -> dict:
    ok = [r for r in results if r.success]
    out = throughput_stats(duration, len(ok), len(results) - len(ok), sum(r.prompt_len for r in ok),
                           sum(r.output_tokens or 0 for r in ok), {r.error for r in results if r.error})
    latency_stats("ttft", [r.ttft for r in ok], out)
    latency_stats("tpot", [t for t in (r.tpot for r in ok) if t is not None], out)
    latency_stats("itl", [x for r in ok for x in r.itl], out)
    latency_stats("e2el", [r.latency for r in ok], out)
    if goodput:
        good = 0
        for r in ok:
            measured = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
            if all(measured[k] * 1000.0 <= ms for k, ms in goodput.items()):
                good += 1
        out["request_goodput"] = good / duration if duration > 0 else 0.0
        out["goodput_slos_ms"] = dict(goodput)
    return out


def print_result(r: dict) -> None:
    def line(label: str, value, fmt: str = "") -> None:
        print(f"{label:<40} {format(value, fmt) if fmt else value:<10}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    line("Successful requests:", r["completed"])
    line("Failed requests:", r["failed"])
    if r.get("max_concurrency"):
        line("Maximum request concurrency:", r["max_concurrency"])
    if r.get("request_rate") not in (None, "inf"):
        line("Request rate (req/s):", r["request_rate"], ".2f")
    line("Benchmark duration (s):", r["duration"], ".2f")
    line("Total input tokens:", r["total_input_tokens"])
    line("Total generated tokens:", r["total_output_tokens"])
    line("Request throughput (req/s):", r["request_throughput"], ".2f")
    if "request_goodput" in r:
        line("Request goodput (req/s):", r["request_goodput"], ".2f")
    line("Output token throughput (tok/s):", r["output_throughput"], ".2f")
    line("Total Token throughput (tok/s):", r["total_token_throughput"], ".2f")
    for key, title, name in (
        ("ttft", "Time to First Token", "TTFT"),
        ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl", "Inter-token Latency", "ITL"),
        ("e2el", "End-to-end Latency", "E2EL"),
    ):
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        line(f"Mean {name} (ms):", r[f"mean_{key}_ms"], ".2f")
        line(f"Median {name} (ms):", r[f"median_{key}_ms"], ".2f")
        line(f"P99 {name} (ms):", r[f"p99_{key}_ms"], ".2f")
    print("=" * 50)
    for err in r.get("errors") or ():
        print(f"error: {err}")
