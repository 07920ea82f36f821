"""The gateway's HTTP edge, like the engine's: a deadline on request headers, limits on
their size and count, a deadline and a limit on the body, a request with two framings
refused, text the gateway cannot encode refused, and who may read /metrics."""
from __future__ import annotations

import asyncio
import hmac
import json
import re

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvpilot.engine.server.errors import APIError
from kvpilot.engine.server.write_deadline import with_write_deadline

from .relay import ClientGone

_CLOSE = [(b"connection", b"close")]
# A JSON escape of a UTF-16 surrogate: only then can a parsed string hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _raw_error(status: int, reason: bytes, message: str) -> bytes:
    """A whole HTTP/1.1 error response in the envelope, for errors found below the app."""
    body = json.dumps(APIError(status, message).body()).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status, reason, len(body), body))


def edge_protocol(header_timeout: float, max_header_bytes: int, max_headers: int,
                  write_timeout: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (the fast one the gateway runs on) with the engine's
    discipline: a client that reads nothing of its response for `write_timeout` seconds
    is dropped (write_deadline.py); a new connection, or a request once its first byte came, has
    `header_timeout` seconds to complete its headers (then 408 and the connection closes;
    uvicorn alone restarts its timer on every byte, so a trickle held a connection
    forever); request line plus headers over `max_header_bytes`, or more than
    `max_headers` of them, get 431 and the connection closes, without buffering more than
    one read past the limit. Idle keep-alive connections keep uvicorn's own timer."""

    class EdgeHttpToolsProtocol(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None
        _awaiting = True  # a request's headers are not complete yet
        _head_bytes = 0
        _count = 0
        _size = 0
        _refusal: bytes | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._awaiting:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._awaiting and self._head_bytes > max_header_bytes and not self.transport.is_closing():
                self._refuse(431, b"Request Header Fields Too Large",
                             f"the request line and headers exceed {max_header_bytes} bytes (--max-header-bytes)")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._awaiting, self._count, self._size = True, 0, 0
            if self._timer is None:
                self._arm()

        def on_url(self, url: bytes) -> None:
            self._grow(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count += 1
            if self._count > max_headers:
                self._stop(f"more than {max_headers} request headers (--max-headers)")
            self._grow(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _grow(self, size: int) -> None:
            self._size += size
            if self._size > max_header_bytes:
                self._stop(f"the request line and headers exceed {max_header_bytes} bytes (--max-header-bytes)")

        def _stop(self, message: str) -> None:
            self._refusal = _raw_error(431, b"Request Header Fields Too Large", message)
            raise ValueError(message)  # the parser stops; uvicorn calls send_400_response

        def on_headers_complete(self) -> None:
            self._awaiting, self._head_bytes = False, 0
            self._disarm()
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            # uvicorn's answer to bytes that are not HTTP (two framings, a bad header), in
            # the envelope instead of plain text.
            self._disarm()
            self.transport.write(self._refusal or _raw_error(400, b"Bad Request", f"not a valid HTTP request: {msg}"))
            self.transport.close()

        def _refuse(self, status: int, reason: bytes, message: str) -> None:
            self._disarm()
            self.transport.write(_raw_error(status, reason, message))
            self.transport.close()

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(header_timeout, self._deadline_passed)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _deadline_passed(self) -> None:
            self._timer = None
            if not self._awaiting or self.transport.is_closing():
                return
            if self._head_bytes:  # part of a request came: say why it is dropped
                self.transport.write(_raw_error(408, b"Request Timeout", (
                    f"the request headers did not arrive within {header_timeout:g} s (--header-read-timeout)")))
            self.transport.close()

    return with_write_deadline(EdgeHttpToolsProtocol, write_timeout, "--write-timeout")


def check_framing(scope) -> None:
    """RFC 9112 6.3: a request with both Content-Length and Transfer-Encoding may be a
    smuggling attempt; refuse it (the caller closes the connection). httptools refuses it
    already; this holds under any other HTTP implementation too."""
    names = {name for name, _ in scope.get("headers") or ()}
    if b"content-length" in names and b"transfer-encoding" in names:
        raise APIError(400, "the request has both Content-Length and Transfer-Encoding")


async def read_body(receive, max_bytes: int, timeout: float) -> bytes:
    """The whole body: 413 past `max_bytes`, 408 when it takes more than `timeout` seconds
    (both close the connection); ClientGone when the client leaves."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone()
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > max_bytes:
                    raise APIError(413, f"request body is larger than {max_bytes} bytes (--max-body-bytes)")
                chunks.append(chunk)
                if not message.get("more_body"):
                    return b"".join(chunks)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s (--body-read-timeout)") from None


def check_text(body: bytes, payload) -> None:
    """400 naming the field for a string holding a lone UTF-16 surrogate (`"\\ud800"`):
    no engine can encode it, and the gateway's own routing key could not either. A body
    without a surrogate escape is not walked."""
    if _SURROGATE_ESCAPE.search(body) is None:
        return
    where = _lone_surrogate(payload, "")
    if where is not None:
        raise APIError(400, f"{where or 'the body'}: the text holds a lone UTF-16 surrogate, which is not "
                            "valid Unicode", param=where or None)


def _lone_surrogate(value, path: str) -> str | None:
    stack = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(value, dict):
            stack += [(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()]
            stack += [(k, path) for k in value if isinstance(k, str)]
        elif isinstance(value, list):
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return None


def metrics_allowed(access: str, open_gateway: bool, key: str | None, authorization: str | None) -> None:
    """/metrics names tenants and models: who may read it (--metrics-access)."""
    if access == "open" or (access == "auto" and open_gateway):
        return
    if key is None:
        raise APIError(403, "/metrics is closed: it names tenants and models; give the gateway "
                            "--metrics-key-file (or --metrics-access open)", code="metrics_closed")
    token = authorization[7:] if authorization and authorization[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode()):
        raise APIError(401, "/metrics needs `Authorization: Bearer` with the gateway's metrics key",
                       code="invalid_api_key")
