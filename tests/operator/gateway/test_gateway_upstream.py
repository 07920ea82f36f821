"""The gateway against bad engines (issue 40, part 1): a replica that never answers or
goes silent mid-stream costs a client one timeout at most, is ejected and skipped, and the
client's leaving frees its slot in every phase; the engine key is sent, the tenant's is
not. Timeouts are made small through the settings; nothing sleeps."""
from __future__ import annotations

import asyncio
import json

import httpx

from kvpilot.operator.gateway.replicas import Replica

from gateway_fakes import FakeEngine
from test_gateway_proxy import assert_envelope, completion, gateway, run

FAST = {"first_byte_timeout": 0.4, "response_timeout": 0.4, "stream_idle_timeout": 0.4, "eject_seconds": 60,
        "eject_max_seconds": 60}


async def until(predicate, seconds: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not predicate():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def metrics(client) -> str:
    return (await client.get("/metrics")).text


def test_a_wedged_replica_costs_one_timeout_then_gets_nothing_until_it_recovers():
    async def main():
        wedged, b, c = FakeEngine("a-wedged", "wedged"), FakeEngine("b"), FakeEngine("c")
        async with gateway({"m": [wedged, b, c]}, routing="round-robin", **FAST) as (client, app, table):
            loop = asyncio.get_running_loop()
            slow = 0
            for i in range(9):
                t0 = loop.time()
                r = await client.post("/v1/completions", json=completion(stream=i % 2 == 0))
                assert r.status_code == 200, r.text
                slow += loop.time() - t0 > 0.3
            assert len(wedged.bodies) == 1 and slow == 1  # one client paid the first-byte timeout once
            assert 'kvpilot_gateway_ejections_total{cause="timeout",model="m"} 1.0' in await metrics(client)
            assert 'kvpilot_gateway_retries_total{cause="timeout",model="m"} 1.0' in await metrics(client)
            replica = table.get("m").replicas["a-wedged"]
            assert replica.in_flight == 0 and table.get("m").queue.in_flight == 0
            wedged.release.set()
    run(main())


def test_every_replica_wedged_is_a_504_envelope_within_the_timeouts():
    async def main():
        engines = [FakeEngine("x", "wedged"), FakeEngine("y", "wedged")]
        async with gateway({"m": engines}, **FAST) as (client, app, table):
            loop = asyncio.get_running_loop()
            for stream in (False, True):
                t0 = loop.time()
                r = await client.post("/v1/completions", json=completion(stream=stream))
                assert_envelope(r, 504, match="did not answer within 0.4 s")
                assert r.json()["error"]["code"] == "upstream_timeout"
                assert loop.time() - t0 < 2.0
            assert table.get("m").queue.in_flight == 0
            for e in engines:
                e.release.set()
    run(main())


def test_a_stream_gone_silent_ends_with_an_error_event_and_ejects_the_replica():
    async def main():
        engine = FakeEngine("one", "hold")
        async with gateway({"m": [engine]}, **FAST) as (client, app, table):
            r = await client.post("/v1/completions", json=completion(stream=True))
            events = [e for e in r.text.split("\n\n") if e]
            assert r.status_code == 200 and json.loads(events[0][6:])["choices"][0]["text"] == "t0"
            error = json.loads(events[-1][6:])["error"]
            assert error["code"] == "upstream_timeout" and "--stream-idle-timeout" in error["message"]
            assert 'kvpilot_gateway_ejections_total{cause="stream_timeout",model="m"} 1.0' in await metrics(client)
            assert table.get("m").replicas["one"].ejected(app.clock())
            engine.release.set()
    run(main())


def test_the_client_leaving_frees_its_slot_while_waiting_for_the_first_byte():
    async def main():
        engine = FakeEngine("one", "wedged")
        async with gateway({"m": [engine]}, first_byte_timeout=60, response_timeout=60,
                           per_replica_concurrency=1) as (client, app, table):
            backend = table.get("m")
            port = client.base_url.port
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=0.3) as impatient:
                for _ in range(3):  # each leaves while the replica is silent; the slot comes back at once
                    try:
                        await impatient.post("/v1/completions", json=completion())
                    except httpx.ReadTimeout:
                        pass
                    await until(lambda: backend.queue.in_flight == 0, 2.0)
                    assert backend.replicas["one"].in_flight == 0
            engine.release.set()
    run(main())


