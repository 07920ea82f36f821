"""BodyGuard: the ASGI middleware that reads each request body within the server's limits
(size and read time) before any route sees it."""

from __future__ import annotations

import asyncio

from .errors import APIError, send_error
from .limits import ServerLimits

_CLOSE = [(b"connection", b"close")]  # the rest of an unread body is not worth reading


class BodyGuard:
    """Pure ASGI: reads the whole body, at most `max_bytes` of it within `timeout` seconds
    of the headers, then hands the app a `receive` that replays it (and afterwards waits on
    the real channel, so disconnects still reach the app). 413 and 408 close the connection."""

    def __init__(self, app, limits: ServerLimits) -> None:
        self.app = app
        self.max_bytes = limits.max_request_body_bytes
        self.timeout = limits.body_read_timeout

    def _too_large(self) -> APIError:
        return APIError(413, f"body: the request body exceeds the server's limit of "
                             f"{self.max_bytes} bytes (--max-request-body-bytes)")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers") or ():
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await send_error(send, self._too_large(), _CLOSE)
                return
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # nobody to answer
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        await send_error(send, self._too_large(), _CLOSE)
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await send_error(send, APIError(408, f"body: the request body did not arrive within "
                                                 f"{self.timeout:g} s (--body-read-timeout)"), _CLOSE)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
