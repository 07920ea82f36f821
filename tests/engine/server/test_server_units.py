"""Server pieces without a model: the tuning file watcher and the metrics registry."""

from __future__ import annotations

import asyncio
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.core.outputs import EngineStats
from kvpilot.engine.metrics.exporter import TTFT_BUCKETS, ServerMetrics, buckets_1_2_5
from kvpilot.engine.server.tuning import TuningError, TuningWatcher, parse_tuning


def test_parse_tuning():
    assert parse_tuning(b'{"max_num_seqs": 24, "max_model_len": 1024}') == {
        "max_num_seqs": 24, "max_model_len": 1024}
    assert parse_tuning(b'{"max_num_seqs": 3, "future_knob": "x"}') == {"max_num_seqs": 3}
    for raw, field in ((b"{", "JSON"), (b"[1]", "object"), (b'{"max_num_seqs": 0}', "max_num_seqs"),
                       (b'{"max_model_len": true}', "max_model_len"),
                       (b'{"max_num_seqs": "8"}', "max_num_seqs")):
        with pytest.raises(TuningError, match=field):
            parse_tuning(raw)


def test_num_speculative_tokens_is_live_where_the_engine_speculates(tmp_path, caplog):
    """0 is a setting (off); an engine started without speculation ignores the key (and
    still applies the rest of the file)."""
    caplog.set_level("INFO", logger="kvpilot.server.tuning")
    assert parse_tuning(b'{"num_speculative_tokens": 0}') == {"num_speculative_tokens": 0}
    for raw in (b'{"num_speculative_tokens": -1}', b'{"num_speculative_tokens": true}',
                b'{"num_speculative_tokens": 1.5}'):
        with pytest.raises(TuningError, match="num_speculative_tokens"):
            parse_tuning(raw)
    path = tmp_path / "tuning.json"
    for current in ({"max_num_seqs": 8, "max_model_len": 64, "num_speculative_tokens": 3},
                    {"max_num_seqs": 8, "max_model_len": 64}):
        applied = {}

        async def apply(**changes):
            applied.update(changes)

        path.write_text('{"max_num_seqs": 4, "num_speculative_tokens": 0}')
        watcher = TuningWatcher(path, apply=apply, current=lambda: dict(current))
        assert asyncio.run(watcher.check()) is True
        speculating = "num_speculative_tokens" in current
        assert applied == ({"max_num_seqs": 4, "num_speculative_tokens": 0} if speculating else {"max_num_seqs": 4})
    assert any("not started with: num_speculative_tokens" in r.getMessage() for r in caplog.records)


def test_watcher_follows_content_through_a_symlink_swap(tmp_path, caplog):
    """A ConfigMap update swaps a symlink; the new file may carry the old mtime."""
    limits = {"max_num_seqs": 8, "max_model_len": 2048}

    async def apply(**changes):
        if changes.get("max_model_len", 0) > 4096:
            raise ValueError("max_model_len (9999) exceeds the model's max_position_embeddings")
        limits.update(changes)

    v1, v2 = tmp_path / "v1.json", tmp_path / "v2.json"
    v1.write_text('{"max_num_seqs": 4}')
    v2.write_text('{"max_num_seqs": 2, "max_model_len": 1024}')
    os.utime(v2, ns=(os.stat(v1).st_atime_ns, os.stat(v1).st_mtime_ns))
    link = tmp_path / "tuning.json"
    watcher = TuningWatcher(link, apply=apply, current=lambda: dict(limits))

    async def scenario():
        assert await watcher.check() is False  # missing file: logged, nothing changes
        link.symlink_to(v1)
        assert await watcher.check() is True and limits["max_num_seqs"] == 4
        assert await watcher.check() is False  # same content: no re-apply
        tmp = tmp_path / "tmp-link"
        tmp.symlink_to(v2)
        tmp.replace(link)
        assert await watcher.check() is True and limits == {"max_num_seqs": 2, "max_model_len": 1024}
        link.unlink()
        link.write_text('{"max_num_seqs": -1}')
        assert await watcher.check() is False
        link.write_text('{"max_model_len": 9999}')
        assert await watcher.check() is False

    asyncio.run(scenario())
    assert limits == {"max_num_seqs": 2, "max_model_len": 1024}
    rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(rejected) == 2 and "keeping max_num_seqs=2" in rejected[0]


