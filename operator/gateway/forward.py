"""One request's trip to a replica: send, retry on another replica while nothing has
reached the client, then stream the answer through as it arrives (never buffered), and
read the engines' `usage` on the way for the tenant's token limit."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from .replicas import Replica

# Headers passed on to the replica and back to the client (everything else is hop-by-hop
# or the gateway's own: the tenant's key stays here).
REQUEST_HEADERS = ("content-type", "accept", "x-request-id", "traceparent", "tracestate")
RESPONSE_HEADERS = ("content-type", "x-request-id", "retry-after", "cache-control")
# Failures before a response began, so nothing reached the client and another replica may
# take the request: refused, unreachable or timed out connecting (ClientConnectorError,
# ServerTimeoutError: the only timeout set is the connect one), reset while sending
# (ClientOSError, ConnectionResetError), closed before answering (ServerDisconnectedError:
# often a pooled connection the pod closed).
# The first-byte deadline is the gateway's own (asyncio.timeout around the request).
RETRYABLE_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerTimeoutError, aiohttp.ClientOSError,
                    ConnectionResetError, aiohttp.ServerDisconnectedError)
USAGE_SCAN_BYTES = 1 << 22  # a non-streamed answer larger than this is passed on unread
# Engines (uvicorn, as vLLM and `kvpilot serve` run it) close an idle connection after 5 s:
# the gateway drops its own idle ones first, so it seldom sends on one the pod is closing.
KEEPALIVE_S = 4.0
log = logging.getLogger("kvpilot.gateway")


class UpstreamFailed(Exception):
    """No replica gave a response (all refused connections or answered 503)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def read(self, payload: dict) -> None:
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or 0)


@dataclass
class Attempt:
    replica: Replica | None = None
    retries: list[str] = field(default_factory=list)  # causes, in order


