"""Per-tenant request and token limits, exact over a sliding window.

Requests: at most `limit` admitted in any `window` seconds (a log of admission times).
Tokens: a request is admitted while the tokens its tenant used in the last `window`
seconds (prompt + completion, as the engines' `usage` reported them) are under `limit`;
a request is charged when its usage is known, so the last one admitted can overshoot by
its own size, as with any limit on tokens not known in advance."""
from __future__ import annotations

import math
from collections import deque


class SlidingWindow:
    """Amounts with their times; `used(now)` sums those inside the window."""

    def __init__(self, limit: int, window: float) -> None:
        if limit < 1:
            raise ValueError(f"rate limit must be >= 1, got {limit}")
        if window <= 0:
            raise ValueError(f"rate limit window must be > 0 seconds, got {window}")
        self.limit = limit
        self.window = window
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.window:
            self._total -= self._events.popleft()[1]

    def used(self, now: float) -> int:
        self._expire(now)
        return self._total

    def add(self, now: float, amount: int) -> None:
        if amount > 0:
            self._events.append((now, amount))
            self._total += amount

    def fits(self, now: float, need: int = 1) -> bool:
        return self.used(now) + need <= self.limit

    def retry_after(self, now: float, need: int = 1) -> int:
        """Whole seconds until `need` more fit: when enough of the oldest amounts expire."""
        excess = self.used(now) + need - self.limit
        freed = 0
        for t, amount in self._events:
            freed += amount
            if freed >= excess:
                return max(1, math.ceil(t + self.window - now))
        return max(1, math.ceil(self.window))


class TenantLimits:
    """One tenant's windows; None where the tenant has no such limit."""

    def __init__(self, requests_per_window: int | None, tokens_per_window: int | None,
                 window: float) -> None:
        self.requests = SlidingWindow(requests_per_window, window) if requests_per_window else None
        self.tokens = SlidingWindow(tokens_per_window, window) if tokens_per_window else None

    def admit(self, now: float) -> tuple[str, int] | None:
        """Record one request and return None, or return (which limit, Retry-After seconds)."""
        if self.requests is not None and not self.requests.fits(now):
            return "requests", self.requests.retry_after(now)
        if self.tokens is not None and not self.tokens.fits(now):
            return "tokens", self.tokens.retry_after(now)
        if self.requests is not None:
            self.requests.add(now, 1)
        return None

    def charge_tokens(self, now: float, tokens: int) -> None:
        if self.tokens is not None:
            self.tokens.add(now, tokens)
