"""A misbehaving Prometheus for the fault tests: an HTTP server (a thread of the test
process, on the host side of the pod network so the operator's pod reaches it) whose
answers to /api/v1/query are chosen by `mode`:

    not-json     200 with an HTML body
    http-500     500 with a plain-text body
    wrong-shape  200 JSON whose data.result is an object, not a vector
    nan          200 well-formed vectors: every sample NaN, +Inf or -Inf, except the
                 freshness queries (timestamp(...)), which say "just now"

Samples carry `labels` (the deployment's namespace and the pod label Prometheus gives the
engine pods), so the operator's fleet reader, which asks grouped queries and attributes
each series by those labels, reads them as that deployment's.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

MODES = ("not-json", "http-500", "wrong-shape", "nan")
NON_FINITE = ("NaN", "+Inf", "-Inf")


def answer(mode: str, query: str, now: float, labels: dict | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body) for one query in `mode`."""
    if mode == "not-json":
        return 200, "text/html", b"<html><body>502 Bad Gateway</body></html>"
    if mode == "http-500":
        return 500, "text/plain", b"internal server error"
    if mode == "wrong-shape":
        body = {"status": "success", "data": {"resultType": "vector", "result": {"oops": [1, 2]}}}
        return 200, "application/json", json.dumps(body).encode()
    value = f"{now:.3f}" if "(timestamp(" in query else NON_FINITE[len(query) % 3]
    body = {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"pod": "tiny-0", **(labels or {})}, "value": [now, value]}]}}
    return 200, "application/json", json.dumps(body).encode()


class FakePrometheus:
    def __init__(self, host: str, mode: str = "not-json", labels: dict | None = None):
        self.mode = mode
        self.labels = labels
        self.queries = 0  # answered so far, any mode
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                query = parse_qs(urlparse(self.path).query).get("query", [""])[0]
                status, ctype, body = answer(fake.mode, query, time.time(), fake.labels)
                fake.queries += 1
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakePrometheus":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
