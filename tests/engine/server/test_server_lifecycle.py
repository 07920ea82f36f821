"""`kvpilot serve` admission and shutdown: a full waiting queue answers 429, SIGTERM drains
(503 for new work, in-flight requests finish) and the process exits 0. The API key comes
from KVPILOT_API_KEY here."""

from __future__ import annotations

import signal
import threading

import httpx
import openai
import pytest

from server_harness import ServerProcess, simulated_args, wait_for

KEY = "env-key"


@pytest.fixture(params=["real", "simulated"])
def server(request, tmp_path):
    model = simulated_args(tmp_path) if request.param == "simulated" else ["--model", "builtin:tiny"]
    proc = ServerProcess([
        *model, "--served-model-name", "tiny", "--max-num-seqs", "1",
        "--max-model-len", "512", "--kv-cache-memory", "16Mi", "--max-queued-requests", "1",
        "--drain-timeout", "60",
    ], tmp_path / "server.log", env={"KVPILOT_API_KEY": KEY})
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop(signal.SIGKILL)


def test_queue_full_429_then_sigterm_drains_and_exits_0(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert httpx.get(server.url + "/v1/models").status_code == 401  # the env key is in force
    results: dict[str, object] = {}

    def long_request(name: str) -> None:
        try:
            results[name] = client.completions.create(
                model="tiny", prompt="Drain me", max_tokens=120, extra_body={"ignore_eos": True})
        except Exception as exc:  # recorded and asserted on below
            results[name] = exc

    a = threading.Thread(target=long_request, args=("a",))
    a.start()
    wait_for(lambda: server.metrics()["vllm:num_requests_running"] == 1, 30, what="a running")
    b = threading.Thread(target=long_request, args=("b",))
    b.start()
    wait_for(lambda: server.metrics()["vllm:num_requests_waiting"] == 1, 30, what="b waiting")
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="tiny", prompt="one too many", max_tokens=2)
    assert e.value.body["type"] and "queue" in e.value.message
    assert e.value.response.headers["retry-after"] == "1"

    server.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(server.url + "/health").status_code == 503, 10, what="health 503")
    assert httpx.get(server.url + "/health").headers["retry-after"] == "1"
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny", prompt="too late", max_tokens=2)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    a.join(120)
    b.join(120)
    for name in ("a", "b"):
        r = results[name]
        assert not isinstance(r, Exception), r
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 120
    assert server.proc.wait(60) == 0, server.log_tail()
    assert "drained" in server.log_tail(100)
