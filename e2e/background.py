"""A coroutine run on its own event loop in a daemon thread, for the load generators
(kvsession.LoadDriver, trace_replay.TraceReplayer): start it, ask it to stop, join it.
An exception the coroutine raises is kept in `error` for the caller to report."""
from __future__ import annotations

import asyncio
import threading


class AsyncWorker:
    thread_name = "worker"

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported by the caller
            self.error = e

    async def _main(self) -> None:
        raise NotImplementedError
