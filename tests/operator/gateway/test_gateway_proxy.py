"""The gateway end to end on real sockets, with engine stand-ins: routing by model, the
error envelope for every refusal, tenants and limits, retries on a draining or unreachable
pod, no retry once a stream began, and a replica lost mid-stream."""
from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from kvpilot.operator.gateway.app import Gateway
from kvpilot.operator.gateway.config import GatewaySettings
from kvpilot.operator.gateway.edge import edge_protocol
from kvpilot.operator.gateway.forward import upstream_session
from kvpilot.operator.gateway.picker import Picker
from kvpilot.operator.gateway.table import BackendSnapshot, RoutingTable
from kvpilot.operator.gateway.tenants import Tenants

from gateway_fakes import FakeEngine, free_port, serving

KEY_A, KEY_B = "a" * 32, "b" * 32


@contextlib.asynccontextmanager
async def gateway(backends: dict[str, list], tenants: Tenants | None = None, keys: dict | None = None,
                  **settings):
    """A gateway in front of FakeEngines (or URLs that refuse connections), and a client;
    `keys`: the Gateway's engine_key / metrics_key."""
    engines = list({id(e): e for es in backends.values() for e in es if isinstance(e, FakeEngine)}.values())
    settings = GatewaySettings(**{"queue_timeout": 2.0, **settings})
    table = RoutingTable(lambda: Picker(settings.routing), settings.per_replica_concurrency)
    table.update([BackendSnapshot(model, "ns", model, tuple(
        (e.name, e.url) if isinstance(e, FakeEngine) else (f"dead-{i}", e) for i, e in enumerate(es)))
        for model, es in backends.items()])
    port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        for e in engines:
            await stack.enter_async_context(serving(e, e.port))
        upstream = await stack.enter_async_context(upstream_session(connect_timeout=2))
        app = Gateway(settings, table, tenants or Tenants.unrestricted(), upstream, **(keys or {}))
        await stack.enter_async_context(serving(app, port, edge_protocol(
            settings.header_read_timeout, settings.max_header_bytes, settings.max_headers, settings.write_timeout)))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                                                   timeout=30))
        yield client, app, table
        await asyncio.sleep(0.05)  # a response the gateway is finishing (its client just left)
        assert not upstream.connector._acquired, "a replica's response was never released"


def run(coro):
    return asyncio.run(coro)


def completion(model="m", **extra):
    return {"model": model, "prompt": "hello there", "max_tokens": 3, **extra}


def assert_envelope(resp, status, param=None, match=""):
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert match in error["message"]
    if param:
        assert error["param"] == param