def test_the_client_leaving_while_queued_is_no_longer_counted():
    async def main():
        engine = FakeEngine("one", "hold")
        async with gateway({"m": [engine]}, per_replica_concurrency=1, queue_timeout=60,
                           stream_idle_timeout=60) as (client, app, table):
            backend = table.get("m")
            holder = asyncio.create_task(client.post("/v1/completions", json=completion(stream=True)))
            await until(lambda: backend.queue.in_flight == 1)
            port = client.base_url.port
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=0.3) as impatient:
                try:
                    await impatient.post("/v1/completions", json=completion())
                except httpx.ReadTimeout:
                    pass
            await until(lambda: backend.queue.waiting == 0, 2.0)
            assert 'kvpilot_gateway_queue_waiting{model="m"} 0.0' in await metrics(client)
            engine.release.set()
            assert (await holder).status_code == 200
            assert backend.queue.in_flight == 0
    run(main())


def test_the_engine_key_is_sent_and_the_tenants_key_is_not(tmp_path):
    from test_gateway_proxy import KEY_A, tenants_for

    async def main():
        engine = FakeEngine("one")
        async with gateway({"m1": [engine]}, tenants_for(tmp_path), keys={"engine_key": "E" * 40}) as (client, *_):
            r = await client.post("/v1/completions", json=completion("m1"),
                                  headers={"Authorization": f"Bearer {KEY_A}"})
            assert r.status_code == 200
        async with gateway({"m1": [engine]}) as (client, *_):
            await client.post("/v1/completions", json=completion("m1"), headers={"Authorization": "Bearer mine"})
        assert engine.auth == ["Bearer " + "E" * 40, None]
    run(main())


def test_ejection_backs_off_doubling_and_a_good_answer_resets_it():
    r = Replica("p", "http://x")
    assert r.fail(100.0, 5, 60) == 5 and r.ejected(104.9) and not r.ejected(105.0)
    assert r.fail(105.0, 5, 60) == 10 and r.fail(115.0, 5, 60) == 20
    assert r.fail(135.0, 5, 60) == 40 and r.fail(175.0, 5, 60) == 60  # capped
    r.succeed()
    assert r.fail(300.0, 5, 60) == 5


def test_key_files_name_their_flag(tmp_path):
    import pytest

    from kvpilot.operator.gateway.cli import read_key

    (tmp_path / "key").write_text(" secret\n")
    assert read_key(str(tmp_path / "key"), "--engine-api-key-file") == "secret"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="--engine-api-key-file: .* is empty"):
        read_key(str(tmp_path / "empty"), "--engine-api-key-file")
    with pytest.raises(ValueError, match="--metrics-key-file: cannot read"):
        read_key(str(tmp_path / "missing"), "--metrics-key-file")


def test_a_kept_alive_connection_the_replica_closed_is_tried_again_not_failed():
    """An engine closes an idle kept-alive connection (uvicorn after 5 s) while the gateway
    sends on it: a race a loaded event loop makes likely. The request goes once more to the
    same replica on another connection and succeeds; the replica is not ejected. A replica
    that closes every connection under a request still fails it, as a 502."""
    body = json.dumps({"id": "c", "object": "text_completion", "model": "m",
                       "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def read_request(reader) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        return True

    async def main():
        served = []

        async def keep_one_answer(reader, writer):  # answers the first request of a connection only
            try:
                await read_request(reader)
                writer.write(answer)
                await writer.drain()
                served.append(1)
                await reader.read(1)  # the next request's first byte: closed under it
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()

        async def close_all(reader, writer):
            await reader.read(1)
            writer.close()

        closing = await asyncio.start_server(keep_one_answer, "127.0.0.1", 0)
        dead = await asyncio.start_server(close_all, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{closing.sockets[0].getsockname()[1]}"
        dead_url = f"http://127.0.0.1:{dead.sockets[0].getsockname()[1]}"
        async with closing, dead, gateway({"m": [url], "d": [dead_url]}, **FAST) as (client, app, table):
            for _ in range(3):  # each after the first finds the pooled connection closed under it
                r = await client.post("/v1/completions", json=completion())
                assert r.status_code == 200, r.text
            assert len(served) == 3
            replica = table.get("m").replicas["dead-0"]
            assert replica.in_flight == 0 and not replica.ejected_until
            text = await metrics(client)
            assert 'kvpilot_gateway_ejections_total{cause="connect_error",model="m"}' not in text
            assert 'kvpilot_gateway_retries_total{cause="stale_connection",model="m"} 2.0' in text
            r = await client.post("/v1/completions", json=completion("d"))
            assert_envelope(r, 502, match="ServerDisconnectedError")
    run(main())
