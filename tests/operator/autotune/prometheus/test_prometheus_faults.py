"""The Prometheus reader against a real local HTTP server that misbehaves: unreachable,
not JSON, HTTP 5xx, wrong shapes, NaN/Inf values. Every one is no data (MetricsUnavailable
or a snapshot without values), never a crash and never a decision; the MetricsAvailable
condition says which."""
from __future__ import annotations

import json
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvpilot.operator.autotune.hook import autotune_step
from kvpilot.operator.autotune.prometheus.condition import metrics_condition
from kvpilot.operator.autotune.prometheus.client import BAD_RESPONSE, UNREACHABLE, MetricsUnavailable
from kvpilot.operator.autotune.prometheus.reader import PrometheusReader
from test_autotune_hook import T0, FakeKube, ctx, spec_body

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "e2e"))
from fakeprom import MODES, answer  # noqa: E402  (the e2e test's server answers, reused)


class Server:
    """A local HTTP server answering every request with `self.reply` = (status, ctype, body)."""

    def __init__(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                status, ctype, body = server.reply(self.path)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.reply = lambda path: (200, "text/plain", b"")
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


def read(url: str):
    return PrometheusReader.from_url(url).snapshot("demo", "tiny", 15.0)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_prometheus_is_reported_at_once():
    url = f"http://127.0.0.1:{closed_port()}"
    t = time.monotonic()
    with pytest.raises(MetricsUnavailable) as e:
        read(url)
    assert e.value.reason == UNREACHABLE and url in str(e.value)
    assert time.monotonic() - t < 2  # no retries with backoff
    c = metrics_condition(url, None, e.value)
    assert (c.status, c.reason) == ("False", "PrometheusUnreachable") and url in c.message


@pytest.mark.parametrize("mode,needle", [("not-json", "JSON"), ("http-500", "500"), ("wrong-shape", "not a list")])
def test_garbage_answers_are_a_bad_response(server, mode, needle):
    server.reply = lambda path: answer(mode, "", time.time())
    with pytest.raises(MetricsUnavailable) as e:
        read(server.url)
    assert e.value.reason == BAD_RESPONSE and needle in e.value.detail, e.value.detail
    c = metrics_condition(server.url, None, e.value)
    assert (c.status, c.reason) == ("False", "BadResponse") and server.url in c.message


def test_nan_and_inf_values_read_as_no_value(server):
    from urllib.parse import parse_qs, urlparse
    server.reply = lambda path: answer("nan", parse_qs(urlparse(path).query)["query"][0], time.time())
    snap = read(server.url)
    assert snap.kv_usage_mean is None and snap.preemptions_per_s is None and snap.pods == ()
    assert snap.no_data_reason() and "no value for" in snap.no_data_reason()
    c = metrics_condition(server.url, snap, None)
    assert (c.status, c.reason) == ("False", "NoData")


def test_every_misbehaviour_through_the_hook_holds_every_setting(server):
    from urllib.parse import parse_qs, urlparse
    for mode in MODES:
        server.reply = lambda path, m=mode: answer(m, parse_qs(urlparse(path).query).get("query", [""])[0],
                                                   time.time())
        c = ctx(spec_body(seqs=64) | {"autotune": {**spec_body()["autotune"],
                                                   "prometheus": {"url": server.url}}}, kube=FakeKube())
        out = autotune_step(c, now=T0)
        assert out.proposed is None and out.status().diagnosis == "NoData", mode
        (metrics,) = [x for x in out.conditions if x.type == "MetricsAvailable"]
        assert metrics.status == "False" and server.url in metrics.message, mode


bodies = st.one_of(
    st.binary(max_size=200),
    st.recursive(st.none() | st.booleans() | st.floats(allow_nan=True) | st.text(max_size=10),
                 lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children,
                                                                                   max_size=3),
                 max_leaves=10).map(lambda v: json.dumps({"status": "success", "data": {"result": v}}).encode()),
    st.lists(st.tuples(st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6),
                       st.sampled_from(["NaN", "+Inf", "-Inf", "1e400", "x", "0.5", ""])), max_size=3)
    .map(lambda vs: json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"pod": "p"}, "value": list(v)} for v in vs]}}).encode()),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(status=st.sampled_from([200, 200, 200, 404, 500, 502, 503]), body=bodies)
def test_any_answer_is_data_or_no_data_never_a_crash(server, status, body):
    server.reply = lambda path: (status, "application/json", body)
    try:
        snap = read(server.url)
    except MetricsUnavailable as e:
        assert e.reason in (BAD_RESPONSE, UNREACHABLE)
        return
    # well-formed vectors: every value is a finite number or None
    for field in ("kv_usage_mean", "preemptions_per_s", "queue_time_p95_s", "num_waiting"):
        v = getattr(snap, field)
        assert v is None or v == v and abs(v) != float("inf")
