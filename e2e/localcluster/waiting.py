"""Polling with a deadline (no fixed sleeps in tests)."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 60.0, interval: float = 0.2,
             what: str = "condition", fatal: tuple[type[BaseException], ...] = ()) -> T:
    """Calls `predicate` until it returns something truthy (returned) or the
    deadline passes (TimeoutError). Exceptions count as 'not yet' (the last
    one is named in the error), except those of the `fatal` types, which
    propagate at once."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except fatal:
            raise
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last_exc = e
        if time.monotonic() >= deadline:
            msg = f"timed out after {timeout:.0f}s waiting for {what}"
            if last_exc is not None:
                msg += f" (last error: {last_exc!r})"
            raise TimeoutError(msg)
        time.sleep(interval)