def test_routes_by_model_and_refuses_bad_requests_with_the_envelope():
    async def main():
        e1, e2 = FakeEngine("one"), FakeEngine("two")
        async with gateway({"m1": [e1], "m2": [e2]}, max_body_bytes=4096) as (client, app, _):
            r = await client.post("/v1/completions", json=completion("m1"))
            assert r.status_code == 200 and r.json()["served_by"] == "one"
            assert r.headers["x-kvpilot-replica"] == "one"
            r = await client.post("/v1/chat/completions", json={"model": "m2", "messages": [
                {"role": "user", "content": "hi"}]})
            assert r.json()["served_by"] == "two"
            assert_envelope(await client.post("/v1/completions", json=completion("nope")), 404, "model", "nope")
            assert_envelope(await client.post("/v1/completions", json={"prompt": "x"}), 400, "model")
            assert_envelope(await client.post("/v1/completions", json={"model": 3}), 400, "model")
            assert_envelope(await client.post("/v1/completions", content=b"{not json"), 400, match="JSON")
            assert_envelope(await client.post("/v1/completions", content=b"[1]"), 400, match="object")
            assert_envelope(await client.post("/v1/completions", content=b"x" * 5000), 413, match="4096")
            assert_envelope(await client.get("/v1/completions"), 405)
            assert_envelope(await client.get("/nowhere"), 404)
            models = (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["m1", "m2"]
            assert (await client.get("/health")).status_code == 200
            metrics = (await client.get("/metrics")).text
            assert 'kvpilot_gateway_requests_total{code="200",model="m1",tenant="anonymous"} 1.0' in metrics
            assert 'kvpilot_gateway_routing_decisions_total{model="m1",reason="prefix"} 1.0' in metrics
            assert 'kvpilot_gateway_ready_replicas{model="m2"} 1.0' in metrics
            assert 'model="nope"' not in metrics  # a client's typo is no label
            assert [b["prompt"] for b in e1.bodies] == ["hello there"]
    run(main())


def tenants_for(tmp_path, extra_b="") -> Tenants:
    (tmp_path / "a").write_text(KEY_A)
    (tmp_path / "b").write_text(KEY_B)
    (tmp_path / "t.yaml").write_text(f"""
window: 60
tenants:
  - name: team-a
    apiKeyFiles: [{tmp_path}/a]
    models: [m1]
    requestsPerWindow: 2
  - name: team-b
    apiKeyFiles: [{tmp_path}/b]
    {extra_b}
""")
    return Tenants.load(tmp_path / "t.yaml")


def test_keys_tenant_models_and_request_limit(tmp_path):
    async def main():
        async with gateway({"m1": [FakeEngine("one")], "m2": [FakeEngine("two")]},
                           tenants_for(tmp_path), keys={"metrics_key": "m" * 32}) as (client, app, _):
            a = {"Authorization": f"Bearer {KEY_A}"}
            assert_envelope(await client.post("/v1/completions", json=completion("m1")), 401, match="API key")
            assert_envelope(await client.post("/v1/completions", json=completion("m1"),
                                              headers={"Authorization": "Bearer wrong"}), 401)
            assert_envelope(await client.get("/v1/models"), 401)
            assert [m["id"] for m in (await client.get("/v1/models", headers=a)).json()["data"]] == ["m1"]
            assert_envelope(await client.post("/v1/completions", json=completion("m2"), headers=a), 404, "model")
            assert (await client.post("/v1/completions", json=completion("m1"), headers=a)).status_code == 200
            assert (await client.post("/v1/completions", json=completion("m1"), headers=a)).status_code == 200
            r = await client.post("/v1/completions", json=completion("m1"), headers=a)
            assert_envelope(r, 429, match="team-a is over its requests limit (2 per 60 s)")
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert 55 <= int(r.headers["retry-after"]) <= 60
            b = {"Authorization": f"Bearer {KEY_B}"}  # another tenant is not limited by team-a's use
            assert (await client.post("/v1/completions", json=completion("m2"), headers=b)).status_code == 200
            metrics = (await client.get("/metrics", headers={"Authorization": "Bearer " + "m" * 32})).text
            assert 'kvpilot_gateway_rate_limited_total{limit="requests",tenant="team-a"} 1.0' in metrics
    run(main())


def test_token_limit_reads_usage_and_strips_the_usage_event_the_client_did_not_ask_for(tmp_path):
    async def main():
        engine = FakeEngine("one", chunks=5)
        async with gateway({"m1": [engine], "m2": [engine]},
                           tenants_for(tmp_path, "tokensPerWindow: 20"), metrics_access="open") as (client, app, _):
            b = {"Authorization": f"Bearer {KEY_B}"}
            r = await client.post("/v1/completions", json=completion("m2", stream=True), headers=b)
            events = [line for line in r.text.split("\n\n") if line]
            assert engine.bodies[-1]["stream_options"] == {"include_usage": True}
            assert not any('"usage": {' in e for e in events) and events[-1] == "data: [DONE]"
            r = await client.post("/v1/completions", json=completion("m2", stream=True, stream_options={
                "include_usage": True}), headers=b)
            assert any('"usage": {' in e for e in r.text.split("\n\n"))  # asked for: kept
            # 15 + 15 tokens used: over 20, so the next is refused until they leave the window.
            assert_envelope(await client.post("/v1/completions", json=completion("m2"), headers=b), 429,
                            match="tokens limit")
            metrics = (await client.get("/metrics")).text
            assert 'kvpilot_gateway_tokens_total{kind="completion",model="m2",tenant="team-b"} 10.0' in metrics
    run(main())


def test_retries_another_replica_on_refused_connection_and_on_503():
    async def main():
        good = FakeEngine("good")
        draining = FakeEngine("draining", mode="draining")
        dead_url = f"http://127.0.0.1:{free_port()}"
        async with gateway({"m": [dead_url, draining, good]}, routing="round-robin") as (client, app, _):
            served = [(await client.post("/v1/completions", json=completion())).json()["served_by"]
                      for _ in range(3)]
            assert served == ["good"] * 3
            metrics = (await client.get("/metrics")).text
            assert 'kvpilot_gateway_retries_total{cause="connect_error",model="m"}' in metrics
            assert 'kvpilot_gateway_retries_total{cause="unavailable",model="m"}' in metrics
        async with gateway({"m": [draining]}) as (client, app, _):
            r = await client.post("/v1/completions", json=completion())
            assert r.status_code == 503  # the last replica's own 503 reaches the client as it was
        async with gateway({"m": [dead_url]}) as (client, app, _):
            assert_envelope(await client.post("/v1/completions", json=completion()), 502, match="no replica")
    run(main())


def test_a_replica_lost_mid_stream_ends_that_stream_with_an_error_and_is_not_retried():
    async def main():
        dying = FakeEngine("dying", mode="die_mid_stream")
        healthy = FakeEngine("healthy", mode="hold", chunks=4)
        async with gateway({"m": [dying, healthy]}, routing="round-robin") as (client, app, table):
            async def stream(tag):
                async with client.stream("POST", "/v1/completions", json=completion(
                        stream=True, prompt=tag)) as r:
                    return r.headers["x-kvpilot-replica"], [c async for c in r.aiter_text()]
            other = asyncio.create_task(stream("second"))  # round-robin: first to dying, then healthy
            first = await stream("first")
            healthy.release.set()
            second = await other
            by_replica = dict([first, second])
            dying_text = "".join(by_replica["dying"])
            assert '"t0"' in dying_text and '"code": "upstream_failed"' in dying_text
            assert len(dying.bodies) == 1 and len(healthy.bodies) == 1  # no retry of the broken stream
            healthy_text = "".join(by_replica["healthy"])
            assert healthy_text.count("data: {") == 4 and healthy_text.endswith("data: [DONE]\n\n")
            assert all(r.in_flight == 0 for r in table.all_replicas())
            metrics = (await client.get("/metrics")).text
            assert 'kvpilot_gateway_requests_total{code="502",model="m",tenant="anonymous"} 1.0' in metrics
    run(main())


def test_streams_pass_through_as_they_are_produced():
    """The first event reaches the client while the engine still holds the rest back."""
    async def main():
        engine = FakeEngine("one", mode="hold", chunks=3)
        async with gateway({"m": [engine]}) as (client, app, table):
            async with client.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
                chunks = r.aiter_text()
                first = await asyncio.wait_for(chunks.__anext__(), 10)
                assert '"t0"' in first and not engine.release.is_set()
                engine.release.set()
                rest = "".join([c async for c in chunks])
            assert rest.endswith("data: [DONE]\n\n")
    run(main())


def test_client_leaving_closes_the_upstream_and_frees_the_slot():
    async def main():
        engine = FakeEngine("one", mode="hold", chunks=3)
        async with gateway({"m": [engine]}, per_replica_concurrency=1) as (client, app, table):
            async with client.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
                await r.aiter_text().__anext__()
            backend = table.get("m")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while backend.queue.in_flight or backend.replicas["one"].in_flight:
                assert loop.time() < deadline, "the slot was not freed after the client left"
                await asyncio.sleep(0.02)
            engine.release.set()
            assert (await client.post("/v1/completions", json=completion())).status_code == 200
    run(main())


def test_a_full_queue_times_out_with_503():
    async def main():
        engine = FakeEngine("one", mode="hold", chunks=2)
        async with gateway({"m": [engine]}, per_replica_concurrency=1, queue_timeout=0.5) as (client, app, _):
            async with client.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
                chunks = r.aiter_text()  # kept: a dropped iterator closes the stream
                await chunks.__anext__()  # the only slot is taken
                assert_envelope(await client.post("/v1/completions", json=completion()), 503,
                                match="every replica of `m` is busy")
                engine.release.set()
    run(main())


@pytest.mark.parametrize("field, value, message", [
    ("routing", "random", "--routing"), ("load_factor", 0.5, "--load-factor"), ("retries", -1, "--retries"),
    ("max_body_bytes", 0, "--max-body-bytes"), ("queue_timeout", 0, "--queue-timeout"),
    ("first_byte_timeout", 0, "--first-byte-timeout"), ("stream_idle_timeout", -1, "--stream-idle-timeout"),
    ("response_timeout", 1e9, "--response-timeout"), ("eject_max_seconds", 1, "--eject-max-seconds"),
    ("header_read_timeout", 0, "--header-read-timeout"), ("max_headers", 0, "--max-headers"),
    ("max_header_bytes", 10, "--max-header-bytes"), ("metrics_access", "all", "--metrics-access"),
])
def test_settings_name_the_flag(field, value, message):
    with pytest.raises(ValueError, match=message):
        GatewaySettings(**{field: value})


def test_zero_replicas_holds_then_serves_when_a_replica_appears():
    async def main():
        engine = FakeEngine("late")
        async with gateway({"m": []}, queue_timeout=20) as (client, app, table):
            async with serving(engine, engine.port):
                request = asyncio.create_task(client.post("/v1/completions", json=completion()))
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while 'kvpilot_gateway_held_requests{llmdeployment="m",llmdeployment_namespace="ns"} 1.0' \
                        not in (await client.get("/metrics")).text:
                    assert loop.time() < deadline and not request.done()
                    await asyncio.sleep(0.02)
                table.update([BackendSnapshot("m", "ns", "m", (("late", engine.url),))])
                r = await request
                assert r.status_code == 200 and r.json()["served_by"] == "late"
    run(main())


def test_usage_header_json_is_parsed_for_non_streaming_answers(tmp_path):
    async def main():
        async with gateway({"m1": [FakeEngine("one", chunks=2)]}, tenants_for(tmp_path), metrics_access="open") as (client, app, _):
            a = {"Authorization": f"Bearer {KEY_A}"}
            await client.post("/v1/completions", json=completion("m1"), headers=a)
            text = (await client.get("/metrics")).text
            assert 'kvpilot_gateway_tokens_total{kind="prompt",model="m1",tenant="team-a"} 10.0' in text
            assert json.loads((await client.get("/v1/models", headers=a)).text)["object"] == "list"
    run(main())


def test_a_deployment_at_zero_is_woken_once_and_its_held_requests_are_served():
    async def main():
        engine = FakeEngine("woken")
        async with gateway({"m": []}, queue_timeout=0.2, scale_from_zero_timeout=20) as (client, app, table):
            table.update([BackendSnapshot("m", "ns", "m", (), desired_replicas=0)])
            woken = []

            class Waker:  # the operator and the kubelet, in one step: spec.replicas 1, then a ready pod
                async def wake(self, namespace, name):
                    woken.append((namespace, name))
                    table.update([BackendSnapshot("m", "ns", "m", (), desired_replicas=1)])

            app.waker = Waker()
            async with serving(engine, engine.port):
                requests = [asyncio.create_task(client.post("/v1/completions", json=completion(prompt=f"p{i}")))
                            for i in range(3)]
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while 'kvpilot_gateway_held_requests{llmdeployment="m",llmdeployment_namespace="ns"} 3.0' \
                        not in (await client.get("/metrics")).text:
                    assert loop.time() < deadline
                    await asyncio.sleep(0.02)
                assert woken == [("ns", "m")]  # three held requests, one scale-up
                table.update([BackendSnapshot("m", "ns", "m", (("woken", engine.url),), desired_replicas=1)])
                answers = await asyncio.gather(*requests)
            assert [r.status_code for r in answers] == [200] * 3  # held past queue_timeout: nothing dropped
            metrics = (await client.get("/metrics")).text
            assert 'kvpilot_gateway_scale_from_zero_total{llmdeployment="m",llmdeployment_namespace="ns"} 1.0' in metrics
    run(main())


def test_a_deployment_put_back_to_zero_while_requests_are_held_is_woken_again():
    """The autotuner may read the last pod's metrics a few seconds after it went to zero and
    take a freshly woken deployment back to zero: each table refresh wakes it again (at most
    once per WAKE_RETRY_S) while requests are held, so none is left to time out."""
    from kvpilot.operator.gateway.app import WAKE_RETRY_S

    async def main():
        engine = FakeEngine("woken")
        async with gateway({"m": []}, queue_timeout=0.2, scale_from_zero_timeout=20) as (client, app, table):
            at_zero = [BackendSnapshot("m", "ns", "m", (), desired_replicas=0)]
            table.update(at_zero)
            now, woken = [1000.0], []
            app.clock = lambda: now[0]

            class Waker:
                async def wake(self, namespace, name):
                    woken.append((namespace, name))

            app.waker = Waker()
            app.refreshed()
            assert woken == []  # nothing held: nothing to wake
            async with serving(engine, engine.port):
                request = asyncio.create_task(client.post("/v1/completions", json=completion()))
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while len(woken) < 1:
                    assert loop.time() < deadline and not request.done()
                    await asyncio.sleep(0.02)
                table.update(at_zero)  # put back to zero before the woken pod was ready
                app.refreshed()
                await asyncio.sleep(0.05)
                assert len(woken) == 1  # not again within WAKE_RETRY_S
                now[0] += WAKE_RETRY_S
                app.refreshed()
                while len(woken) < 2:
                    assert loop.time() < deadline and not request.done()
                    await asyncio.sleep(0.02)
                table.update([BackendSnapshot("m", "ns", "m", (("woken", engine.url),), desired_replicas=1)])
                app.refreshed()
                r = await request
            assert r.status_code == 200 and woken == [("ns", "m")] * 2
            metrics = (await client.get("/metrics")).text
            assert 'kvpilot_gateway_scale_from_zero_total{llmdeployment="m",llmdeployment_namespace="ns"} 2.0' in metrics
    run(main())
