"""A deadline on a client that stops reading its response, for uvicorn's HTTP protocols
(the engine's h11 one and the gateway's httptools one).

uvicorn stops the application's `send` while the connection's write buffer is over its
high-water mark (asyncio calls the protocol's pause_writing) and lets it go on at
resume_writing. A client that stops reading never brings that resume: the handler waits
in `send` forever, holding its request (the gateway: a queue slot and a replica's stream),
and closing the transport would wait for the same buffer to drain. So writing that stays
paused for `timeout` seconds aborts the connection: uvicorn sees it lost, `send` returns,
the request's disconnect watcher fires, and everything the request held is freed. A
connection closed (after its response, or by the keep-alive timer) with bytes its client
has not taken gets the same deadline: close() alone would hold it open until they drain,
and a client that never reads a small answer would keep its connection for ever."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kvpilot.server")


def with_write_deadline(protocol: type, timeout: float, flag: str) -> type:
    """`protocol` (a uvicorn HTTP protocol class) whose connection is aborted once writing
    stays paused `timeout` seconds; `flag` names the setting in the log line."""

    class WriteDeadline(protocol):
        _write_timer: asyncio.TimerHandle | None = None
        _lost = False

        def connection_made(self, transport) -> None:
            super().connection_made(_ClosingTransport(transport, self._arm_write_deadline))

        def pause_writing(self) -> None:
            super().pause_writing()
            self._arm_write_deadline()

        def _arm_write_deadline(self) -> None:
            if self._write_timer is None and not self._lost:
                self._write_timer = self.loop.call_later(timeout, self._write_deadline_passed)

        def resume_writing(self) -> None:
            self._cancel_write_deadline()
            super().resume_writing()

        def connection_lost(self, exc) -> None:
            self._lost = True
            self._cancel_write_deadline()
            super().connection_lost(exc)

        def _cancel_write_deadline(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_deadline_passed(self) -> None:
            self._write_timer = None
            log.warning("client %s read nothing of its response for %g s (%s); dropping it",
                        "%s:%s" % self.client if self.client else "?", timeout, flag)
            self.transport.abort()  # close() would wait for the unread buffer to drain

    WriteDeadline.__name__ = WriteDeadline.__qualname__ = f"WriteDeadline{protocol.__name__}"
    return WriteDeadline


class _ClosingTransport:
    """The transport as the protocol sees it: close() with bytes still unsent also calls
    `on_close_pending` (which arms the deadline); everything else is the transport's."""

    def __init__(self, transport, on_close_pending) -> None:
        self._transport = transport
        self._on_close_pending = on_close_pending

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def close(self) -> None:
        self._transport.close()
        if self._transport.get_write_buffer_size():
            self._on_close_pending()
