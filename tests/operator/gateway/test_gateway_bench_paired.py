"""The paired overhead statistic: per-pair differences, failures counted, not dropped."""
from __future__ import annotations

import pytest

from kvpilot.engine.bench.serve_stats import RequestResult
from kvpilot.operator.gateway.bench_paired import added_latency


def _ok(ttft: float, latency: float) -> RequestResult:
    return RequestResult(prompt_len=4, success=True, output_tokens=8, ttft=ttft, latency=latency)


def test_differences_are_taken_within_each_pair_not_between_groups():
    # Run-to-run drift (pairs later in the run are 1 s slower) cancels inside each pair.
    pairs = [(_ok(0.1 + i, 1.0 + i), _ok(0.102 + i, 1.003 + i)) for i in range(10)]
    out = added_latency(pairs)
    assert out["pairs"] == 10 and out["failed_direct"] == out["failed_gateway"] == 0
    assert out["ttft"]["median_ms"] == pytest.approx(2.0)
    assert out["e2e"]["mean_ms"] == pytest.approx(3.0)
    assert out["e2e"]["ci95_ms"] == pytest.approx(0.0, abs=1e-6)


def test_failed_halves_are_counted_and_leave_their_pair_out():
    failed = RequestResult(prompt_len=4, error="HTTP 503")
    pairs = [(_ok(0.1, 1.0), _ok(0.2, 1.5)), (failed, _ok(0.1, 1.0)), (_ok(0.1, 1.0), failed)]
    out = added_latency(pairs)
    assert (out["pairs"], out["failed_direct"], out["failed_gateway"]) == (1, 1, 1)
    assert out["ttft"]["median_ms"] == pytest.approx(100.0)


def test_no_successful_pair_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="no pair"):
        added_latency([(RequestResult(prompt_len=1, error="x"), RequestResult(prompt_len=1, error="y"))])


def test_gateway_cpus_split_the_host_between_the_gateway_and_the_rest():
    from kvpilot.operator.gateway.bench import split_cpus

    assert split_cpus("auto", {0, 1}) == ({0}, {1})
    assert split_cpus("auto", {0, 1, 2, 3}) == ({0, 1}, {2, 3})
    assert split_cpus("auto", {0}) is None  # one CPU: nothing to split
    assert split_cpus("none", {0, 1}) is None
    assert split_cpus("1", {0, 1}) == ({1}, {0})
    for bad in ("0,1", "7", "x"):
        with pytest.raises(ValueError, match="--gateway-cpus"):
            split_cpus(bad, {0, 1})
