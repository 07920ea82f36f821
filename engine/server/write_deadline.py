"""A deadline on a client that stops reading its response, for uvicorn's HTTP protocols
(the engine's h11 one and the gateway's httptools one).

uvicorn stops the application's `send` while the connection's write buffer is over its
high-water mark (asyncio calls the protocol's pause_writing) and lets it go on at
resume_writing. A client that stops reading never brings that resume: the handler waits
in `send` forever, holding its request (the gateway: a queue slot and a replica's stream),
and closing the transport would wait for the same buffer to drain. So writing that stays
paused for `timeout` seconds aborts the connection: uvicorn sees it lost, `send` returns,
the request's disconnect watcher fires, and everything the request held is freed."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kvpilot.server")


def with_write_deadline(protocol: type, timeout: float, flag: str) -> type:
    """`protocol` (a uvicorn HTTP protocol class) whose connection is aborted once writing
    stays paused `timeout` seconds; `flag` names the setting in the log line."""

    class WriteDeadline(protocol):
        _write_timer: asyncio.TimerHandle | None = None

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(timeout, self._write_deadline_passed)

        def resume_writing(self) -> None:
            self._cancel_write_deadline()
            super().resume_writing()

        def connection_lost(self, exc) -> None:
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
