"""Issue 40's hostile battery: several hundred systematically generated cases against a
real `kvpilot serve` (simulated accelerator) and the gateway in front of it and of bad
engines (wedged, dead, silent mid-stream, dying mid-stream). Asserted over all of them:
no answer >= 500 except the gateway's 502/503/504 for a dead or timed-out upstream, no
hang past the configured timeouts, no slot or gauge left taken, /metrics bounded, a
token-limited tenant never past its limit plus one request's max_tokens. It prints its
counts. Timeouts are small through the settings; nothing sleeps for a result."""
from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
from collections import Counter

import httpx
import pytest

from kvpilot.operator.gateway.tenants import Tenants

from gateway_fakes import FakeEngine
from server_harness import ServerProcess
from test_gateway_proxy import gateway

ENGINE_KEY, TENANT_KEY, LIMITED_KEY, METRICS_KEY = "e" * 32, "t" * 32, "l" * 32, "m" * 32
READ_S = 0.5  # header and body read timeouts, engine and gateway
QUEUE_CAP = 6
HANG_S = 8.0  # no answer this long after the last byte sent is a hang
FAST_GPU = {"name": "battery-gpu", "memory_bytes": 8 * 2**30, "bandwidth": 1e12, "flops": 1e14,
            "step_overhead_s": 0.002, "per_seq_overhead_s": 0.0, "reserved_bytes": 0, "source": "issue 40 battery"}
GATEWAY = dict(first_byte_timeout=1.0, response_timeout=3.0, stream_idle_timeout=1.5, header_read_timeout=READ_S,
               body_read_timeout=READ_S, eject_seconds=0.5, eject_max_seconds=1.0, max_body_bytes=1 << 20,
               queue_timeout=3.0, max_header_bytes=16384, max_headers=64)
BAD_UPSTREAMS = {"wedged", "dead", "silent", "dying"}


class Tally:
    def __init__(self) -> None:
        self.codes: Counter = Counter()
        self.bad: list[str] = []
        self.cases = 0

    def record(self, where: str, case: str, status: int | None, upstream_bad: bool = False,
               message: str = "") -> None:
        self.cases += 1
        self.codes[f"{where}:{status if status is not None else 'closed'}"] += 1
        if status == "hang":
            self.bad.append(f"{where} {case}: hang")
        elif isinstance(status, int) and status >= 500 and not (upstream_bad and status in (502, 503, 504)):
            self.bad.append(f"{where} {case}: {status} {message[:300]}".rstrip())


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("battery")
    (tmp / "gpu.json").write_text(json.dumps(FAST_GPU))
    proc = ServerProcess([
        "--simulate", str(tmp / "gpu.json"), "--simulate-model", "builtin:tiny", "--dtype", "float32",
        "--served-model-name", "tiny", "--max-model-len", "512", "--kv-cache-memory", "16Mi",
        "--max-num-seqs", "4", "--api-key", ENGINE_KEY, "--max-queued-requests", str(QUEUE_CAP),
        "--max-request-body-bytes", "1Mi", "--header-read-timeout", str(READ_S),
        "--body-read-timeout", str(READ_S)], tmp / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def tenants(tmp_path) -> Tenants:
    (tmp_path / "t").write_text(TENANT_KEY)
    (tmp_path / "l").write_text(LIMITED_KEY)
    (tmp_path / "tenants.yaml").write_text(f"""
window: 600
tenants:
  - name: team
    apiKeyFiles: [{tmp_path}/t]
  - name: limited
    apiKeyFiles: [{tmp_path}/l]
    tokensPerWindow: 60
""")
    return Tenants.load(tmp_path / "tenants.yaml")


# ---- the cases ---------------------------------------------------------------------------

FIELD_VALUES = [None, -1, 0, 1, 2**63, -2**70, 1e308, "x", "", "\ud800", [], [1, "a"], {}, {"a": 1}, True,
                "a" * 5000]
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "logprobs", "stream",
          "stream_options", "presence_penalty", "frequency_penalty", "logit_bias", "user", "echo"]
CHAT_FIELDS = ["messages", "max_completion_tokens", "tools", "response_format", "stream_options", "n"]
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "BREW", "X" * 4096]
PATHS = ["/", "/health", "/metrics", "/version", "/v1/models", "/v1/completions", "/v1/chat/completions",
         "/tokenize", "/v1/../../etc/passwd", "/%00%ff", "/" + "p" * 4000]