def _stats(**kw) -> EngineStats:
    base = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_kv_blocks=10,
                num_preemptions_total=0, prefix_cache_queries_total=0, prefix_cache_hits_total=0,
                prompt_tokens_total=0, generation_tokens_total=0, max_num_seqs=8, max_model_len=2048)
    return EngineStats(**{**base, **kw})


def test_metrics_registry_names_buckets_and_counter_deltas():
    assert buckets_1_2_5(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    m = ServerMetrics("tiny", 2048)
    m.record_stats(_stats(prompt_tokens_total=10, generation_tokens_total=5, num_running=2))
    m.record_stats(_stats(prompt_tokens_total=30, generation_tokens_total=9, num_running=1,
                          kv_cache_usage=0.25, max_num_seqs=4))
    m.record_first_token(0.03)
    samples = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    assert samples["vllm:prompt_tokens_total"][0].value == 30
    assert samples["vllm:generation_tokens_total"][0].value == 9
    assert samples["vllm:num_requests_running"][0].value == 1
    assert samples["vllm:kv_cache_usage_perc"][0].value == 0.25
    assert samples["kvpilot:max_num_seqs"][0].value == 4
    assert samples["kvpilot:max_num_seqs"][0].labels == {"model_name": "tiny"}
    assert samples["vllm:num_requests_running"][0].labels == {"model_name": "tiny", "engine": "0"}
    les = [float(s.labels["le"]) for s in samples["vllm:time_to_first_token_seconds_bucket"]]
    assert les[:-1] == list(TTFT_BUCKETS)
    other = ServerMetrics("other", 1024)  # a second registry: no clash, no shared state
    assert b"other" in other.render() and b'model_name="tiny"' not in other.render()


def test_server_timing_header_round_trips_and_skips_what_it_cannot_say():
    from kvpilot.engine.core.outputs import RequestMetrics
    from kvpilot.engine.server.server_timing import parse_server_timing, server_timing

    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
                       last_token_time=11.4, finished_time=11.4)
    header = server_timing(m, [5])
    assert header == "queue;dur=500.000, ttft;dur=1000.000, tpot;dur=100.000, e2e;dur=1400.000"
    assert parse_server_timing(header) == pytest.approx({"queue": 0.5, "ttft": 1.0, "tpot": 0.1, "e2e": 1.4})
    assert "tpot" not in parse_server_timing(server_timing(m, [1]))  # one token: no gap to average
    assert "tpot" not in parse_server_timing(server_timing(m, [5, 5]))  # n=2: no single stream
    assert server_timing(RequestMetrics(arrival_time=1.0), [0]) is None  # never produced a token
    # another server's entries (no duration, a description) do not confuse the reader
    assert parse_server_timing('cache;desc="hit", db;dur=53, ttft;dur=abc') == {"db": 0.053}
    assert parse_server_timing(None) == {}


def test_a_request_the_engine_took_counts_against_the_queue_cap_before_the_next_publish():
    """Issue 40: the waiting gauge reached 80 with --max-queued-requests 64. The engine
    thread takes a burst of adds and then runs a step before it publishes its waiting count;
    the adds it took in between counted nowhere, so more were admitted past the cap."""
    import concurrent.futures
    from types import SimpleNamespace

    from kvpilot.engine.core.sampling_params import SamplingParams
    from kvpilot.engine.server.async_engine import AsyncEngine

    class StubEngine:
        latency_sink = None
        waiting = 0

        def add_request(self, *args, **kwargs):
            self.waiting += 1

        def stats(self):
            return SimpleNamespace(num_waiting=self.waiting, num_queued=self.waiting)

    stub = StubEngine()
    engine = AsyncEngine(stub, SimpleNamespace(record_stats=lambda stats: None))
    for i in range(3):  # as the engine thread runs three add commands before a step
        engine._do_add(f"r{i}", [1, 2], SamplingParams(max_tokens=1), 0.0, "default", concurrent.futures.Future())
    assert engine.queue_length == 3 and engine.num_waiting == 0  # not yet published, still counted
    engine._publish()
    assert engine.queue_length == 3 and engine.num_waiting == 3  # published once, not twice
