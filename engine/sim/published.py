"""Uncalibrated predictions of the GPU presets beside published measurements of vLLM.
Each point replays the published workload through the virtual-clock simulator with the
preset's datasheet figures and default fractions; nothing here was fitted to them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import EngineConfig
from .fleet import Fleet
from .report import summarize
from .trace import TraceRequest


@dataclass(frozen=True)
class PublishedPoint:
    what: str
    accelerator: str
    overrides: dict  # SimulationConfig overrides (e.g. an A100 40GB's memory and bandwidth)
    published: float
    unit: str
    source: str
    measure: Callable[[dict, Fleet], float]  # the simulator's figure for the same quantity
    workload: tuple[int, int, int, int | None]  # (requests, prompt, output tokens, concurrency)


def _decode_rate(result: dict, fleet: Fleet) -> float:
    return 1000.0 / result["median_tpot_ms"]


def _tpot_ms(result: dict, fleet: Fleet) -> float:
    return result["median_tpot_ms"]


def _batch_latency_ms(result: dict, fleet: Fleet) -> float:
    return 1000.0 * max(r.finished for r in fleet.requests)


POINTS = [
    PublishedPoint(
        "decode tokens/s, 1 stream, 1024 in / 128 out (vLLM 0.23, A100 40GB)", "a100-80gb",
        {"memory": "40Gi", "bandwidth_gbps": 1555.0}, 75.0, "tok/s",
        "johnmusgrave.com/p/vllm-throughput-latency-sweep-on (\"about 75 tokens/sec\")", _decode_rate,
        (20, 1024, 128, 1)),
    PublishedPoint(
        "TPOT p50, 1 stream, chatbot-short (vLLM 0.21, H100 80GB)", "h100-80gb", {}, 6.48, "ms",
        "yobitelcomm.github.io/bench/recipes/concurrency-sweep/ (conc 1: TPOT p50 6.48 ms)", _tpot_ms,
        (20, 300, 200, 1)),  # chatbot-short: its lengths are not published
    PublishedPoint(
        "batch of 8, 32 in / 128 out, end to end (vLLM CI latency_llama8B_tp1, H100)", "h100-80gb", {},
        997.5, "ms", "buildkite.com/vllm/performance-benchmark/builds/9555", _batch_latency_ms, (8, 32, 128, None)),
    PublishedPoint(
        "batch of 8, 32 in / 128 out, end to end (vLLM CI latency_llama8B_tp1, A100-SXM4-80GB)",
        "a100-80gb", {}, 1579.3, "ms", "buildkite.com/vllm/performance-benchmark/builds/9523",
        _batch_latency_ms, (8, 32, 128, None)),
    PublishedPoint(
        "batch of 8, 32 in / 128 out, end to end (vLLM CI latency_llama8B_tp1, H200)", "h200", {},
        834.1, "ms", "buildkite.com/vllm/performance-benchmark/builds/9513", _batch_latency_ms, (8, 32, 128, None)),
]


def predict(point: PublishedPoint) -> float:
    n, prompt, output, concurrency = point.workload
    trace = [TraceRequest(0.0, prompt, output) for _ in range(n)]
    config = EngineConfig(model=None, simulate={"accelerator": point.accelerator, "model": "llama-3.1-8b",
                                                **point.overrides},
                          max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192)
    fleet = Fleet(config, max_concurrency=concurrency)
    fleet.run(trace)
    return point.measure(summarize(fleet), fleet)


def compare() -> list[dict]:
    rows = []
    for p in POINTS:
        got = predict(p)
        rows.append({"what": p.what, "accelerator": p.accelerator, "published": p.published, "simulated": got,
                     "unit": p.unit, "error": got / p.published - 1, "source": p.source})
    return rows
