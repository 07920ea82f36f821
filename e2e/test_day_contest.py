"""The day contest's real-time path (e2e/day_contest.py) on a short day: the trace replayed
open loop against a simulated H100 pod on the local cluster, every request timed by the
server's Server-Timing header, the pod's GPU counted from the API server, and the run
judged by the simulator's own scoring; the same trace in virtual time must come out close."""
from __future__ import annotations

import pytest

from day_contest import prompt_vocab, run_realtime

from kvpilot.engine.fleet.scenarios import scenario
from kvpilot.operator.autotune.virtual.contest import Contender, run_contender

pytestmark = pytest.mark.e2e


def test_a_short_day_in_real_time_is_scored_like_virtual_time_and_agrees(cluster, tuned_operator):
    scen = scenario("day").scaled(0.01)  # every phase of the day, 27 s in all
    trace = scen.trace()
    real = run_realtime(cluster, scen, trace, "defaults", prompt_vocab(scen), load_seconds=1,
                        wait_for_cleanup=False)  # one contender: nothing needs its GPU back first
    virtual = run_contender(scen, Contender("static", scen.max_num_seqs, scen.max_model_len, 1))
    o = real["overall"]
    assert o["requests"] == len(trace) and o["failed"] == 0, real["errors"]
    assert o["completed"] == len(trace) and o["good"] > 0
    assert [p["name"] for p in real["phases"]] == ["chat", "rag", "burst", "quiet", "batch"]
    assert [p["requests"] for p in real["phases"]] == [p["requests"] for p in virtual["phases"]]
    assert real["gpu_timeline"] == [(0.0, 1)]  # one pod held its GPU throughout, no more
    assert o["gpu_hours"] == pytest.approx(real["end"] / 3600, rel=1e-6)
    # Real processes on a shared host against the timing model alone: close, not equal (the
    # host adds its own time to each step when it is slow, so a slow host reads lower).
    ratio = o["goodput_per_gpu_hour"] / virtual["overall"]["goodput_per_gpu_hour"]
    assert 0.5 < ratio < 1.5, (o, virtual["overall"])
