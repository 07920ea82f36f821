"""`kvpilot bench serve`: the random workload, the statistics, and a run against a live
`kvpilot serve` (in-process API and the command line)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpilot.engine.bench.serve import BenchConfig, make_requests, run_benchmark
from kvpilot.engine.bench.serve_stats import RequestResult, parse_goodput, summarize
from server_harness import SHARED_API_KEY, shared_server

KEY = SHARED_API_KEY


def test_random_workload_lengths_and_shared_prefix():
    cfg = BenchConfig(base_url="http://x", model="m", random_input_len=100, random_output_len=20,
                      random_range_ratio=0.5, random_prefix_len=32, num_prompts=50, seed=3)
    reqs = make_requests(cfg, vocab_size=4096)
    assert all(82 <= len(r.prompt) <= 182 and 10 <= r.output_len <= 30 for r in reqs)
    assert len({tuple(r.prompt[:32]) for r in reqs}) == 1
    assert len({tuple(r.prompt[32:]) for r in reqs}) == 50
    assert all(16 <= t < 4096 for r in reqs for t in r.prompt)
    assert [r.prompt for r in make_requests(cfg, 4096)] == [r.prompt for r in reqs]
    fixed = make_requests(BenchConfig(base_url="x", model="m", random_input_len=7,
                                      random_output_len=3, num_prompts=4), 4096)
    assert {(len(r.prompt), r.output_len) for r in fixed} == {(7, 3)}
    with pytest.raises(ValueError, match="request_rate"):
        BenchConfig(base_url="x", model="m", request_rate=0)


def test_summary_statistics_and_goodput():
    results = [RequestResult(prompt_len=10, success=True, output_tokens=11, ttft=0.1 * (i + 1),
                             latency=1.1 * (i + 1), itl=[0.1] * 10) for i in range(4)]
    results.append(RequestResult(prompt_len=10, error="HTTP 500: boom"))
    s = summarize(results, duration=2.0, goodput=parse_goodput(["ttft:250", "tpot:150"]))
    assert s["completed"] == 4 and s["failed"] == 1 and s["errors"] == ["HTTP 500: boom"]
    assert s["total_input_tokens"] == 40 and s["total_output_tokens"] == 44
    assert s["request_throughput"] == 2.0 and s["output_throughput"] == 22.0
    assert s["mean_ttft_ms"] == pytest.approx(250.0) and s["median_ttft_ms"] == pytest.approx(250.0)
    assert s["p99_ttft_ms"] == pytest.approx(397.0)
    assert s["mean_tpot_ms"] == pytest.approx(250.0)  # (latency - ttft) / 10
    assert s["mean_itl_ms"] == pytest.approx(100.0)
    assert s["request_goodput"] == pytest.approx(0.5)  # only the first meets both SLOs
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(["latency:5"])


@pytest.fixture(scope="module")
def server():
    return shared_server()


def test_run_benchmark_against_a_live_server(server):
    cfg = BenchConfig(base_url=server.url, model="tiny", api_key=KEY, random_input_len=64,
                      random_output_len=8, random_prefix_len=16, num_prompts=8,
                      max_concurrency=4, disable_tqdm=True, goodput={"e2el": 60_000})
    r = run_benchmark(cfg)
    assert r["completed"] == 8 and r["failed"] == 0, r["errors"]
    assert r["total_input_tokens"] == 8 * 80 and r["total_output_tokens"] == 64
    assert 0 < r["mean_ttft_ms"] <= r["mean_e2el_ms"] and r["mean_tpot_ms"] > 0
    assert r["mean_itl_ms"] > 0 and r["request_goodput"] > 0
    poisson = run_benchmark(BenchConfig(base_url=server.url, model="tiny", api_key=KEY,
                                        random_input_len=16, random_output_len=4, num_prompts=4,
                                        request_rate=20.0, disable_tqdm=True))
    assert poisson["completed"] == 4 and poisson["request_rate"] == 20.0
    with pytest.raises(RuntimeError, match="does not serve"):
        run_benchmark(BenchConfig(base_url=server.url, model="nope", api_key=KEY, num_prompts=1,
                                  disable_tqdm=True))


def test_command_line_prints_the_block_and_saves_json(server, tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot.engine.cli", "bench", "serve", "--base-url", server.url,
         "--model", "tiny", "--api-key", KEY, "--random-input-len", "32",
         "--random-output-len", "4", "--num-prompts", "4", "--max-concurrency", "2",
         "--save-result", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for label in ("Serving Benchmark Result", "Successful requests:", "Request throughput (req/s):",
                  "Output token throughput (tok/s):", "Mean TTFT (ms):", "P99 TPOT (ms):",
                  "Median ITL (ms):", "Mean E2EL (ms):"):
        assert label in proc.stdout
    saved = json.loads(out.read_text())
    assert saved["completed"] == 4 and saved["total_output_tokens"] == 16
