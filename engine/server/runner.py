"""Runs the app under uvicorn with kvpilot's shutdown: SIGTERM (or Ctrl-C) drains.

Draining: /health turns 503 so the pod leaves the Service, new generation requests get
503, requests in flight run to completion for up to the drain timeout (then are aborted),
and the process exits 0. A second signal exits at once.

An engine that fails for good (a tensor/pipeline-parallel rank died) turns /health to 503
and exits 1 at once, aborting what is in flight: the pod restarts, it does not hang."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError
from .serving_common import ServerState
from .write_deadline import with_write_deadline

log = logging.getLogger("kvpilot.server")

ENGINE_WATCH_S = 0.2  # how often the server looks for a failed engine
# After an engine failure the process exits by this deadline even if shutting down hangs
# (the engine thread may be stuck in a collective with a rank that is gone).
FAILED_EXIT_DEADLINE_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self.exit_code = 0

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        watch = asyncio.ensure_future(self._watch_engine())
        try:
            await super().serve(sockets)
        finally:
            watch.cancel()

    async def _watch_engine(self) -> None:
        while not self.should_exit:
            failure = self.state.engine.failure
            if failure is not None:
                log.error("engine failed: %s; /health is 503, aborting %d requests, exiting with code 1",
                          failure, self.state.engine.num_active)
                self.state.draining = True
                self.exit_code = 1
                timer = threading.Timer(FAILED_EXIT_DEADLINE_S, os._exit, (1,))
                timer.daemon = True
                timer.start()
                self.state.engine.abort_all()
                self.should_exit = True
                return
            await asyncio.sleep(ENGINE_WATCH_S)

    def handle_exit(self, sig: int, frame) -> None:  # called by uvicorn's signal handler
        if self.state.draining or self._loop is None:
            log.warning("second %s: exiting without waiting", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        self._drain_task = asyncio.ensure_future(self.drain(signal.Signals(sig).name))

    async def drain(self, reason: str = "shutdown") -> None:
        state = self.state
        state.draining = True
        engine = state.engine
        timeout = state.settings.drain_timeout
        loop = asyncio.get_running_loop()
        log.info("%s: draining; no new requests, %d in flight (waiting up to %g s)",
                 reason, engine.num_active, timeout)
        deadline = loop.time() + timeout
        while engine.num_active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_active:
            log.warning("drain timeout: aborting %d requests still in flight", engine.num_active)
            engine.abort_all()
            grace = loop.time() + 5.0
            while engine.num_active and loop.time() < grace:
                await asyncio.sleep(0.05)
        log.info("drained; exiting")
        self.should_exit = True


def _raw_error(status: int, reason: bytes, message: str) -> bytes:
    """A whole HTTP/1.1 error response in the envelope, for errors found below the app."""
    body = json.dumps(APIError(status, message).body()).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status, reason, len(body), body))


def header_deadline_protocol(timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on request headers: from the moment a connection
    opens (or its previous response ends) the next request's headers must be complete within
    `timeout` seconds, or the connection is closed (with a 408 if some of them came). uvicorn
    has no such deadline: its keep-alive timer restarts on every byte, so a client trickling
    a header a byte at a time held a connection forever. Bodies have BodyGuard's deadline."""

    class HeaderDeadlineH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_deadline()

        def _arm_header_deadline(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(timeout, self._header_deadline_passed)

        def _header_deadline_passed(self) -> None:
            self._header_timer = None
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                return  # the request's headers are in (its body has BodyGuard's deadline)
            if self.conn.trailing_data[0]:  # part of a request came: say why it is dropped
                self.transport.write(_raw_error(408, b"Request Timeout", (
                    f"the request headers did not arrive within {timeout:g} s (--header-read-timeout)")))
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            # uvicorn's answer to bytes that are not HTTP (or headers over h11's 16 KiB), in
            # the envelope instead of plain text.
            self.transport.write(_raw_error(400, b"Bad Request", f"not a valid HTTP request: {msg}"))
            self.transport.close()

    return HeaderDeadlineH11Protocol


def run_server(app, state: ServerState, host: str, port: int, *, access_log: bool = True,
               log_level: str = "info") -> int:
    config = uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=access_log, log_level=log_level,
        timeout_graceful_shutdown=5, timeout_keep_alive=5,
        http=with_write_deadline(header_deadline_protocol(state.settings.limits.header_read_timeout),
                                 state.settings.limits.write_timeout, "--write-timeout"),
    )
    server = DrainingServer(config, state)
    asyncio.run(server.serve())
    return server.exit_code
