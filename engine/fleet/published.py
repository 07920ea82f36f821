"""Uncalibrated predictions of the GPU presets beside published measurements of vLLM.
Each point replays the published workload through the virtual-clock simulator with the
preset's datasheet figures and default fractions (and, over several GPUs, the preset's
interconnect); nothing here was fitted to them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config.engine import EngineConfig
from .fleet import Fleet
from .report import summarize
from .trace import TraceRequest


@dataclass(frozen=True)
class PublishedPoint:
    what: str
    accelerator: str
    overrides: dict  # SimulationConfig overrides (e.g. an A100 40GB's memory and bandwidth)
    published: float | None  # None: a prediction with no published figure of its conditions found
    unit: str
    source: str
    measure: Callable[[dict, Fleet], float]  # the simulator's figure for the same quantity
    workload: tuple[int, int, int, int | None]  # (requests, prompt, output tokens, concurrency)
    model: str = "llama-3.1-8b"  # a shapes.py preset
    tensor_parallel_size: int = 1


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
    # vLLM CI's latency_llama70B_tp4 runs meta-llama/Meta-Llama-3-70B-Instruct (bf16, dummy
    # weights), whose shape is Llama-3.1-70B's but for the positions (rope scaling, 8K):
    # the same step costs (.buildkite/nightly-benchmarks/tests/latency-tests.json).
    PublishedPoint(
        "batch of 8, 32 in / 128 out, end to end (vLLM CI latency_llama70B_tp4, 4 of 8xH100)", "h100-80gb", {},
        2444.47, "ms", "buildkite.com/vllm/performance-benchmark/builds/9555", _batch_latency_ms,
        (8, 32, 128, None), "llama-3.1-70b", 4),
    PublishedPoint(
        "batch of 8, 32 in / 128 out, end to end (vLLM CI latency_llama70B_tp4, A100-SXM4-80GB)", "a100-80gb",
        {}, 3990.59, "ms", "buildkite.com/vllm/performance-benchmark/builds/9523", _batch_latency_ms,
        (8, 32, 128, None), "llama-3.1-70b", 4),
    PublishedPoint(
        "batch of 8, 32 in / 128 out, end to end (vLLM CI latency_llama70B_tp4, H200)", "h200", {},
        2075.08, "ms", "buildkite.com/vllm/performance-benchmark/builds/9513", _batch_latency_ms,
        (8, 32, 128, None), "llama-3.1-70b", 4),
    # The same workload over all eight GPUs: vLLM's CI runs no TP 8 latency test.
    PublishedPoint(
        "batch of 8, 32 in / 128 out, end to end (as latency_llama70B_tp4, but tensor parallel 8, 8xH100)",
        "h100-80gb", {}, None, "ms", "no published figure of these conditions found", _batch_latency_ms,
        (8, 32, 128, None), "llama-3.1-70b", 8),
]


def predict(point: PublishedPoint) -> float:
    n, prompt, output, concurrency = point.workload
    trace = [TraceRequest(0.0, prompt, output) for _ in range(n)]
    config = EngineConfig(model=None, simulate={"accelerator": point.accelerator, "model": point.model,
                                                **point.overrides},
                          max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192,
                          tensor_parallel_size=point.tensor_parallel_size)
    fleet = Fleet(config, max_concurrency=concurrency)
    fleet.run(trace)
    return point.measure(summarize(fleet), fleet)


def compare() -> list[dict]:
    rows = []
    for p in POINTS:
        got = predict(p)
        rows.append({"what": p.what, "accelerator": p.accelerator, "model": p.model,
                     "tensor_parallel_size": p.tensor_parallel_size, "published": p.published, "simulated": got,
                     "unit": p.unit, "error": got / p.published - 1 if p.published else None, "source": p.source})
    return rows
