"""A tiny HTTP server used as a pod by the e2e tests (stdlib only):
  GET /          -> {"pod": ..., "namespace": ..., "ip": ...}
  GET /healthz   -> ok (readiness probe)
  GET /message   -> the content of $MESSAGE_FILE (a mounted ConfigMap key)
  GET /metrics   -> Prometheus text: e2e_echo_requests_total, e2e_echo_up
Usage: python echo_server.py --host 0.0.0.0 --port 8080   (all addresses: port-forward dials localhost)"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REQUESTS = 0


class Handler(BaseHTTPRequestHandler):
    def log_message(self, fmt, *args):
        sys.stdout.write("%s %s\n" % (self.address_string(), fmt % args))

    def do_GET(self):
        global REQUESTS
        REQUESTS += 1
        if self.path == "/healthz":
            return self.reply(200, "ok\n", "text/plain")
        if self.path == "/message":
            try:
                with open(os.environ.get("MESSAGE_FILE", "/etc/echo/message")) as f:
                    return self.reply(200, f.read(), "text/plain")
            except OSError as e:
                return self.reply(500, f"{e}\n", "text/plain")
        if self.path == "/metrics":
            body = ("# TYPE e2e_echo_requests_total counter\n"
                    f"e2e_echo_requests_total {REQUESTS}\n"
                    "# TYPE e2e_echo_up gauge\ne2e_echo_up 1\n")
            return self.reply(200, body, "text/plain; version=0.0.4")
        body = json.dumps({"pod": os.environ.get("POD_NAME"), "namespace": os.environ.get("POD_NAMESPACE"),
                           "ip": os.environ.get("POD_IP", self.server.server_address[0])})
        return self.reply(200, body, "application/json")

    def reply(self, code: int, body: str, ctype: str):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"serving on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
