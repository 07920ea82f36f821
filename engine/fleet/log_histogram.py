"""A histogram with log-spaced bins (1 % wide): percentiles of millions of values, such
as every inter-token gap of a simulated hour, within 0.5 % and in constant memory."""

from __future__ import annotations

import math
from collections import Counter

_RATIO = 1.01
_LOG_RATIO = math.log(_RATIO)
_FLOOR = 1e-7  # values below (including 0) share the lowest bin


class LogHistogram:
    def __init__(self) -> None:
        self.bins: Counter[int] = Counter()
        self.count = 0
        self.sum = 0.0
        self.sum_sq = 0.0
        self._last = (None, 0)  # (value, bin): a step's gaps mostly repeat one value

    def observe(self, value: float, times: int = 1) -> None:
        last_value, b = self._last
        if value != last_value:
            b = math.floor(math.log(max(value, _FLOOR)) / _LOG_RATIO)
            self._last = (value, b)
        self.bins[b] += times
        self.count += times
        self.sum += value * times
        self.sum_sq += value * value * times

    def merge(self, other: LogHistogram) -> None:
        self.bins.update(other.bins)
        self.count += other.count
        self.sum += other.sum
        self.sum_sq += other.sum_sq

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        if not self.count:
            return 0.0
        return math.sqrt(max(self.sum_sq / self.count - self.mean ** 2, 0.0))

    def quantile(self, q: float) -> float:
        """The value at quantile q in [0, 1] (the geometric middle of its bin)."""
        if not self.count:
            return 0.0
        rank = q * (self.count - 1)
        seen = 0
        for b in sorted(self.bins):
            seen += self.bins[b]
            if seen > rank:
                return _RATIO ** (b + 0.5)
        return _RATIO ** (max(self.bins) + 0.5)
