"""A replica's response passed to the client chunk by chunk as it arrives (never
buffered), the engines' `usage` read on the way, a silent replica noticed (the idle-stream
timeout), and the client's leaving noticed in every phase of a request (`until_gone`)."""
from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

from kvpilot.engine.server.errors import APIError

from .forward import RESPONSE_HEADERS, USAGE_SCAN_BYTES, SSEUsage, Usage

log = logging.getLogger("kvpilot.gateway")


class ClientGone(Exception):
    pass


class UpstreamIdle(Exception):
    """The replica sent nothing for the idle-stream timeout."""


class Watchdog:
    """Cancels `task` once `idle` seconds pass with no `poke()` while not `paused` (the
    time spent waiting on a slow client is not the replica's). One timer per idle period,
    re-armed lazily when it fires, so a chunk costs a clock read, not a timer."""

    def __init__(self, idle: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.idle = idle
        self.last = self.loop.time()
        self.paused = False
        self.fired = False
        self.task: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, task: asyncio.Future) -> None:
        self.task = task
        self._timer = self.loop.call_at(self.last + self.idle, self._check)

    def poke(self) -> None:
        self.last = self.loop.time()

    def _check(self) -> None:
        now = self.loop.time()
        if self.paused or now - self.last < self.idle:
            self._timer = self.loop.call_at(max(now, self.last) + self.idle, self._check)
            return
        self.fired = True
        self.task.cancel()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


async def until_gone(receive, work, finished) -> object:
    """Run the coroutine `work` while watching the client: when it disconnects before
    `finished()` (the response sent whole), `work` is cancelled at once, whatever it
    awaits (a queue slot, a replica's first byte, the next chunk), so its `finally`
    blocks free the slot and the replica's connection; then ClientGone."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and finished():
            await asyncio.wait({task})  # the answer is out: its bookkeeping finishes
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def relay(upstream: aiohttp.ClientResponse, send, stream: bool, sse: SSEUsage, usage: Usage,
                replica: str, idle: float) -> tuple[int, Exception | None]:
    """(The status passed to the client, the replica's failure or None) once the body has
    passed. A replica lost or silent for `idle` seconds mid-stream ends that stream with an
    error event (502 or 504); a non-streamed body is left unfinished, so the client's
    connection closes instead of a truncated answer looking whole."""
    headers = [(k.encode(), v.encode()) for k in RESPONSE_HEADERS if (v := upstream.headers.get(k)) is not None]
    headers.append((b"x-kvpilot-replica", replica.encode()))
    await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
    scanned = bytearray()
    dog = Watchdog(idle)
    pumping = asyncio.ensure_future(pump(upstream, send, stream, sse, scanned, dog))
    dog.watch(pumping)
    try:
        failure = await pumping
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if not dog.fired or (current is not None and current.cancelling()):
            raise
        failure = UpstreamIdle(f"no data for {idle:g} s (--stream-idle-timeout)")
    finally:
        dog.stop()
    if failure is not None:
        log.warning("replica %s failed mid-response: %s: %s", replica, type(failure).__name__, failure)
        if not stream:
            return 502, failure
        status, code = (504, "upstream_timeout") if isinstance(failure, UpstreamIdle) else (502, "upstream_failed")
        err = APIError(status, f"the replica serving this stream failed: {type(failure).__name__}: {failure}",
                       type="server_error", code=code)
        tail = sse.flush() + b"data: " + json.dumps(err.body()).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return status, failure
    await send({"type": "http.response.body", "body": sse.flush() if stream else b"", "more_body": False})
    if not stream and upstream.status == 200 and len(scanned) < USAGE_SCAN_BYTES:
        try:
            usage.read(json.loads(bytes(scanned)))
        except (ValueError, TypeError, AttributeError):
            pass
    return upstream.status, None


async def pump(upstream: aiohttp.ClientResponse, send, stream: bool, sse: SSEUsage,
               scanned: bytearray, dog: Watchdog) -> Exception | None:
    """Copy the body to the client; the replica's failure is returned, not raised."""
    try:
        async for chunk in upstream.content.iter_any():  # whatever has arrived, at once
            dog.poke()
            if stream:
                chunk = sse.feed(chunk)
            elif len(scanned) < USAGE_SCAN_BYTES:
                scanned += chunk
            if chunk:
                dog.paused = True
                try:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                finally:
                    dog.paused = False
                    dog.poke()
    except aiohttp.ClientError as e:  # ClientPayloadError: the replica's connection was cut mid-body
        return e
    return None


async def disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
