"""`kvpilot serve` end to end: the official openai client against a live server process,
each test twice: builtin:tiny on the CPU, and the same model shape on a simulated
accelerator (the real server, scheduler and metrics; a timing model for the forward
pass). One server per kind for the session (tests/server_harness.py); tests that change
its settings put them back."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import openai
import pytest

from server_harness import (
    SHARED_API_KEY, SHARED_MAX_MODEL_LEN, SHARED_MAX_NUM_SEQS, SHARED_MODEL, shared_server,
    envelope, wait_for, write_tuning,
)

API_KEY = SHARED_API_KEY
MODEL = SHARED_MODEL
MAX_MODEL_LEN = SHARED_MAX_MODEL_LEN
MAX_NUM_SEQS = SHARED_MAX_NUM_SEQS

METRIC_NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
    "kvpilot:max_num_seqs", "kvpilot:max_model_len",
]


@pytest.fixture(scope="module", params=["real", "simulated"])
def server(request):
    return shared_server(request.param)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    from kvpilot.engine.loader.source import resolve_model
    from kvpilot.engine.core.tokenizer import Tokenizer

    return Tokenizer.from_dir(resolve_model("builtin:tiny"))


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


# --- the happy paths ----------------------------------------------------------------------

def test_tuning_file_applied_at_start_and_basic_routes(server, client):
    m = server.metrics()
    assert m[f"kvpilot:max_num_seqs{{model_name={MODEL}}}"] == MAX_NUM_SEQS
    assert m[f"kvpilot:max_model_len{{model_name={MODEL}}}"] == MAX_MODEL_LEN
    models = client.models.list().data
    assert [x.id for x in models] == [MODEL]
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_usage_matches_tokenizer(server, client, tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  logprobs=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 12 == len(r.choices[0].logprobs.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.choices[0].finish_reason == "length"
    tok = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, headers=_auth()).json()
    assert tok["count"] == r.usage.prompt_tokens
    # token ids as the prompt; echo puts the prompt text in front
    ids = tokenizer.encode(prompt)
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                   echo=True, extra_body={"ignore_eos": True})
    assert r2.usage.prompt_tokens == len(ids)
    assert r2.choices[0].text.endswith(r.choices[0].text)
    assert r2.choices[0].text.startswith(tokenizer.decode(ids))


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_and_non_stream(client, tokenizer):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                       temperature=0, extra_body={"ignore_eos": True})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert r.usage.completion_tokens == 10
    assert r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_n_logprobs_and_seed(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, n=3, temperature=1.0,
                                  seed=7, logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert all(x <= 0.0 for x in lp.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    again = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, n=3,
                                      temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True,
        top_logprobs=3, seed=1, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next((base[i:i + 2] for i in range(4, len(base) - 2) if base[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"greedy text has no usable stop string: {base!r}")
    r = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=24, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert c.text == base[: base.index(stop)]
    assert stop not in c.text


def test_request_id_header(server):
    r = httpx.post(server.url + "/v1/completions", headers={**_auth(), "X-Request-Id": "trace-1"},
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-1"
    assert r.json()["id"].endswith("trace-1")
    r = httpx.post(server.url + "/v1/completions", headers=_auth(),
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.headers.get("x-request-id")



def _timing(header: str) -> dict[str, float]:
    from kvpilot.engine.server.server_timing import parse_server_timing
    return {k: 1000 * v for k, v in parse_server_timing(header).items()}  # ms, as sent


def test_server_timing_header_on_non_streaming_responses(server):
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 6, "ignore_eos": True}
    start = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", headers=_auth(), json=body, timeout=60)
    wall_ms = 1000 * (time.perf_counter() - start)
    assert r.status_code == 200
    t = _timing(r.headers["server-timing"])
    assert set(t) == {"queue", "ttft", "tpot", "e2e"}
    assert 0 <= t["queue"] <= t["ttft"] <= t["e2e"] <= wall_ms
    # five gaps between six tokens: the mean gap times five spans first to last token
    assert t["ttft"] + 5 * t["tpot"] == pytest.approx(t["e2e"], abs=0.01)
    chat = httpx.post(server.url + "/v1/chat/completions", headers=_auth(), timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert set(_timing(chat.headers["server-timing"])) == {"queue", "ttft", "e2e"}  # one token: no TPOT
    two = httpx.post(server.url + "/v1/completions", headers=_auth(), timeout=60, json={**body, "n": 2})
    assert "tpot" not in _timing(two.headers["server-timing"])  # a mean over two streams is no one's TPOT

# --- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("body,param", [
    (b'{"model": "tiny", "prompt": ', None),                      # malformed JSON
    (b'[1, 2]', None),                                           # not an object
    (b'{"model": "tiny", "prompt": 5}', "prompt"),                # wrong type
    (b'{"model": "tiny", "prompt": "a", "max_tokens": "9"}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "a", "temperature": -1}', "temperature"),
    (b'{"model": "tiny", "prompt": "a", "top_p": 2}', "top_p"),
    (b'{"model": "tiny", "prompt": "a", "n": 0}', "n"),
    (b'{"model": "tiny", "prompt": "a", "logprobs": 99}', "logprobs"),
    (b'{"model": "tiny", "prompt": ""}', "prompt"),
    (b'{"model": "tiny", "prompt": []}', "prompt"),
    (b'{"model": "tiny"}', "prompt"),
    (b'{"model": "tiny", "prompt": [99999]}', "prompt"),
    (b'{"model": "tiny", "prompt": "a", "service_tier": "cheap"}', "service_tier"),
])
def test_bad_input_is_400_in_theenvelope(server, body, param):
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={**_auth(), "Content-Type": "application/json"}, timeout=30)
    err = envelope(r, 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_chat_bad_input(server):
    for body in ({"model": MODEL, "messages": []},
                 {"model": MODEL, "messages": [{"role": "user", "content": 3}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}):
        envelope(httpx.post(server.url + "/v1/chat/completions", json=body, headers=_auth()), 400)


def test_length_errors_name_both_numbers(server, client):
    refusals = f"kvpilot:request_length_refusals_total{{model_name={MODEL}}}"
    before = server.metrics()[refusals]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[20] * 2100, max_tokens=16)
    assert "2100" in e.value.message and str(MAX_MODEL_LEN) in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[20] * 2000, max_tokens=100)
    assert "2000" in e.value.message and "100" in e.value.message and str(MAX_MODEL_LEN) in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=5000)
    # The autotuner reads these refusals as the signal to raise max_model_len again.
    assert server.metrics()[refusals] == before + 3


def test_capacity_gauges_report_the_kv_sizing(server):
    m = server.metrics()
    simulated = [k for k in m if k.startswith("kvpilot:simulated_info{")]
    assert len(simulated) == (server.url == shared_server("simulated").url)
    # builtin:tiny in float32: 4 KiB per token; the server was given 64 MiB of KV cache.
    assert m[f"kvpilot:kv_cache_bytes_per_token{{model_name={MODEL}}}"] == 4096
    assert m[f"kvpilot:kv_cache_bytes{{model_name={MODEL}}}"] == 64 * 2**20
    assert m[f"kvpilot:model_weight_bytes{{model_name={MODEL}}}"] > 0
    assert m[f"kvpilot:kv_cache_element_bytes{{model_name={MODEL}}}"] == 4  # float32; fp8 would be 1
    assert any(k.startswith("vllm:cache_config_info{") and "cache_dtype=auto" in k for k in m)


def test_unknown_model_auth_and_routes(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    envelope(httpx.get(server.url + "/v1/models"), 401)
    assert httpx.get(server.url + "/health").status_code == 200  # open without a key
    assert httpx.get(server.url + "/metrics").status_code == 200
    envelope(httpx.get(server.url + "/no/such/route"), 404)


# --- metrics ------------------------------------------------------------------------------

def test_metrics_parse_and_carry_every_name(server):
    text = httpx.get(server.url + "/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    for name in METRIC_NAMES:
        hist = name + "_bucket"
        assert name in samples or hist in samples, name
        sample = samples.get(name) or samples[hist]
        assert sample.labels["model_name"] == MODEL
    reasons = {s.labels["finished_reason"] for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "vllm:request_success_total"}
    assert {"stop", "length", "abort"} <= reasons
    m = server.metrics()
    assert m["vllm:generation_tokens_total"] > 0 and m["vllm:e2e_request_latency_seconds_count"] > 0
    assert 0.0 <= m["vllm:kv_cache_usage_perc"] <= 1.0


def test_service_tier_is_echoed_and_labels_the_tpot_histogram(server):
    flex = f"kvpilot:request_time_per_output_token_seconds_count{{model_name={MODEL},service_tier=flex}}"
    default = f"kvpilot:request_time_per_output_token_seconds_count{{model_name={MODEL},service_tier=default}}"
    before = server.metrics()
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", headers=_auth(), timeout=60, json={**body, "service_tier": "flex"})
    assert r.status_code == 200 and r.json()["service_tier"] == "flex"
    chat = httpx.post(server.url + "/v1/chat/completions", headers=_auth(), timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True,
        "service_tier": "auto"})
    assert chat.status_code == 200 and chat.json()["service_tier"] == "default"  # auto is served as default
    plain = httpx.post(server.url + "/v1/completions", headers=_auth(), timeout=60, json=body)
    assert "service_tier" not in plain.json()  # vLLM's response shape unless a tier was asked for
    after = server.metrics()
    assert after[flex] == before[flex] + 1
    assert after[default] == before[default] + 2
    # The vLLM histogram still counts every request.
    vllm = "vllm:request_time_per_output_token_seconds_count"
    assert after[vllm] == before[vllm] + 3


def _ttft(server, prompt_ids: list[int]) -> float:
    start = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", headers=_auth(), timeout=60, json={
        "model": MODEL, "prompt": prompt_ids, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


def test_prefix_caching_through_the_server(server):
    rng = random.Random(0)
    prefix = [rng.randrange(16, 4096) for _ in range(1000)]
    before = server.metrics()["vllm:prefix_cache_hits_total"]
    miss = _ttft(server, prefix + [rng.randrange(16, 4096) for _ in range(16)])
    after_miss = server.metrics()["vllm:prefix_cache_hits_total"]
    hit = _ttft(server, prefix + [rng.randrange(16, 4096) for _ in range(16)])
    after_hit = server.metrics()["vllm:prefix_cache_hits_total"]
    print(f"\nprefix caching, 1,000-token shared prefix: TTFT miss {miss * 1000:.1f} ms, "
          f"hit {hit * 1000:.1f} ms")
    assert after_miss - before < 100
    assert after_hit - after_miss >= 900  # 62 full blocks of 16 tokens


# --- cancellation storm -------------------------------------------------------------------

async def _storm(server, n_stream: int, n_plain: int) -> None:
    # Each request asks for nearly the whole context, so none can finish before its client
    # leaves, however fast the host: the clients leave on an order of events, not a timeout.
    body = {"model": MODEL, "prompt": "Tell me a long story",
            "max_tokens": MAX_MODEL_LEN - 64, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, headers=_auth(), timeout=60) as http:
        async def stream_then_cancel():
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        return  # leave mid-stream: the connection closes

        plain = [asyncio.create_task(http.post("/v1/completions", json=body))
                 for _ in range(n_plain)]
        await asyncio.gather(*[stream_then_cancel() for _ in range(n_stream)])

        def only_plain_left():
            m = server.metrics()
            return m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == n_plain
        # The streams' aborts have gone through and every non-streaming request is in the engine.
        await asyncio.to_thread(wait_for, only_plain_left, 30,
                                what=f"only the {n_plain} non-streaming requests in the engine")
        assert not any(t.done() for t in plain), "a non-streaming request finished before its cancel"
        for t in plain:
            t.cancel()  # the client leaves: httpx closes the connection
        await asyncio.gather(*plain, return_exceptions=True)


def test_cancellation_storm_frees_everything(server, client):
    idle_kv = server.metrics()["vllm:kv_cache_usage_perc"]
    aborted = f"vllm:request_success_total{{engine=0,finished_reason=abort,model_name={MODEL}}}"
    aborts = server.metrics()[aborted]
    asyncio.run(_storm(server, n_stream=16, n_plain=4))

    def idle():
        m = server.metrics()
        return m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0 \
            and m["vllm:kv_cache_usage_perc"] == idle_kv and m
    m = wait_for(idle, 20, what="running 0 and KV usage back to idle")
    assert m[aborted] >= aborts + 20
    start = time.monotonic()
    r = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=4)
    assert r.choices[0].text is not None and time.monotonic() - start < 10


# --- live tuning --------------------------------------------------------------------------

def test_live_tuning_caps_running_without_failures(server):
    failures: list[str] = []
    done = threading.Event()

    def worker():
        with httpx.Client(base_url=server.url, headers=_auth(), timeout=120) as http:
            while not done.is_set():
                r = http.post("/v1/completions", json={
                    "model": MODEL, "prompt": "Load", "max_tokens": 24, "ignore_eos": True})
                if r.status_code != 200:
                    failures.append(r.text)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(10)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: server.metrics()["vllm:num_requests_running"] > 2, 30, what="load above 2")
        write_tuning(server.tuning_file, max_num_seqs=2, max_model_len=MAX_MODEL_LEN)

        def capped():
            m = server.metrics()
            return m["kvpilot:max_num_seqs"] == 2 and m["vllm:num_requests_running"] <= 2
        wait_for(capped, 10, what="running capped at 2")
        samples = []
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            samples.append(server.metrics()["vllm:num_requests_running"])
        assert max(samples) <= 2 and server.metrics()["vllm:num_requests_waiting"] > 0
        # an invalid file is rejected; the values in effect stay
        server.tuning_file.write_text('{"max_num_seqs": -3}')
        write_tuning(server.tuning_file.with_name("other.json"))  # unrelated file: ignored
        wait_for(lambda: "rejected" in server.log_tail(200), 10, what="rejection logged")
        assert server.metrics()["kvpilot:max_num_seqs"] == 2
    finally:
        write_tuning(server.tuning_file, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)
        done.set()
        for t in threads:
            t.join(120)
    assert not failures, failures[:3]
    wait_for(lambda: server.metrics()["kvpilot:max_num_seqs"] == MAX_NUM_SEQS, 10, what="restored")