def upstream_session(connect_timeout: float) -> aiohttp.ClientSession:
    """The proxy's client: aiohttp, which costs far less CPU per streamed request than
    httpx did. No connection limit (the admission queue bounds requests), no total or read
    timeout (a long generation streams for minutes), no content-type added where the
    client sent none (as before: FastAPI servers such as vLLM's read such a body as JSON,
    not one marked octet-stream), no compression asked for (CPU wasted between pods; a compressed answer is still
    decoded, as its content-encoding is not passed on), no cookies kept across tenants.
    Open it inside the running event loop."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout),
        skip_auto_headers=("Content-Type", "Accept-Encoding"), cookie_jar=aiohttp.DummyCookieJar())


@dataclass
class Upstream:
    """How one request goes to the replicas: at most `attempts` of them, each given
    `timeout` seconds to begin answering; `eject(replica, cause)` is called on a timeout
    or a failed connection (the gateway's passive outlier ejection)."""
    session: aiohttp.ClientSession
    attempts: int
    timeout: float
    eject: Callable[[Replica, str], None]


def closed_under_us(e: BaseException) -> bool:
    """Whether the replica closed a connection we had open (not a connection refused or
    never made): what a pooled keep-alive connection does when the engine's idle timeout
    ends as the gateway sends on it, a race a loaded event loop makes likely."""
    return (isinstance(e, (aiohttp.ServerDisconnectedError, ConnectionResetError))
            or (isinstance(e, aiohttp.ClientOSError) and not isinstance(e, aiohttp.ClientConnectorError)))


async def open_upstream(up: Upstream, order: tuple[Replica, ...], path: str, body: bytes,
                        headers: dict[str, str], attempt: Attempt) -> aiohttp.ClientResponse:
    """The first replica's response (headers read, body not), trying the next replica on a
    connection failure, a replica silent past the first-byte timeout, or a 503 (a draining
    or overloaded pod), at most `attempts` in all. The caller releases the response.

    A connection the replica closed under the request, before any answer, is tried once
    more on that replica (the closed connection is gone from the pool: another, or a new
    one), as HTTP clients do for a keep-alive connection the server closed idle (Go's
    net/http): it is not the replica's failure, so it is not ejected for it and it is not
    an attempt. A dead replica fails the second try too, and that counts."""
    failure, cause, status = "no ready replica", None, 503
    last_index = min(up.attempts, len(order)) - 1
    tried_again = False
    for i, replica in enumerate(order[:up.attempts]):
        if cause is not None:
            attempt.retries.append(cause)
        attempt.replica = replica
        replica.in_flight += 1
        try:
            async with asyncio.timeout(up.timeout):
                try:
                    response = await up.session.post(replica.url + path, data=body, headers=headers)
                except RETRYABLE_ERRORS as e:
                    if tried_again or not closed_under_us(e):
                        raise
                    tried_again = True
                    attempt.retries.append("stale_connection")
                    log.info("replica %s closed a kept-alive connection under a request (%s: %s); "
                             "sending it once more", replica.name, type(e).__name__, e)
                    response = await up.session.post(replica.url + path, data=body, headers=headers)
        except RETRYABLE_ERRORS as e:
            replica.in_flight -= 1
            failure, cause, status = f"{replica.name}: {type(e).__name__}: {e}", "connect_error", 502
            up.eject(replica, cause)
            continue
        except TimeoutError:  # the first-byte deadline (asyncio.timeout); its connection is closed
            replica.in_flight -= 1
            failure, cause, status = f"{replica.name} did not answer within {up.timeout:g} s", "timeout", 504
            up.eject(replica, cause)
            continue
        except BaseException:
            replica.in_flight -= 1
            raise
        if response.status == 503 and i < last_index:
            response.close()  # its connection too: the pod is going away
            replica.in_flight -= 1
            failure, cause, status = f"{replica.name} answered 503", "unavailable", 503
            continue
        return response  # the caller decrements in_flight when the body is done
    raise UpstreamFailed(f"no replica answered ({failure})", status)


class SSEUsage:
    """Splits a server-sent-event stream into whole events so `usage` can be read, and
    drops the usage-only event when the gateway asked for it and the client did not."""

    def __init__(self, usage: Usage, strip_usage_event: bool, count: bool = False) -> None:
        self.usage = usage
        self.strip = strip_usage_event
        self.count = count  # bound the tokens passed on (the charge of a stream cut before its usage)
        self.streamed = 0
        self.seen_usage = False
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        complete, self._pending = data[:end + 2], data[end + 2:]
        if not self.count and b'"usage":{' not in complete and b'"usage": {' not in complete:
            return complete
        kept = []
        for event in complete.split(b"\n\n")[:-1]:
            has_usage = b'"usage":{' in event or b'"usage": {' in event
            if event.startswith(b"data: {") and (has_usage or self.count):
                try:
                    payload = json.loads(event[6:])
                except ValueError:
                    payload = {}
                if self.count:
                    self.streamed += streamed_tokens(payload)
                if has_usage and isinstance(payload.get("usage"), dict):
                    self.usage.read(payload)
                    self.seen_usage = True
                if self.strip and payload.get("choices") == []:
                    continue
            kept.append(event + b"\n\n")
        return b"".join(kept)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest


def streamed_tokens(event: dict) -> int:
    """An upper bound of the tokens one streamed event carries: the UTF-8 bytes of its text
    (every token decodes to at least one byte), at least 1 per choice with text."""
    total = 0
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else choice
        parts = [delta.get(k) for k in ("text", "content", "reasoning_content")]
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                parts += [call["function"].get("name"), call["function"].get("arguments")]
        size = sum(len(p.encode("utf-8", "surrogatepass")) for p in parts if isinstance(p, str))
        if size or any(isinstance(p, str) for p in parts):
            total += max(1, size)
    return total


def inject_usage_request(payload: dict) -> bool:
    """Ask a streaming request for its usage event (the token limit needs it). True when
    the client had not asked, so the event is dropped before it reaches the client."""
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return False  # invalid: passed on as sent, so the engine refuses it (never repaired here)
    if isinstance(options, dict) and (options.get("include_usage") is True
                                      or not isinstance(options.get("include_usage", False), bool)):
        return False  # asked for already, or an invalid value the engine refuses
    payload["stream_options"] = {**(options or {}), "include_usage": True}
    return True
