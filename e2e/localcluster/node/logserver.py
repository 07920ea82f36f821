"""The part of the kubelet API that `kubectl logs` needs: the API server
proxies GET /containerLogs/{namespace}/{pod}/{container} (tailLines, follow)
to the node's endpoint, served here over TLS on the pod network's gateway."""
from __future__ import annotations

import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlparse

if TYPE_CHECKING:
    from .agent import Node


class LogServer:
    def __init__(self, node: "Node", host: str, port: int, cert: Path, key: Path):
        node_ref = node

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                url = urlparse(self.path)
                parts = url.path.strip("/").split("/")
                if url.path == "/healthz":
                    return self._send(200, b"ok")
                if len(parts) != 4 or parts[0] != "containerLogs":
                    return self._send(404, b"not found")
                _, ns, pod, container = parts
                logfile = node_ref.log_file(ns, pod, container)
                if logfile is None or not logfile.exists():
                    return self._send(404, f"no logs for {ns}/{pod}/{container}".encode())
                q = parse_qs(url.query)
                data = logfile.read_bytes()
                if "tailLines" in q:
                    lines = data.splitlines(keepends=True)
                    data = b"".join(lines[-int(q["tailLines"][0]):]) if int(q["tailLines"][0]) else b""
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                if q.get("follow", ["false"])[0] != "true":
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.end_headers()
                self.wfile.write(data)
                pos = logfile.stat().st_size
                try:
                    while node_ref.log_file(ns, pod, container) == logfile and not node_ref.stopping.is_set():
                        size = logfile.stat().st_size
                        if size > pos:
                            with open(logfile, "rb") as f:
                                f.seek(pos)
                                self.wfile.write(f.read(size - pos))
                                self.wfile.flush()
                            pos = size
                        time.sleep(0.2)
                except (OSError, ConnectionError):
                    pass

            def _send(self, code: int, body: bytes):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)

    def start(self) -> None:
        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="logserver").start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
