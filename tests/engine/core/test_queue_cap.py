"""Issue 40 part 8: the gauge of waiting requests never passes the queue cap. Requests
preempted back into the scheduler's queue were admitted already: they count against the
cap at admission (so new arrivals are refused while they wait) but are exported apart
(kvpilot:num_requests_preempted), so vllm:num_requests_waiting stays within the cap."""

from __future__ import annotations

import random

from kvpilot.engine import SamplingParams
from kvpilot.engine.config.engine import EngineConfig
from kvpilot.engine.core.clock import VirtualClock
from kvpilot.engine.core.request import RequestStatus
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.metrics.exporter import ServerMetrics

SIM = {"accelerator": "h100-80gb", "model": "llama-3.1-8b"}
CAP = 6


def _engine() -> LLMEngine:
    # Room for about 2.5 of the 600-token prompts growing by 200: steady preemption.
    return LLMEngine(EngineConfig(model=None, simulate=dict(SIM), max_model_len=1024,
                                  kv_cache_memory=2000 * 2**17, max_num_seqs=8), VirtualClock())


def _check_counts(engine: LLMEngine) -> None:
    s = engine.scheduler
    preempted = sum(r.status is RequestStatus.PREEMPTED for r in s.waiting)
    assert s.num_preempted_waiting == preempted and s.num_queued == len(s.waiting) - preempted


def test_admission_as_the_server_does_keeps_the_waiting_gauge_within_the_cap():
    """Admit while what the engine published (new and preempted) leaves room, as
    AsyncEngine.queue_length does; step; abort some waiting ones on the way (a client
    leaving). The gauge's value never passes the cap, though preemption refills the queue."""
    engine, rng = _engine(), random.Random(3)
    metrics = ServerMetrics("m", 1024)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    peak_gauge = peak_queued = sent = 0
    for _ in range(20000):
        stats = engine.stats()
        queued = stats.num_queued
        while sent < 30 and queued + 1 <= CAP:
            engine.add_request(str(sent), [100 + sent] * 600, params)
            sent, queued = sent + 1, queued + 1
        if rng.random() < 0.05 and engine.scheduler.waiting:
            engine.abort_request(rng.choice(list(engine.scheduler.waiting)).request_id)
        engine.step()
        _check_counts(engine)
        stats = engine.stats()
        metrics.record_stats(stats)
        gauge = metrics.registry.get_sample_value("vllm:num_requests_waiting", {"model_name": "m", "engine": "0"})
        assert gauge == stats.num_waiting
        peak_gauge, peak_queued = max(peak_gauge, gauge), max(peak_queued, stats.num_queued)
        if sent == 30 and not engine.has_unfinished_requests():
            break
    assert engine.scheduler.num_preemptions > 0, "the small KV cache should have forced preemption"
    assert peak_queued > CAP, "preemption should have pushed the whole queue past the cap"
    assert 0 < peak_gauge <= CAP
    assert engine.stats().num_preempted_waiting == 0 and engine.stats().num_waiting == 0
