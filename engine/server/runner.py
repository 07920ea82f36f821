"""Runs the app under uvicorn with kvpilot's shutdown: SIGTERM (or Ctrl-C) drains.

Draining: /health turns 503 so the pod leaves the Service, new generation requests get
503, requests in flight run to completion for up to the drain timeout (then are aborted),
and the process exits 0. A second signal exits at once."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from .serving_common import ServerState

log = logging.getLogger("kvpilot.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

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


def run_server(app, state: ServerState, host: str, port: int, *, access_log: bool = True,
               log_level: str = "info") -> int:
    config = uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=access_log, log_level=log_level,
        timeout_graceful_shutdown=5, timeout_keep_alive=5,
    )
    server = DrainingServer(config, state)
    asyncio.run(server.serve())
    return 0
