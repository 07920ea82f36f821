"""Engine stand-ins for the gateway's tests: small ASGI apps on real sockets (uvicorn),
each answering as a kvpilot engine pod would, or failing in one chosen way."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeEngine:
    """mode: ok | draining (503) | die_mid_stream | hold (streams one chunk, then waits for
    `release`) | wedged (reads the request, then answers nothing until `release`). Records
    every request body it receives, and each request's Authorization header."""

    def __init__(self, name: str, mode: str = "ok", chunks: int = 3) -> None:
        self.name = name
        self.mode = mode
        self.chunks = chunks
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.release = asyncio.Event()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_text = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics":
            await self._send(send, 200, self.metrics_text.encode(), b"text/plain")
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        payload = json.loads(body)
        self.bodies.append(payload)
        self.auth.append(dict(scope["headers"]).get(b"authorization", b"").decode() or None)
        if self.mode == "wedged":
            await self.release.wait()
        if self.mode == "draining":
            await self._send(send, 503, json.dumps({"error": {"message": "draining"}}).encode(),
                             b"application/json", [(b"retry-after", b"1")])
            return
        usage = {"prompt_tokens": 10, "completion_tokens": self.chunks, "total_tokens": 10 + self.chunks}
        if not payload.get("stream"):
            await self._send(send, 200, json.dumps({"object": "text_completion", "served_by": self.name,
                                                    "choices": [{"text": "x" * self.chunks}],
                                                    "usage": usage}).encode(), b"application/json")
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(self.chunks):
            chunk = {"choices": [{"index": 0, "text": f"t{i}"}], "served_by": self.name}
            if (payload.get("stream_options") or {}).get("include_usage"):
                chunk["usage"] = None
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                        "more_body": True})
            if i == 0 and self.mode == "die_mid_stream":
                raise RuntimeError("engine pod lost")  # uvicorn drops the connection mid-body
            if i == 0 and self.mode == "hold":
                await self.release.wait()
        if (payload.get("stream_options") or {}).get("include_usage"):
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    @staticmethod
    async def _send(send, status, body, content_type, extra=()):
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type), *extra]})
        await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serving(app, port: int, http="auto"):
    """Serve an ASGI app on 127.0.0.1:port in this event loop until the block ends."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                           lifespan="off", http=http))
    task = asyncio.create_task(server.serve())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not server.started:
        if task.done():
            task.result()
        if loop.time() > deadline:
            raise TimeoutError(f"server on port {port} did not start")
        await asyncio.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
