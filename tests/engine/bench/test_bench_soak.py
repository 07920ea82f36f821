"""`kvpilot bench soak`: the request mix, how answers are judged, the checks, and a short
soak of a real `kvpilot serve` started by the command (the 10,000-request figure is a
benchmark, in docs/server.md, not a test)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest

from kvpilot.engine.bench.soak import SoakConfig, metric
from kvpilot.engine.bench.soak_client import Outcome, send
from kvpilot.engine.bench.soak_mix import CANCEL_MIN_TOKENS, SoakRequest, make_requests
from kvpilot.engine.bench.soak_report import growth_pct, summarize
from kvpilot.engine.cli import main


def test_the_mix_is_deterministic_and_covers_every_feature():
    reqs = make_requests(2000, 7, model="m", vocab_size=4096, max_tokens=16, cancel_fraction=0.05)
    again = make_requests(2000, 7, model="m", vocab_size=4096, max_tokens=16, cancel_fraction=0.05)
    assert [r.body for r in reqs] == [r.body for r in again]
    assert [r.body for r in reqs] != [r.body for r in make_requests(
        2000, 8, model="m", vocab_size=4096, max_tokens=16, cancel_fraction=0.05)]
    assert set(Counter(r.kind for r in reqs)) == {"completions/stream", "completions/json",
                                                  "chat/stream", "chat/json"}
    assert {r.n for r in reqs} == {1, 2, 3} and all(r.body["n"] == r.n for r in reqs)
    assert sum("stop" in r.body for r in reqs) > 300
    assert sum(r.logprobs for r in reqs) > 300
    assert any(isinstance(r.body.get("prompt"), list) for r in reqs)
    assert any(len(r.body.get("messages", ())) > 1 for r in reqs)
    cancels = [r for r in reqs if r.cancel_after is not None]
    assert 50 <= len(cancels) <= 150  # about 5 % of 2000
    for r in cancels:  # streaming, nothing ends it early, cut within its first quarter
        tokens = r.body.get("max_tokens", r.body.get("max_completion_tokens"))
        assert r.stream and r.body["ignore_eos"] and "stop" not in r.body
        assert tokens >= CANCEL_MIN_TOKENS and 1 <= r.cancel_after <= tokens // 4
    for r in reqs:
        assert 1 <= r.body.get("max_tokens", r.body.get("max_completion_tokens", 0))
        assert r.include_usage == ("stream_options" in r.body) and (r.stream or not r.include_usage)


@pytest.mark.parametrize("kwargs,field", [
    ({}, "base_url"),
    ({"base_url": "http://x", "serve_model": "builtin:tiny"}, "base_url"),
    ({"base_url": "http://x", "concurrency": 0}, "concurrency"),
    ({"base_url": "http://x", "cancel_fraction": 1.5}, "cancel_fraction"),
    ({"base_url": "http://x", "num_requests": 10, "warmup_requests": 10}, "warmup_requests"),
    ({"base_url": "http://x", "settle_timeout_s": 0}, "settle_timeout_s"),
])
def test_config_refuses_bad_settings(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SoakConfig(**kwargs)
    assert SoakConfig(base_url="http://x", num_requests=50).warmup_requests == 5


def _request(stream: bool, *, endpoint: str = "completions", n: int = 1, logprobs: bool = False,
             cancel_after: int | None = None) -> SoakRequest:
    return SoakRequest(0, endpoint, stream, n, logprobs, False, {"n": n, "stream": stream}, cancel_after)


def _judge(req: SoakRequest, status: int, content: bytes, content_type: str = "application/json") -> Outcome:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=content, headers={"content-type": content_type})

    async def go() -> Outcome:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://s") as c:
            return await send(c, req, {})
    return asyncio.run(go())


def _sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
                    for e in events)


ENVELOPE = json.dumps({"error": {"message": "boom", "type": "x", "param": None, "code": 500}}).encode()
GOOD_JSON = json.dumps({"choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
                        "usage": {"completion_tokens": 1}}).encode()
CHUNK = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
LAST = {"choices": [{"index": 0, "text": "b", "finish_reason": "stop"}]}


@pytest.mark.parametrize("req,status,content,kind", [
    (_request(False), 200, GOOD_JSON, None),
    (_request(True), 200, _sse(CHUNK, LAST, b"[DONE]"), None),
    (_request(False), 500, ENVELOPE, "http_500"),
    (_request(False), 500, b"Internal Server Error", "no_envelope_500"),
    (_request(True), 502, b"<html>bad gateway</html>", "no_envelope_502"),
    (_request(True), 200, _sse(CHUNK), "broken_stream"),
    (_request(True), 200, _sse(CHUNK, {"error": {"message": "engine step failed"}}, b"[DONE]"),
     "stream_error"),
    (_request(True), 200, _sse(CHUNK, b"[DONE]"), "bad_answer"),  # no finish_reason
    (_request(False, n=2), 200, GOOD_JSON, "bad_answer"),  # one choice of two
    (_request(False, logprobs=True), 200, GOOD_JSON, "bad_answer"),  # text without logprobs
    (_request(True), 200, _sse(CHUNK, b"{not json"), "bad_answer"),
])
def test_answers_are_judged(req, status, content, kind):
    out = _judge(req, status, content, "text/event-stream" if req.stream else "application/json")
    assert (out.status, out.kind) == (("ok", "") if kind is None else ("failed", kind)), out


def test_a_cancel_disconnects_mid_stream_and_one_that_finishes_first_is_ok():
    long = _sse(*[CHUNK] * 5, LAST, b"[DONE]")
    assert _judge(_request(True, cancel_after=2), 200, long, "text/event-stream").status == "cancelled"
    late = _judge(_request(True, cancel_after=20), 200, long, "text/event-stream")
    assert late.status == "ok" and late.cancel_missed


def test_checks_fail_on_failures_growth_stuck_gauges_and_unseen_cancels():
    cfg = SoakConfig(base_url="http://x", num_requests=4, max_rss_growth_pct=5.0)
    reqs = [_request(True, cancel_after=1), _request(False), _request(False), _request(False)]

    def result(outcomes, rss_end=100, settled=0.1, aborted=1):
        return summarize(cfg, reqs, outcomes, duration=1.0, rss={"start": 90, "warmup": 100, "middle": 100,
                         "end": rss_end}, rss_source="test", rss_trace=[], gauges={}, settled_s=settled,
                         server_aborted=aborted, model="m", base_url="http://x")

    fine = [Outcome("cancelled"), Outcome("ok"), Outcome("ok"), Outcome("ok")]
    assert result(fine)["passed"] and result(fine)["by_class"]["completions/json"] == {"sent": 3, "ok": 3}
    failed = result(fine[:3] + [Outcome("failed", "http_500", "boom")])
    assert not failed["passed"] and failed["failures_by_kind"] == {"http_500": 1}
    assert failed["errors"] == ["#0 completions/json: http_500: boom"]
    assert result(fine, rss_end=106)["checks"]["rss_growth"] is False
    assert result(fine, settled=None)["checks"]["gauges_back_to_zero"] is False
    assert result(fine, aborted=0)["checks"]["cancels_reached_server"] is False
    assert growth_pct({"warmup": 200, "end": 210}) == pytest.approx(5.0)
    assert growth_pct({"warmup": None, "end": 210}) is None


def test_metric_sums_matching_samples():
    samples = {("a_total", (("finished_reason", "abort"), ("model_name", "m"))): 3.0,
               ("a_total", (("finished_reason", "stop"), ("model_name", "m"))): 5.0}
    assert metric(samples, "a_total") == 8.0
    assert metric(samples, "a_total", {"finished_reason": "abort"}) == 3.0
    assert metric(samples, "missing") is None


def test_a_short_soak_of_a_real_server(capsys):
    """builtin:tiny served by the command itself: no failure, the gauges back to 0, and
    every cancel seen by the server (aborted in the engine, logged as a disconnect). A smoke
    of the benchmark (40 requests, 8 tokens each): the long soak's figure is in docs/server.md."""
    marked = sum(r.cancel_after is not None for r in make_requests(
        40, 1, model="m", vocab_size=4096, max_tokens=8, cancel_fraction=0.25))
    assert marked >= 8  # seed 1 marks 12 for builtin:tiny's 4096 tokens: enough cancels to race
    code = main(["bench", "soak", "--serve-model", "builtin:tiny", "--serve-args", "--kv-cache-memory 64Mi",
                 "--num-requests", "40", "--concurrency", "16", "--cancel-fraction", "0.25",
                 "--max-tokens", "8", "--seed", "1", "--max-rss-growth-pct", "1000", "--disable-tqdm",
                 "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["passed"], r
    assert r["sent"] == 40 and r["failed"] == 0 and r["failures_by_kind"] == {}
    assert r["ok"] + r["cancelled"] == 40 and r["cancelled"] + r["cancel_missed"] == marked
    assert r["cancelled"] >= marked // 2  # a cancel may lose the race
    assert r["server_aborted"] >= r["cancelled"] and r["server_log_disconnects"] >= r["cancelled"]
    assert r["server_log_tracebacks"] == 0 and r["server_exit_code"] == 0
    assert set(r["gauges_at_end"].values()) == {0.0} and r["gauges_settled_s"] is not None
    assert all(r["rss_bytes"][k] > 0 for k in ("start", "warmup", "middle", "end"))
    assert len(r["by_class"]) == 4
