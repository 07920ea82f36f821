"""The gateway's edge (issue 40, parts 2-5 and the smaller findings): slow or oversized
requests, two framings, HEAD, who reads /metrics, lone surrogates, `stream_options`
passed on as sent, and token limits that hold under concurrency and disconnects."""
from __future__ import annotations

import asyncio
import json

import httpx

from gateway_fakes import FakeEngine
from test_gateway_proxy import KEY_B, assert_envelope, completion, gateway, run, tenants_for

EDGE = {"header_read_timeout": 0.4, "body_read_timeout": 0.4, "max_header_bytes": 8192, "max_headers": 50}


async def raw(port: int, data: bytes, seconds: float = 3.0, then: bytes = b"") -> tuple[bytes, bool]:
    """Send bytes (and `then` after a pause); (what came back, whether the server closed)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    if then:
        await asyncio.sleep(0.05)
        writer.write(then)
    got, closed = b"", False
    try:
        async with asyncio.timeout(seconds):
            while chunk := await reader.read(65536):
                got += chunk
            closed = True
    except (TimeoutError, ConnectionResetError):
        pass
    writer.close()
    return got, closed


def port_of(client: httpx.AsyncClient) -> int:
    return client.base_url.port


def test_slow_and_oversized_requests_are_cut_off_with_the_envelope():
    async def main():
        async with gateway({"m": [FakeEngine("one")]}, **EDGE) as (client, app, _):
            port, loop = port_of(client), asyncio.get_running_loop()
            t0 = loop.time()
            got, closed = await raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            assert closed and got.startswith(b"HTTP/1.1 408") and b"--header-read-timeout" in got
            assert loop.time() - t0 < 2
            got, closed = await raw(port, b"")  # a connection that sends nothing
            assert closed and got == b""
            got, closed = await raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                                          b"Content-Type: application/json\r\n\r\n{\"mo")
            assert closed and got.startswith(b"HTTP/1.1 408") and b"--body-read-timeout" in got
            got, closed = await raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
            assert closed and got.startswith(b"HTTP/1.1 431") and b"--max-header-bytes" in got
            many = b"".join(b"X-%d: 1\r\n" % i for i in range(60))
            got, closed = await raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
            assert closed and got.startswith(b"HTTP/1.1 431") and b"--max-headers" in got
            got, closed = await raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # still serving
            assert got.startswith(b"HTTP/1.1 200")
    run(main())


def test_two_framings_are_refused_and_the_connection_closes():
    async def main():
        engine = FakeEngine("one")
        async with gateway({"m": [engine]}, **EDGE) as (client, app, _):
            body = json.dumps(completion()).encode()
            smuggled = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), len(body), body))
            got, closed = await raw(port_of(client), smuggled + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert closed and got.count(b"HTTP/1.1 ") == 1 and got.startswith(b"HTTP/1.1 400")
            assert b'"error"' in got and engine.bodies == []
    run(main())


def test_head_answers_on_get_routes():
    async def main():
        async with gateway({"m": [FakeEngine("one")]}) as (client, app, _):
            for path in ("/health", "/v1/models", "/metrics"):
                r = await client.head(path)
                assert r.status_code == 200 and r.content == b"", path
            assert (await client.head("/v1/completions")).status_code == 405
    run(main())


def test_metrics_are_closed_by_default_when_tenants_exist(tmp_path):
    async def main():
        async with gateway({"m1": [FakeEngine("one")]}, tenants_for(tmp_path)) as (client, *_):
            assert_envelope(await client.get("/metrics"), 403, match="--metrics-key-file")
            assert_envelope(await client.get("/metrics", headers={"Authorization": f"Bearer {KEY_B}"}), 403)
        async with gateway({"m1": [FakeEngine("one")]}, tenants_for(tmp_path), keys={"metrics_key": "k" * 32}) \
                as (client, *_):
            assert_envelope(await client.get("/metrics", headers={"Authorization": f"Bearer {KEY_B}"}), 401)
            r = await client.get("/metrics", headers={"Authorization": "Bearer " + "k" * 32})
            assert r.status_code == 200 and "kvpilot_gateway" in r.text
        async with gateway({"m1": [FakeEngine("one")]}) as (client, *_):  # open gateway: nothing private
            assert (await client.get("/metrics")).status_code == 200
    run(main())


def test_a_lone_surrogate_is_a_400_naming_the_field_not_a_500():
    async def main():
        engine = FakeEngine("one")
        async with gateway({"m": [engine]}) as (client, *_):
            for body, param in [
                (b'{"model": "m", "prompt": "a\\ud800b"}', "prompt"),
                (b'{"model": "m", "prompt": ["ok", "\\udfff"]}', "prompt[1]"),
                (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
                 "messages[0].content[0].text"),
            ]:
                r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                assert_envelope(r, 400, param=param, match="surrogate")
            ok = b'{"model": "m", "prompt": "\\ud83d\\ude00"}'  # a pair is fine
            assert (await client.post("/v1/completions", content=ok)).status_code == 200
            assert engine.bodies == [{"model": "m", "prompt": "\U0001F600"}]
    run(main())


def test_an_invalid_stream_options_is_passed_on_as_sent_not_repaired(tmp_path):
    async def main():
        engine = FakeEngine("one")
        async with gateway({"m1": [engine], "m2": [engine]}, tenants_for(tmp_path, "tokensPerWindow: 1000")) \
                as (client, *_):
            b = {"Authorization": f"Bearer {KEY_B}"}
            for options in ([], "yes", {"include_usage": []}, {"include_usage": "no"}):
                await client.post("/v1/completions", json=completion("m2", stream=True, stream_options=options),
                                  headers=b)
                assert engine.bodies[-1]["stream_options"] == options
    run(main())


def test_concurrent_requests_cannot_exceed_the_token_limit(tmp_path):
    async def main():
        engine = FakeEngine("one", "hold", chunks=50)
        async with gateway({"m2": [engine]}, tenants_for(tmp_path, "tokensPerWindow: 60"),
                           stream_idle_timeout=30) as (client, *_):
            b = {"Authorization": f"Bearer {KEY_B}"}
            tasks = [asyncio.create_task(client.post("/v1/completions", json=completion(
                "m2", max_tokens=50, stream=True), headers=b)) for _ in range(8)]
            done = []
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while len(done) < 7 and loop.time() < deadline:  # seven refused while one holds 50 reserved
                done = [t for t in tasks if t.done()]
                await asyncio.sleep(0.01)
            engine.release.set()
            codes = sorted(r.status_code for r in await asyncio.gather(*tasks))
            assert codes == [200] + [429] * 7
    run(main())


def test_streams_cut_by_the_client_are_charged_and_the_limit_holds(tmp_path):
    async def main():
        engine = FakeEngine("one", chunks=50)
        async with gateway({"m2": [engine]}, tenants_for(tmp_path, "tokensPerWindow: 60")) as (client, *_):
            b = {"Authorization": f"Bearer {KEY_B}"}
            received, refused = 0, 0
            for _ in range(6):
                async with client.stream("POST", "/v1/completions", headers=b,
                                         json=completion("m2", max_tokens=50, stream=True)) as r:
                    if r.status_code == 429:
                        refused += 1
                        continue
                    events = 0
                    async for line in r.aiter_lines():
                        events += line.startswith("data: {")
                        if events == 45:
                            break  # the client cuts the stream before its usage event
                    received += events
            assert received <= 60 + 50 and refused >= 4
    run(main())
