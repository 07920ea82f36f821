"""The engine's notion of time. The real engine and the real-time simulated server run
on the wall clock; the virtual-clock simulator advances time by modelled step lengths
instead of waiting, so a simulated hour takes seconds."""

from __future__ import annotations

import time


class RealClock:
    """Monotonic wall time; `sleep_until` blocks the calling (engine) thread."""

    def now(self) -> float:
        return time.monotonic()

    def sleep_until(self, deadline: float) -> None:
        delay = deadline - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class VirtualClock:
    """Time that moves only when told to: `sleep_until` jumps to the deadline."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = float(start)

    def now(self) -> float:
        return self.t

    def sleep_until(self, deadline: float) -> None:
        if deadline > self.t:
            self.t = deadline
