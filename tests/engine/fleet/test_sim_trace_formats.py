"""Public trace formats as simulator traces: Azure 2023/2024 CSVs, BurstGPT CSV, Mooncake
JSONL with block hash ids (prefix hits exactly where the trace says), and the window,
rate scale and clipping options, each reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.engine.config.engine import EngineConfig
from kvpilot.engine.fleet.fleet import Fleet
from kvpilot.engine.fleet.trace import TraceRequest, parse_trace_line
from kvpilot.engine.fleet.trace_formats import TraceOptions, load_trace, parse_timestamp

FIX = Path(__file__).parent / "trace_fixtures"


def test_azure_2023_rows_become_requests_on_the_first_rows_clock():
    t = load_trace(FIX / "azure2023_conv.csv", TraceOptions(fmt="azure2023"))
    assert [r.prompt_len for r in t.requests] == [374, 396, 879, 1, 200000]
    assert [r.output_len for r in t.requests][:3] == [44, 109, 55]
    assert t.requests[0].arrival == 0.0
    assert t.requests[1].arrival == pytest.approx(4.314579, abs=1e-6)  # 7 fraction digits kept
    assert any("0 context or generated" in n for n in t.notes)


def test_azure_2024_stamps_with_offset_and_without_fraction():
    t = load_trace(FIX / "azure2024_code.csv", TraceOptions(fmt="azure2024"))
    assert [round(r.arrival, 6) for r in t.requests] == [0.0, 0.007405, 0.99007, 2.07396]
    assert parse_timestamp("2024-05-10 01:00:00+01:00", "x") == parse_timestamp("2024-05-10 00:00:00", "x")


def test_burstgpt_skips_failed_requests_and_reports_them():
    t = load_trace(FIX / "burstgpt.csv", TraceOptions(fmt="burstgpt"))
    assert [(r.arrival, r.prompt_len, r.output_len) for r in t.requests] == [
        (0.0, 472, 18), (113.0, 417, 30), (115.5, 1360, 120)]
    assert any("1 failed" in n for n in t.notes)


def test_window_rate_scale_and_clipping_are_applied_and_reported():
    t = load_trace(FIX / "azure2023_conv.csv",
                   TraceOptions(fmt="azure2023", start_s=4.0, duration_s=30.0, rate_scale=4.0, max_context=8192))
    assert len(t.requests) == 4 and t.requests[0].arrival == pytest.approx(0.314579 / 4, abs=1e-6)
    long = t.requests[-1]
    assert long.prompt_len == 8191 and long.output_len == 1
    joined = " ".join(t.notes)
    assert "window" in joined and "x4" in joined and "clipped" in joined and "1 requests" in joined


def test_a_bad_row_names_its_file_and_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,12x,4\n")
    with pytest.raises(ValueError, match="bad.csv line 2: ContextTokens"):
        load_trace(bad, TraceOptions(fmt="azure2023"))
    with pytest.raises(ValueError, match="missing column"):
        load_trace(FIX / "burstgpt.csv", TraceOptions(fmt="azure2023"))
    with pytest.raises(ValueError, match="trace_format"):
        TraceOptions(fmt="csv")


def test_mooncake_hash_ids_become_shared_token_blocks():
    t = load_trace(FIX / "mooncake.jsonl", TraceOptions(fmt="mooncake"))
    a, b, c, d = t.requests
    assert (a.arrival, c.arrival, d.arrival) == (0.0, 2.5, 4.0)
    vocab = (0, 32000)
    ia, ib, ic, id_ = (r.token_ids(k, vocab) for k, r in enumerate(t.requests))
    assert len(ia) == 1100 and len(ib) == 1300
    assert ia[:1024] == ib[:1024] and ia[1024:1030] != ib[1024:1030]  # blocks 0, 1 shared; 2 vs 3 not
    assert ic[:512] != ia[:512]
    assert id_ == ia[:1024]
    # The kvpilot format keeps the identity through a write and read.
    again = parse_trace_line(json.dumps(a.to_json()), "x")
    assert again.hash_ids == (0, 1, 2) and again.token_ids(0, vocab) == ia


def test_hash_ids_longer_than_the_prompt_are_refused():
    with pytest.raises(ValueError, match="hash_ids has 3 blocks"):
        parse_trace_line('{"arrival": 0, "prompt_len": 600, "output_len": 1, "hash_ids": [1, 2, 3]}', "x")


def test_a_replay_hits_the_prefix_cache_where_the_hash_ids_say():
    t = load_trace(FIX / "mooncake.jsonl", TraceOptions(fmt="mooncake"))
    cfg = EngineConfig(model=None, simulate={"accelerator": "h100-80gb", "model": "llama-3.1-8b"},
                       max_model_len=8192, enable_prefix_caching=True)
    fleet = Fleet(cfg)
    fleet.run(t.requests)
    cached = [r.num_cached_tokens for r in fleet.requests]
    assert cached[2] == 0  # its own blocks
    assert cached[3] >= 1000  # blocks 0 and 1, computed by the first request 4 s before
    # Without hash ids the same lengths share nothing.
    plain = [TraceRequest(r.arrival, r.prompt_len, r.output_len) for r in t.requests]
    fleet = Fleet(cfg)
    fleet.run(plain)
    assert fleet.requests[3].num_cached_tokens == 0
