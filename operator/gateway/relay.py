"""A replica's response passed to the client chunk by chunk as it arrives (never
buffered), the engines' `usage` read on the way, and the client's leaving noticed."""
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


async def relay(upstream: aiohttp.ClientResponse, receive, send, stream: bool, sse: SSEUsage, usage: Usage,
                replica: str) -> int:
    """The response's status once its body has passed. A replica lost mid-stream ends that
    stream with an error event (502); the client leaving raises ClientGone with the body
    unread, so releasing the response closes its connection (the engine then aborts the
    request)."""
    headers = [(k.encode(), v.encode()) for k in RESPONSE_HEADERS if (v := upstream.headers.get(k)) is not None]
    headers.append((b"x-kvpilot-replica", replica.encode()))
    await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
    scanned = bytearray()
    pumping = asyncio.create_task(pump(upstream, send, stream, sse, scanned))
    gone = asyncio.create_task(disconnected(receive))
    try:
        await asyncio.wait({pumping, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not pumping.done():  # the client left (or this task was cancelled): stop reading
            pumping.cancel()
            await asyncio.gather(pumping, return_exceptions=True)
    if not pumping.done() or pumping.cancelled():
        raise ClientGone()
    failure = pumping.result()
    if failure is not None:
        log.warning("replica %s failed mid-response: %s: %s", replica, type(failure).__name__, failure)
        tail = sse.flush() if stream else b""
        if stream:
            err = APIError(502, f"the replica serving this stream failed: {type(failure).__name__}",
                           type="server_error", code="upstream_failed")
            tail += b"data: " + json.dumps(err.body()).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return 502
    await send({"type": "http.response.body", "body": sse.flush() if stream else b"", "more_body": False})
    if not stream and upstream.status == 200 and len(scanned) < USAGE_SCAN_BYTES:
        try:
            usage.read(json.loads(bytes(scanned)))
        except ValueError:
            pass
    return upstream.status


async def pump(upstream: aiohttp.ClientResponse, send, stream: bool, sse: SSEUsage,
               scanned: bytearray) -> aiohttp.ClientError | None:
    """Copy the body to the client; the replica's failure is returned, not raised."""
    try:
        async for chunk in upstream.content.iter_any():  # whatever has arrived, at once
            if stream:
                chunk = sse.feed(chunk)
            elif len(scanned) < USAGE_SCAN_BYTES:
                scanned += chunk
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except aiohttp.ClientError as e:  # ClientPayloadError: the replica's connection was cut mid-body
        return e
    return None


async def disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
