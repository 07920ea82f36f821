"""`kvpilot serve` against hostile input: bodies too large or too slow, JSON that breaks the
decoder or the tokenizer, numbers past what a tensor holds, fields the server does not
implement, a flood of `n`; every refusal a 4xx in the OpenAI envelope naming the field.
And two properties checked in-process: tokenizing never blocks the event loop, and a
failure preparing one request fails that request alone."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from kvpilot.engine.core.sampling_params import (
    FLOAT32_TINY, INT32_MAX, INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE, MIN_REPETITION_PENALTY, SamplingParams,
)
from kvpilot.engine.server.protocol import MAX_N
from server_harness import ServerProcess, envelope, fail_preparing_requests, free_port, simulated_args, wait_for

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 1 << 20
READ_TIMEOUT_S = 1.0
MAX_QUEUED = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hardening")
    proc = ServerProcess([
        *simulated_args(tmp), "--served-model-name", "tiny", "--max-model-len", "512",
        "--kv-cache-memory", "16Mi", "--max-num-seqs", "1", "--api-key", KEY,
        "--max-queued-requests", str(MAX_QUEUED), "--max-request-body-bytes", "1Mi",
        "--header-read-timeout", str(READ_TIMEOUT_S), "--body-read-timeout", str(READ_TIMEOUT_S),
    ], tmp / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


# --- raw HTTP: limits that act before the app ------------------------------------------------

def _read_response(sock: socket.socket, deadline_s: float) -> bytes:
    """Everything the server sends until it closes the connection (or the deadline passes)."""
    sock.settimeout(0.2)
    data, end = b"", time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:  # closed with some of what was sent unread: a reset
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the server did not close the connection within {deadline_s} s: {data!r}")


def _status_and_json(response: bytes) -> tuple[int, dict, bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body), head.lower()


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def test_content_length_over_the_limit_is_413_before_the_body_is_read(server):
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                     + b"Content-Length: 100000000000\r\n\r\n")  # 100 GB announced, none sent
        status, body, head = _status_and_json(_read_response(sock, 10))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert str(BODY_LIMIT) in body["error"]["message"] and b"connection: close" in head


def test_chunked_body_is_counted_as_it_streams_and_cut_at_the_limit(server):
    """A chunked body (no Content-Length) one chunk past the limit, and never finished: the
    server answers 413 as the count passes the limit, not 408 when the body stalls."""
    chunk = b"x" * 65536
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(BODY_LIMIT // len(chunk) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, body, _ = _status_and_json(_read_response(sock, 10))
    assert status == 413 and body["error"]["param"] is None, body


def test_a_client_that_stalls_in_its_headers_is_dropped(server):
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        response = _read_response(sock, 10 * READ_TIMEOUT_S)
        waited = time.monotonic() - start
    status, body, _ = _status_and_json(response)
    assert status == 408 and "header" in body["error"]["message"]
    assert READ_TIMEOUT_S * 0.9 <= waited < 10 * READ_TIMEOUT_S


def test_a_silent_connection_is_dropped(server):
    with _connect(server) as sock:
        assert _read_response(sock, 10 * READ_TIMEOUT_S) == b""  # closed, nothing said


def test_a_client_that_stalls_in_its_body_gets_408(server):
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        status, body, head = _status_and_json(_read_response(sock, 10 * READ_TIMEOUT_S))
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert b"connection: close" in head


def test_bytes_that_are_not_http_get_400_in_theenvelope(server):
    with _connect(server) as sock:
        sock.sendall(b"\x16\x03\x01 this is not HTTP\r\n\r\n")  # a TLS hello, say
        status, body, head = _status_and_json(_read_response(sock, 10))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert b"application/json" in head


def test_two_framings_get_400_and_the_connection_closes_before_a_second_request(server):
    """Content-Length and Transfer-Encoding both, then a second request in the same write:
    one answer (400 in the envelope), and the connection closes (RFC 9112 6.3), with the
    API key or without it."""
    body = b'{"prompt": "hi", "max_tokens": 1}'
    for auth in (b"Authorization: Bearer " + KEY.encode() + b"\r\n", b""):
        with _connect(server) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: %d\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), len(body), body)
                         + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            response = _read_response(sock, 10)
        assert response.count(b"HTTP/1.1 ") == 1, response
        status, payload, head = _status_and_json(response)
        assert status == 400 and "Transfer-Encoding" in payload["error"]["message"]
        assert b"connection: close" in head


def test_head_answers_on_every_get_route(server):
    for path in ("/health", "/version", "/metrics", "/openapi.json"):
        r = httpx.head(server.url + path, timeout=10)
        assert r.status_code == 200 and r.content == b"", path
    r = httpx.head(server.url + "/v1/models", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.content == b""
    assert httpx.head(server.url + "/v1/models", timeout=10).status_code == 401  # still behind the key


def test_random_methods_and_paths_cannot_grow_metrics(server):
    """The HTTP metrics label by method and path: 100 requests with random 4 KB methods and
    paths leave /metrics as large as one such request does."""
    import random

    def metrics_size() -> int:
        return len(httpx.get(server.url + "/metrics", timeout=10).content)

    def send_random(i: int) -> None:
        rng = random.Random(i)
        method = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(4096)).encode()
        path = "/" + "".join(rng.choice("abcdefghij") for _ in range(4096))
        with _connect(server) as sock:
            sock.sendall(method + b" " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            sock.settimeout(10)
            while sock.recv(65536):
                pass

    send_random(0)
    before = metrics_size()
    for i in range(1, 101):
        send_random(i)
    after = metrics_size()
    assert after - before < 2048, (before, after)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'method="OTHER"' in text


def test_keep_alive_still_serves_several_requests_on_one_connection(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        for _ in range(3):
            assert client.post("/tokenize", json={"prompt": "hello"}).status_code == 200


# --- bodies that broke the layers below validation -------------------------------------------

LONG_INT = b"1" * 5000


@pytest.mark.parametrize("body,param,words", [
    (b"[" * 100000 + b"]" * 100000, None, "nested"),              # the decoder's recursion
    (b'{"prompt": "a", "extra": ' + b"[" * 40 + b"]" * 40 + b"}", "extra", "nested"),
    (b'{"prompt": "a", "max_tokens": ' + LONG_INT + b"}", "max_tokens", "integer"),  # digit limit
    (b'{"prompt": [' + LONG_INT + b"]}", "prompt", "prompt"),
    (b'{"prompt": "a", "seed": 123456789012345678901234567890}', "seed", "seed"),
    (b'{"prompt": "caf\xe9"}', None, "UTF-8"),                   # Latin-1, not UTF-8
    (b'{"prompt": "a\\ud800b"}', "prompt", "Unicode"),          # a lone surrogate
    (b'{"prompt": ["a\\udfff"]}', "prompt", "Unicode"),
    (b'{"prompt": "a", "stop": ["\\ud83d"]}', "stop", "Unicode"),
    (b'{"prompt": "a", "user": "\\udc00"}', "user", "Unicode"),
    (b'{"prompt": "a", "temperature": 1e400}', "temperature", "finite"),
    (b'{"prompt": "a", "temperature": NaN}', "temperature", "finite"),
    (b'{"prompt": "a", "top_p": -Infinity}', "top_p", "finite"),
])
def test_bodies_that_break_the_decoder_or_tokenizer_are_400(server, body, param, words):
    r = httpx.post(server.url + "/v1/completions", content=body, headers=AUTH, timeout=30)
    err = envelope(r, 400)
    assert err["param"] == param and words in err["message"], err


def test_chat_text_that_is_not_unicode_is_400_naming_messages(server):
    body = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'
    err = envelope(httpx.post(server.url + "/v1/chat/completions", content=body, headers=AUTH), 400)
    assert err["param"] == "messages" and "messages.0.content.0.text" in err["message"]


# --- numbers at the edge ---------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("temperature", MAX_TEMPERATURE * 2), ("temperature", 1e-45), ("temperature", 1e39),
    ("top_p", 1e-45), ("top_p", 1.5), ("top_p", 0), ("min_p", 1e-40), ("min_p", 2),
    ("presence_penalty", 3), ("frequency_penalty", -1e39), ("repetition_penalty", 0),
    ("repetition_penalty", MIN_REPETITION_PENALTY / 2), ("repetition_penalty", MAX_REPETITION_PENALTY * 2),
    ("top_k", INT32_MAX + 1), ("top_k", -2), ("seed", INT64_MAX + 1), ("seed", INT64_MIN - 1),
    ("max_tokens", INT32_MAX + 1), ("max_tokens", 0), ("min_tokens", -1), ("min_tokens", 2**40),
    ("n", MAX_N + 1), ("n", MAX_QUEUED + 1), ("logprobs", MAX_LOGPROBS + 1), ("best_of", 2**40),
    ("stop_token_ids", [2**40]), ("stop_token_ids", [-1]),
])
def test_numbers_past_their_tensor_or_their_sense_are_400_naming_the_field(server, field, value):
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"prompt": "a", "max_tokens": 2, field: value})
    err = envelope(r, 400)
    assert err["param"] == field, err


def test_sampling_params_refuse_float32_overflow_and_underflow_offline():
    for kwargs in ({"temperature": 1e-40}, {"top_p": 1e-39}, {"min_p": 5e-45},
                   {"presence_penalty": 1e-39}, {"repetition_penalty": 1e39}, {"seed": 2**63},
                   {"top_k": 2**31}, {"max_tokens": 2**31}, {"stop_token_ids": [2**31]}):
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    SamplingParams(temperature=FLOAT32_TINY, top_p=FLOAT32_TINY, seed=INT64_MIN)  # the edges hold


def test_the_extremes_the_edge_accepts_run_in_one_batch_without_failing_it():
    """Every bound at once in one step: the batch tensors take them all, every row samples."""
    from kvpilot.engine import LLM

    llm = LLM(model="builtin:tiny", kv_cache_memory="16Mi", max_model_len=256, max_num_seqs=64)
    vocab = llm.engine.tokenizer.vocab_size
    base = dict(max_tokens=4, ignore_eos=True)
    extremes = [
        dict(temperature=MAX_TEMPERATURE), dict(temperature=FLOAT32_TINY),
        dict(temperature=1.0, top_p=FLOAT32_TINY), dict(temperature=1.0, top_k=INT32_MAX),
        dict(temperature=1.0, top_k=1), dict(temperature=1.0, min_p=1.0),
        dict(temperature=1.0, min_p=FLOAT32_TINY),
        dict(presence_penalty=2.0, frequency_penalty=-2.0), dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(temperature=0.7, repetition_penalty=MIN_REPETITION_PENALTY),
        dict(temperature=0.7, repetition_penalty=MAX_REPETITION_PENALTY),
        dict(temperature=1.0, seed=INT64_MIN), dict(temperature=1.0, seed=INT64_MAX, n=MAX_N),
        dict(logprobs=MAX_LOGPROBS, temperature=MAX_TEMPERATURE),
        dict(min_tokens=4, stop_token_ids=[0, INT32_MAX]),
    ]
    params = [SamplingParams(**base, **e) for e in extremes]
    outs = llm.generate(["The quick brown fox"] * len(params), params, use_tqdm=False)
    for e, out in zip(extremes, outs):
        assert out.error is None, (e, out.error)
        assert len(out.outputs) == e.get("n", 1)
        for choice in out.outputs:
            assert len(choice.token_ids) == 4 and all(0 <= t < vocab for t in choice.token_ids), e
            if choice.logprobs is not None:
                assert all(lp.logprob == lp.logprob for lp in choice.logprobs), e  # no NaN


# --- fields the server does not implement, roles, stream_options -----------------------------

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"logit_bias": {"5": 10.0}}, "logit_bias"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "t"}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "t"}]}]}, "messages"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
])
def test_unsupported_fields_roles_and_stream_options_are_400_by_name(server, extra, param):
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=30, json={**CHAT, **extra})
    err = envelope(r, 400)
    assert err["param"] == param, err


def test_values_that_ask_for_nothing_are_accepted(server):
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        **CHAT, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
        "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "stream": True, "stream_options": {"include_usage": True}, "store": False, "metadata": {"a": "b"}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "hi", "max_tokens": 2, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text


# --- admission: n against the queue, Retry-After -----------------------------------------------

def test_n_that_would_fill_the_queue_is_429_with_retry_after(server):
    """max_num_seqs is 1: one long request runs, a request with n=MAX_QUEUED fills the waiting
    queue with its choices, and the next request finds it full."""
    stop = threading.Event()

    def stream(body):
        with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=120,
                          json={"prompt": "hold", "max_tokens": 400, "ignore_eos": True, "stream": True, **body}) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return  # closing the stream aborts the request

    threads = [threading.Thread(target=stream, args=({},))]
    threads[0].start()
    wait_for(lambda: server.metrics()["vllm:num_requests_running"] == 1, 30, what="one running")
    threads.append(threading.Thread(target=stream, args=({"n": MAX_QUEUED},)))
    threads[1].start()
    try:
        wait_for(lambda: server.metrics()["vllm:num_requests_waiting"] == MAX_QUEUED, 30, what="queue full")
        r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"prompt": "a", "max_tokens": 2})
        err = envelope(r, 429)
        assert err["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    wait_for(lambda: server.metrics()["vllm:num_requests_waiting"] == 0, 30, what="queue drained")


# --- tokenizer routes, size of prompts, schema -------------------------------------------------

def test_tokenize_and_detokenize_need_the_key(server):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5, 6]})):
        envelope(httpx.post(server.url + path, json=body), 401)
        assert httpx.post(server.url + path, json=body, headers=AUTH).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # still open
    assert httpx.get(server.url + "/openapi.json").status_code == 200


def test_a_prompt_too_long_to_fit_is_refused_without_tokenizing_it(server):
    """A body just under the limit, 900k characters: refused by its length in characters
    (the check that runs before the tokenizer), naming the prompt."""
    text = "hello " * 150_000
    for path, body in (("/v1/completions", {"prompt": text}), ("/tokenize", {"prompt": text}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
        err = envelope(httpx.post(server.url + path, json=body, headers=AUTH, timeout=30), 400)
        assert err["param"] in ("prompt", "messages") and "900000 characters" in err["message"], err
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_server_limits_are_validated_and_become_flags():
    import argparse

    from kvpilot.engine.config.flags import add_dataclass_flags, dataclass_from_args
    from kvpilot.engine.server.limits import ServerLimits

    assert ServerLimits().max_request_body_bytes == 8 * 2**20
    for kwargs, name in (({"max_request_body_bytes": "0"}, "max_request_body_bytes"),
                         ({"max_request_body_bytes": "lots"}, "max_request_body_bytes"),
                         ({"header_read_timeout": 0}, "header_read_timeout"),
                         ({"body_read_timeout": True}, "body_read_timeout")):
        with pytest.raises(ValueError, match=name):
            ServerLimits(**kwargs)
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, ServerLimits, "")
    args = parser.parse_args(["--max-request-body-bytes", "2Mi", "--body-read-timeout", "2.5"])
    limits = dataclass_from_args(ServerLimits, args, "")
    assert (limits.max_request_body_bytes, limits.body_read_timeout, limits.header_read_timeout) == (2 << 20, 2.5, 10.0)


def test_openapi_schema_carries_the_real_constraints(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    comp = schema["components"]["schemas"]["CompletionRequest"]
    assert comp["required"] == ["prompt"]
    assert comp["properties"]["n"]["maximum"] == MAX_N
    chat = schema["components"]["schemas"]["ChatMessage"]
    assert chat["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant"]
    op = schema["paths"]["/v1/completions"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    assert {"400", "413", "429"} <= set(op["responses"]) and "422" not in op["responses"]


# --- in-process: the event loop and failure isolation -------------------------------------------

class InProcessServer:
    """The real app and engine under uvicorn in a thread of this process, so a test can
    reach into the engine (monkeypatch a step) while clients talk HTTP to it."""

    def __init__(self, **engine_args) -> None:
        import uvicorn

        from kvpilot.engine.config.engine import EngineConfig
        from kvpilot.engine.llm_engine import LLMEngine
        from kvpilot.engine.server.app import build_app
        from kvpilot.engine.server.async_engine import AsyncEngine
        from kvpilot.engine.metrics.exporter import ServerMetrics
        from kvpilot.engine.server.runner import header_deadline_protocol
        from kvpilot.engine.server.serving_common import ServerSettings

        engine = LLMEngine(EngineConfig(**engine_args))
        self.app = build_app(AsyncEngine(engine, ServerMetrics("tiny", engine.max_model_len)),
                             ServerSettings(served_model_name="tiny", model_path="builtin:tiny"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_config=None, access_log=False,
            http=header_deadline_protocol(10.0)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        wait_for(lambda: self._healthy(), 60, what="in-process server up")
        return self

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def in_process():
    with InProcessServer(model="builtin:tiny", kv_cache_memory="16Mi", max_model_len=2048,
                         max_num_seqs=8) as srv:
        yield srv


def test_tokenizing_runs_off_the_event_loop(in_process, monkeypatch):
    """The tokenizer is held mid-encode (until the test lets it go): were it on the event
    loop, /health could not answer meanwhile."""
    from kvpilot.engine.core.tokenizer import Tokenizer

    entered, release = threading.Event(), threading.Event()
    real_encode = Tokenizer.encode

    def held_encode(self, text, add_special_tokens=True):
        if text.startswith("HOLD"):
            entered.set()
            release.wait(30)
        return real_encode(self, text, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encode", held_encode)
    result = {}
    prompt = "HOLD " + "a b c " * 400  # long enough to leave the loop (> INLINE_CHARS)
    worker = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        in_process.url + "/v1/completions", timeout=60, json={"prompt": prompt, "max_tokens": 2})))
    worker.start()
    try:
        assert entered.wait(30), "the request never reached the tokenizer"
        for _ in range(5):
            assert httpx.get(in_process.url + "/health", timeout=2).status_code == 200
    finally:
        release.set()
        worker.join(60)
    assert result["r"].status_code == 200, result["r"].text


def test_a_failure_preparing_one_request_fails_it_alone(in_process, monkeypatch):
    """Three streams are running when a fourth arrives whose preparation raises (its token
    slice, read while building the step's input tensors): the fourth gets an error in the
    envelope, streamed and not; the step goes on and the three finish every token."""
    fail_preparing_requests(monkeypatch, "poison")
    tokens: dict[int, int] = {}
    first_token = [threading.Event() for _ in range(3)]
    body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}

    def good(i: int) -> None:
        with httpx.stream("POST", in_process.url + "/v1/completions", json=streamed, timeout=120,
                          headers={"X-Request-Id": f"good-{i}"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        tokens[i] = chunk
                        return
                    first_token[i].set()
                    if not chunk["choices"]:  # the usage chunk, after the last token
                        tokens[i] = chunk["usage"]["completion_tokens"]

    threads = [threading.Thread(target=good, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for e in first_token:
        assert e.wait(60), "the good streams did not start"
    with httpx.stream("POST", in_process.url + "/v1/completions", json=streamed, timeout=60,
                      headers={"X-Request-Id": "poison-stream"}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][6:])["error"]
    assert err["type"] == "server_error" and "RuntimeError" in err["message"]
    plain = httpx.post(in_process.url + "/v1/completions", headers={"X-Request-Id": "poison-plain"},
                       json=body, timeout=60)
    assert envelope(plain, 500)["code"] == "internal_error"
    for t in threads:
        t.join(120)
    assert tokens == {0: 40, 1: 40, 2: 40}
    assert httpx.post(in_process.url + "/v1/completions", timeout=60, json={
        "prompt": "after", "max_tokens": 3}).status_code == 200  # the engine serves on
