"""Per-tenant request and token limits, exact over a sliding window.

Requests: at most `limit` admitted in any `window` seconds (a log of admission times).
Tokens: reserve at admission, charge at the end. A request reserves the completion tokens
it may produce (its `max_tokens` x choices, or the tenant's whole limit where it names
none) and is admitted when the tokens used in the last `window` seconds plus every
reservation still open plus its own fit the limit, or, so that one request larger than the
limit can still run, when nothing is reserved and the tokens used are under the limit.
When it ends its reservation is replaced by its charge: the engine's `usage` (prompt +
completion) where it came, else an upper bound of what was streamed (see relay.py). So
concurrency cannot overshoot, and a tenant receives at most its limit plus one request's
`max_tokens` in any window."""
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
        self.reserved = 0  # tokens reserved by requests admitted and not yet charged

    def admit(self, now: float, reserve: int = 0) -> tuple[str, int] | None:
        """Record one request (and reserve `reserve` tokens) and return None, or return
        (which limit, Retry-After seconds). Pair each admission with `settle`."""
        if self.requests is not None and not self.requests.fits(now):
            return "requests", self.requests.retry_after(now)
        if self.tokens is not None:
            used = self.tokens.used(now) + self.reserved
            alone = self.reserved == 0 and used < self.tokens.limit
            if not alone and used + reserve > self.tokens.limit:
                need = min(self.reserved + reserve, self.tokens.limit)
                return "tokens", self.tokens.retry_after(now, need)
            self.reserved += reserve
        if self.requests is not None:
            self.requests.add(now, 1)
        return None

    def settle(self, now: float, reserved: int, tokens: int) -> None:
        """A request ended: its reservation goes, its charge (tokens) counts."""
        if self.tokens is not None:
            self.reserved = max(0, self.reserved - reserved)
            self.tokens.add(now, tokens)

    def charge_tokens(self, now: float, tokens: int) -> None:
        self.settle(now, 0, tokens)


def _count(value, default: int = 1) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default


def reservation(payload: dict, cap: int) -> int:
    """The completion tokens a request may produce: `max_completion_tokens` or `max_tokens`
    (`cap`, the tenant's limit, where neither is a positive int) for each choice (`n`,
    `best_of`) of each prompt of a batch."""
    per = _count(payload.get("max_completion_tokens"), 0) or _count(payload.get("max_tokens"), cap)
    choices = max(_count(payload.get("n")), _count(payload.get("best_of")))
    prompt = payload.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return per * choices * prompts
