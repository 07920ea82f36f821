"""The gateway's own queue, per model: at most `capacity` requests in flight (ready
replicas x the per-replica allowance); the rest wait, highest tenant priority first and
first-come within a priority, until a slot frees or their wait runs out. With no ready
replica the capacity is 0, so requests for a model at zero replicas are held here until
one is ready (scale from zero)."""
from __future__ import annotations

import asyncio
import heapq
import itertools


class AdmissionQueue:
    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self._waiters: list[tuple[int, int, asyncio.Future]] = []  # (-priority, arrival, future)
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, f in self._waiters if not f.done())

    def set_capacity(self, capacity: int) -> None:
        self.capacity = capacity
        self._wake()

    async def acquire(self, priority: int, timeout: float) -> bool:
        """True once the request holds a slot (release it after), False when `timeout`
        seconds passed without one."""
        if self.in_flight < self.capacity and not self.waiting:
            self.in_flight += 1
            return True
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (-priority, next(self._arrivals), future))
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return False
        except asyncio.CancelledError:
            # The client left. A slot granted in the same instant goes to the next waiter.
            if future.done() and not future.cancelled():
                self.release()
            raise

    def release(self) -> None:
        self.in_flight -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.in_flight < self.capacity:
            _, _, future = heapq.heappop(self._waiters)
            if future.done():  # timed out or cancelled while waiting
                continue
            self.in_flight += 1
            future.set_result(True)
        # Drop finished waiters at the top so the heap does not grow with timeouts.
        while self._waiters and self._waiters[0][2].done():
            heapq.heappop(self._waiters)
