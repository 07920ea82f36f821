"""The operator's /healthz when it runs with leader election. kopf's own liveness
endpoint starts with kopf, which a standby does not run; this one answers on
leader and standby alike, and fails only when the event loop stops ticking."""
from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STALE_AFTER_S = 30.0  # the loop ticks every second; 30 s without one is a hung process


class Heartbeat:
    """The last time the event loop ran, and the leadership state, for the probe."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.last = clock()
        self.role = "standby"

    def healthy(self) -> bool:
        return self.clock() - self.last < STALE_AFTER_S

    async def beat(self, period_s: float = 1.0) -> None:
        while True:
            self.last = self.clock()
            await asyncio.sleep(period_s)


def serve_health(heartbeat: Heartbeat, host: str, port: int) -> ThreadingHTTPServer:
    """Serve GET /healthz from a daemon thread: 200 with the role, 503 when the loop is stuck."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            if self.path.split("?")[0] != "/healthz":
                self.send_error(404)
                return
            ok = heartbeat.healthy()
            body = f"{'ok' if ok else 'event loop stalled'} ({heartbeat.role})\n".encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # probes every few seconds: not worth a log line each
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="healthz", daemon=True).start()
    return server
