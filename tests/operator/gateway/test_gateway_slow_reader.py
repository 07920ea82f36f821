"""A client that stops reading its response (issue 40): after --write-timeout the gateway
drops it, and its queue slot, the replica's in-flight count and the replica's stream are
freed. The client's receive buffer is small, so backpressure reaches the gateway at once."""
from __future__ import annotations

import asyncio
import json
import socket

from gateway_fakes import FakeEngine
from test_gateway_proxy import gateway, run

WRITE_TIMEOUT = 0.5


async def stalled_client(port: int, body: dict) -> tuple[socket.socket, bytes]:
    """Open a connection with a 4 KiB receive buffer, send the request, read the response's
    first bytes, then read nothing more."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    data = json.dumps(body).encode()
    await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                  b"content-length: %d\r\n\r\n%s" % (len(data), data))
    first = await asyncio.wait_for(loop.sock_recv(sock, 1024), 10)
    return sock, first


async def drained_to_end(sock: socket.socket, seconds: float) -> bool:
    """Whether the connection ends (EOF or reset) once the client reads again."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(seconds):
            while await loop.sock_recv(sock, 1 << 20):
                pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_client_that_stops_reading_mid_stream_is_dropped_and_frees_its_slot_and_stream():
    # An endless stream, as far as the client is concerned: far more than any socket buffers.
    engine = FakeEngine("e1", chunks=400_000)

    async def scenario():
        async with gateway({"m": [engine]}, write_timeout=WRITE_TIMEOUT) as (client, app, table):
            backend = table.get("m")
            sock, first = await stalled_client(client.base_url.port, {
                "model": "m", "prompt": "x", "max_tokens": 3, "stream": True})
            assert first.startswith(b"HTTP/1.1 200")
            loop = asyncio.get_running_loop()
            started = loop.time()
            deadline = started + 10
            while backend.queue.in_flight or any(r.in_flight for r in backend.replicas.values()):
                assert loop.time() < deadline, "the stalled client still holds its slot"
                await asyncio.sleep(0.05)
            assert loop.time() - started >= WRITE_TIMEOUT * 0.5  # held while the buffers filled, not refused
            assert await drained_to_end(sock, 10), "the gateway did not drop the stalled connection"
            sock.close()
            # The gateway serves the next request at once; gateway() checks that the
            # replica's response (its aiohttp connection) was released.
            engine.chunks = 3
            resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
            assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    run(scenario())


def test_write_timeout_is_validated():
    import pytest

    from kvpilot.operator.gateway.config import GatewaySettings

    with pytest.raises(ValueError, match="--write-timeout"):
        GatewaySettings(write_timeout=0)