RAW = [  # (name, bytes): framing, headers and bodies no client library would send
    ("cl+te", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"4\r\n{}{}\r\n0\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("te-then-cl", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n"
                   b"\r\n0\r\n\r\n"),
    ("two-cl", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}"),
    ("bad-cl", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n"),
    ("huge-cl", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999\r\n\r\n"),
    ("bad-chunk", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
    ("te-gzip", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"),
    ("big-header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 200_000 + b"\r\n\r\n"),
    ("many-headers", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(3000))
     + b"\r\n"),
    ("http10", b"GET /health HTTP/1.0\r\n\r\n"),
    ("absolute-uri", b"GET http://evil/health HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("no-host", b"GET /health HTTP/1.1\r\n\r\n"),
    ("nul-header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n"),
    ("tls-hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64),
    ("garbage", bytes(range(256))),
    ("lf-only", b"GET /health HTTP/1.1\nHost: x\n\n"),
    ("space-name", b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: 1\r\n\r\n"),
    ("expect", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}"),
]
BODIES = [b"", b"{", b"[]", b"null", b"1", b'"s"', b"\xef\xbb\xbf{}", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000,
          b'{"prompt": NaN}', b'{"prompt": Infinity}', b'{"prompt": 1e999999}', b'{"a":' * 5000 + b"1" + b"}" * 5000,
          b'{"prompt": "\\ud800", "model": "tiny"}', b'{"prompt": "x", "prompt": 1}', b"x" * (2 << 20)]
SLOW = ["header-trickle", "body-trickle", "silent", "half-request-close", "body-then-close"]


async def raw_exchange(port: int, data: bytes, pause_then: bytes | None = None, close_early=False) -> int | str | None:
    """Status of the first response, None if closed without one, "hang" past HANG_S."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return None
    try:
        writer.write(data)
        if close_early:
            return None
        if pause_then is not None:
            await asyncio.sleep(0)  # the server sees the first part on its own
            writer.write(pause_then)
        head = b""
        async with asyncio.timeout(HANG_S):
            while b"\r\n" not in head:
                chunk = await reader.read(4096)
                if not chunk:
                    break
                head += chunk
        match = re.match(rb"HTTP/1\.[01] (\d{3})", head)
        return int(match.group(1)) if match else None
    except TimeoutError:
        return "hang"
    except (ConnectionResetError, BrokenPipeError):
        return None
    finally:
        writer.close()


def field_cases(chat: bool) -> list[tuple[str, dict]]:
    base = ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}
            if chat else {"model": "tiny", "prompt": "hello", "max_tokens": 2})
    fields = CHAT_FIELDS if chat else FIELDS
    return [(f"{f}={str(v)[:12]!r}", {**base, f: v}) for f in fields for v in FIELD_VALUES]


async def http_case(client: httpx.AsyncClient, method: str, path: str, tally: Tally, where: str, headers=None,
                    upstream_bad=False, **kwargs) -> None:
    try:
        r = await client.request(method, path, headers=headers, timeout=HANG_S, **kwargs)
        status, message = r.status_code, r.text
        if status >= 400 and r.request.method != "HEAD" and "json" in r.headers.get("content-type", ""):
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    except httpx.TimeoutException:
        status, message = "hang", ""
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        status, message = None, ""
    tally.record(where, f"{method[:10]} {path[:40]}", status, upstream_bad, message)


async def bounded(coros, limit: int = 8) -> None:
    gate = asyncio.Semaphore(limit)

    async def one(c):
        async with gate:
            await c
    await asyncio.gather(*(one(c) for c in coros))


def gauge(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_hostile_battery(engine, tmp_path):
    asyncio.run(battery(engine, tmp_path))


async def battery(engine, tmp_path) -> None:
    tally = Tally()
    rng = random.Random(40)
    auth = {"Authorization": f"Bearer {ENGINE_KEY}"}
    wedged, silent, dying = FakeEngine("w", "wedged"), FakeEngine("s", "hold"), FakeEngine("d", "die_mid_stream")
    good = FakeEngine("g", chunks=50)
    fakes = [wedged, silent, dying, good, FakeEngine("a-wedged", "wedged")]
    backends = {"tiny": [engine.url], "wedged": [wedged], "dead": ["http://127.0.0.1:1"], "silent": [silent],
                "dying": [dying], "mixed": [fakes[-1], good], "fast": [good]}
    engine_metrics_before = len(httpx.get(engine.url + "/metrics").content)
    async with gateway(backends, tenants(tmp_path), keys={"engine_key": ENGINE_KEY, "metrics_key": METRICS_KEY},
                       **GATEWAY) as (gw, app, table), \
            httpx.AsyncClient(base_url=engine.url) as eng:
        tenant = {"Authorization": f"Bearer {TENANT_KEY}"}
        targets = [("engine", eng, auth), ("gateway", gw, tenant)]
        # 1. every field x value, completions and chat, on both
        for where, client, hdr in targets:
            await bounded([http_case(client, "POST", "/v1/chat/completions" if chat else "/v1/completions", tally,
                                     where, {**hdr, "content-type": "application/json"},
                                     content=json.dumps(body).encode())  # \ud800 escaped, as JSON allows
                           for chat in (False, True) for _, body in field_cases(chat)])
        # 2. methods x paths, with and without a key
        for (where, client, hdr), method, path in itertools.product(targets, METHODS, PATHS):
            await http_case(client, method, path, tally, where, hdr if rng.random() < 0.5 else None)
        # 3. raw framing and header abuse, and bodies, on both
        for where, client, _ in targets:
            port = client.base_url.port
            for name, data in RAW:
                tally.record(where, name, await raw_exchange(port, data))
            for body in BODIES:
                await http_case(client, "POST", "/v1/completions", tally, where, {**hdr_for(where), "content-type":
                                "application/json"}, content=body)
            # 4. slow and departing clients, all at once
            post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            slow = [raw_exchange(port, post + b"X-Slow: "),
                    raw_exchange(port, post + b"Content-Length: 50\r\n\r\n{\"mod"),
                    raw_exchange(port, b""),
                    raw_exchange(port, post, close_early=True),
                    raw_exchange(port, post + b"Content-Length: 50\r\n\r\n{", close_early=True)]
            for name, status in zip(SLOW, await asyncio.gather(*slow)):
                tally.record(where, name, status)
        # 5. surrogates in every text field, on both
        for where, client, hdr in targets:
            for body in surrogate_bodies():
                await http_case(client, "POST", "/v1/completions" if b"prompt" in body else "/v1/chat/completions",
                                tally, where, {**hdr, "content-type": "application/json"}, content=body)
        # 6. bad upstreams: wedged, dead, silent, dying; a wedged replica beside a good one
        await bounded([http_case(gw, "POST", "/v1/completions", tally, "gateway", tenant, upstream_bad=model in
                                 BAD_UPSTREAMS, json={"model": model, "prompt": f"p{i}", "max_tokens": 2,
                                                      "stream": stream})
                       for i, model in enumerate(("wedged", "dead", "silent", "dying", "mixed") * 4)
                       for stream in (False, True)], limit=40)
        # 7. the client leaving in each phase at the gateway: queued, awaiting the first byte, mid-stream
        await departures(gw, tenant, tally)
        # 8. the waiting gauge under a storm at the engine never passes its cap
        await queue_storm(eng, auth, engine, tally)
        # 9. token limits under concurrency and disconnects
        await token_storm(gw, tally)
        # leaks: every slot and gauge back to zero
        for fake in fakes:
            fake.release.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while loop.time() < deadline and any(b.queue.in_flight or b.queue.waiting for b in table.backends.values()):
            await asyncio.sleep(0.05)
        leaks = {m: (b.queue.in_flight, b.queue.waiting, [r.in_flight for r in b.replicas.values()])
                 for m, b in table.backends.items()}
        assert all(v == (0, 0, [0] * len(v[2])) for v in leaks.values()), leaks
        gmetrics = (await gw.get("/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"})).text
        assert gauge(gmetrics, "kvpilot_gateway_queue_waiting") == 0
        assert gauge(gmetrics, "kvpilot_gateway_held_requests") == 0
        assert len(gmetrics) < 64 << 10, len(gmetrics)
    text = ""
    for _ in range(100):
        text = httpx.get(engine.url + "/metrics").text
        if gauge(text, "vllm:num_requests_running") == 0 and gauge(text, "vllm:num_requests_waiting") == 0:
            break
        await asyncio.sleep(0.05)
    assert gauge(text, "vllm:num_requests_running") == 0 and gauge(text, "vllm:num_requests_waiting") == 0
    methods = set(re.findall(r'method="([^"]*)"', text))
    assert methods <= {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "OTHER"}, methods
    assert len(text) < engine_metrics_before + (256 << 10), (engine_metrics_before, len(text))
    print(f"\nhostile battery: {tally.cases} cases; answers by target:status: "
          f"{dict(sorted(tally.codes.items()))}; engine /metrics {engine_metrics_before} -> {len(text)} bytes; "
          f"failures: {len(tally.bad)}")
    assert not tally.bad, tally.bad[:20]
    assert tally.cases >= 400


def hdr_for(where: str) -> dict:
    return {"Authorization": f"Bearer {ENGINE_KEY if where == 'engine' else TENANT_KEY}"}


def surrogate_bodies() -> list[bytes]:
    lone = ["\\ud800", "\\udfff", "a\\udbff", "\\udc00\\ud800"]
    out = []
    for s in lone:
        out += [f'{{"model": "tiny", "prompt": "{s}", "max_tokens": 1}}'.encode(),
                f'{{"model": "tiny", "prompt": ["ok", "{s}"], "max_tokens": 1}}'.encode(),
                f'{{"model": "tiny", "prompt": "x", "stop": ["{s}"], "max_tokens": 1}}'.encode(),
                f'{{"model": "{s}", "prompt": "x"}}'.encode(),
                f'{{"model": "tiny", "messages": [{{"role": "user", "content": "{s}"}}]}}'.encode(),
                f'{{"model": "tiny", "messages": [{{"role": "user", "content": [{{"type": "text", "text": "{s}"}}]}}]}}'
                .encode()]
    return out


async def departures(gw: httpx.AsyncClient, tenant: dict, tally: Tally) -> None:
    """Clients that leave after 0.2 s: while awaiting a wedged replica's first byte, mid-
    stream on a silent one, and (the slots full) while queued."""
    port = gw.base_url.port

    async def leave(model: str, stream: bool) -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=0.2) as impatient:
            try:
                await impatient.post("/v1/completions", headers=tenant, json={
                    "model": model, "prompt": "x", "max_tokens": 2, "stream": stream})
                tally.record("gateway", f"leave {model}", 200, True)
            except httpx.TimeoutException:
                tally.record("gateway", f"leave {model}", None)
    await asyncio.gather(*(leave(m, s) for m in ("wedged", "silent", "mixed") for s in (False, True) for _ in range(3)))


async def queue_storm(eng: httpx.AsyncClient, auth: dict, engine, tally: Tally) -> None:
    peak = 0
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            text = (await eng.get("/metrics")).text
            peak = max(peak, gauge(text, "vllm:num_requests_waiting"))
            await asyncio.sleep(0.02)
    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(http_case(eng, "POST", "/v1/completions", tally, "engine", auth, json={
        "model": "tiny", "prompt": "storm " * 20, "max_tokens": 24, "ignore_eos": True}) for _ in range(40)))
    stop.set()
    await sampler
    assert peak <= QUEUE_CAP, peak


async def token_storm(gw: httpx.AsyncClient, tally: Tally) -> None:
    """The limited tenant (60 tokens) sends 24 concurrent 50-token streams, most cut at a
    random event: what it receives stays under 60 + 50."""
    limited = {"Authorization": f"Bearer {LIMITED_KEY}"}
    rng = random.Random(7)
    received = 0

    async def one(cut: int) -> None:
        nonlocal received
        async with gw.stream("POST", "/v1/completions", headers=limited, timeout=HANG_S, json={
                "model": "fast", "prompt": "x", "max_tokens": 50, "stream": True}) as r:
            events = 0
            if r.status_code == 200:
                async for line in r.aiter_lines():
                    events += line.startswith('data: {"choices": [{')
                    if events >= cut:
                        break
            received += events
            tally.record("gateway", "token-storm", r.status_code)
    await asyncio.gather(*(one(rng.choice([1, 10, 45, 50, 999])) for _ in range(24)))
    assert received <= 60 + 50, received

