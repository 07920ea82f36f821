"""`kvpilot serve` and a client that stops reading its stream (issue 40): after
--write-timeout the server drops the connection and aborts the request, instead of its
handler waiting in `send` while the engine generates for nobody. The client's receive
buffer is small, so backpressure reaches the server quickly."""

from __future__ import annotations

import json
import socket
import time

import pytest

from server_harness import ServerProcess, wait_for

KEY = "slow-reader-key"
WRITE_TIMEOUT_S = 0.5
FAST_GPU = {"name": "slow-reader-gpu", "memory_bytes": 8 * 2**30, "bandwidth": 1e12, "flops": 1e14,
            "step_overhead_s": 0.002, "per_seq_overhead_s": 0.0, "reserved_bytes": 0, "source": "issue 40"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slow-reader")
    (tmp / "gpu.json").write_text(json.dumps(FAST_GPU))
    proc = ServerProcess([
        "--simulate", str(tmp / "gpu.json"), "--simulate-model", "builtin:tiny", "--dtype", "float32",
        "--served-model-name", "tiny", "--max-model-len", "4096", "--kv-cache-memory", "256Mi",
        "--api-key", KEY, "--write-timeout", str(WRITE_TIMEOUT_S),
    ], tmp / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _aborted(server) -> float:
    return server.metrics().get('vllm:request_success_total{engine=0,finished_reason=abort,model_name=tiny}', 0.0)


def test_a_client_that_stops_reading_mid_stream_is_dropped_and_its_request_aborted(server):
    before = _aborted(server)
    # 8 choices of 4000 tokens with 20 logprobs each: about 40 MB, far past the socket
    # buffers (loopback grows the server's to a few MB), so the stream is still running when
    # they fill; the request then ends as "abort", where without the deadline it would end
    # as "length".
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 4000, "n": 8, "ignore_eos": True,
                       "logprobs": 20, "stream": True}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.settimeout(10)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body))
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    start = time.monotonic()  # and read nothing more
    wait_for(lambda: _aborted(server) > before, 60, what="the stalled client's request to be aborted")
    assert time.monotonic() - start >= WRITE_TIMEOUT_S * 0.5
    metrics = server.metrics()
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:num_requests_waiting"] == 0
    ended = False
    try:
        while sock.recv(1 << 20):
            pass
        ended = True
    except ConnectionResetError:
        ended = True
    except socket.timeout:
        pass
    sock.close()
    assert ended, "the server did not drop the stalled connection"


def test_write_timeout_is_validated():
    from kvpilot.engine.server.limits import ServerLimits

    with pytest.raises(ValueError, match="write_timeout"):
        ServerLimits(write_timeout=0)


def test_a_connection_closed_with_unread_bytes_is_aborted_after_the_deadline():
    """uvicorn closes a connection after a `Connection: close` response or at its keep-alive
    timeout; asyncio then waits for the unsent bytes to drain, for ever if the client reads
    nothing. Below the high-water mark no pause_writing comes, so close() arms the deadline."""
    import asyncio

    from kvpilot.engine.server.write_deadline import with_write_deadline

    class Transport:
        def __init__(self):
            self.buffered, self.closed, self.aborted = 0, False, False

        def get_write_buffer_size(self):
            return self.buffered

        def close(self):
            self.closed = True

        def abort(self):
            self.aborted = True

    class Protocol:  # the part of uvicorn's protocols the wrapper relies on
        client = ("127.0.0.1", 1)

        def __init__(self, loop):
            self.loop = loop

        def connection_made(self, transport):
            self.transport = transport

        def connection_lost(self, exc):
            pass

        def pause_writing(self):
            pass

        def resume_writing(self):
            pass

    async def scenario():
        loop = asyncio.get_running_loop()
        cls = with_write_deadline(Protocol, 0.05, "--write-timeout")
        drained, unread = Transport(), Transport()
        unread.buffered = 1000
        for transport in (drained, unread):
            proto = cls(loop)
            proto.connection_made(transport)
            proto.transport.close()
            assert transport.closed
        deadline = loop.time() + 5
        while not unread.aborted:
            assert loop.time() < deadline, "a close with unsent bytes was never aborted"
            await asyncio.sleep(0.01)
        assert not drained.aborted  # nothing left to send: close() ends it at once
        lost = cls(loop)  # a connection already lost arms nothing
        lost.connection_made(Transport())
        lost.connection_lost(None)
        lost.pause_writing()
        assert lost._write_timer is None
    asyncio.run(scenario())
