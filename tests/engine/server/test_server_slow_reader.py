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
        "--served-model-name", "tiny", "--max-model-len", "4096", "--kv-cache-memory", "64Mi",
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
    # 4000 tokens with 20 logprobs each: megabytes, far past any socket buffer, and about
    # 10 s of generation, so an abort is told apart from the request simply ending.
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 4000, "ignore_eos": True,
                       "logprobs": 20, "stream": True}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.settimeout(10)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body))
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    start = time.monotonic()  # and read nothing more
    wait_for(lambda: _aborted(server) == before + 1, 8, what="the stalled client's request to be aborted")
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
