"""`kvpilot gateway` as its own process (uvloop and httptools, as deployed), in front of a
stub engine: a stream passes through whole, errors keep the envelope, SIGTERM ends it."""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from kvpilot.engine.bench.serve_process import free_port
from kvpilot.operator.gateway.bench import GatewayProcess

EVENTS = 16


def _stub_engine() -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(EVENTS):
            event = {"object": "text_completion", "model": body["model"],
                     "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":16}}\n\n'
                         b"data: [DONE]\n\n")
        return resp

    async def metrics(_request):
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                                 "vllm:kv_cache_usage_perc 0\n")

    async def health(_request):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


@pytest.fixture(scope="module")
def upstream():
    """The stub engine on its own event loop in a thread, for the module."""
    loop = asyncio.new_event_loop()
    port = free_port()
    ready = threading.Event()
    runner = web.AppRunner(_stub_engine())

    async def start():
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(30), "the stub engine did not start"
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


def test_a_stream_passes_through_the_gateway_process_whole(upstream, tmp_path: Path):
    gw = GatewayProcess([f"tiny={upstream}"], "prefix", tmp_path / "gateway.log")
    with gw:
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
            texts = []
            with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True}) as r:
                assert r.status_code == 200 and r.headers["x-kvpilot-replica"] == "tiny-0"
                for line in r.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        texts.append(json.loads(line[6:])["choices"][0]["text"])
            assert texts == [f" t{i}" for i in range(EVENTS)]
            missing = http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
            bad = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
            assert bad.status_code == 400 and "error" in bad.json()
        assert gw.proc.poll() is None
    # uvicorn shuts down, then re-raises the SIGTERM it caught (so the exit says why): kvpilot's
    # own handler makes that exit 143 with one line (a signal PID 1 has no handler for is lost).
    log = (tmp_path / "gateway.log").read_text()
    assert gw.proc.returncode == 143 and "Traceback" not in log, log[-2000:]
    assert log.rstrip().endswith("kvpilot: terminated (SIGTERM)"), log[-2000:]
    assert "(event loop: uvloop)" in log  # a dependency, so the deployed gateway runs on it
