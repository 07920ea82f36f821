"""The Prometheus HTTP client the operator's readers use: prometheus_api_client with a
request timeout (a Prometheus that hangs must not hold a reconcile forever), and every
query counted and timed in the operator's own metrics, by reader (`deployment`: the
per-deployment reader; `fleet`: one grouped read for a resync pass)."""
from __future__ import annotations

import time
from typing import Any

from .. import metrics
from .prometheus import QueryClient

QUERY_TIMEOUT_S = 10


class CountingClient:
    """A QueryClient that counts its queries and their outcome."""

    def __init__(self, inner: QueryClient, reader: str) -> None:
        self.inner, self.reader = inner, reader

    def custom_query(self, query: str, params: dict | None = None) -> list[dict[str, Any]]:
        start = time.monotonic()
        outcome = "error"
        try:
            result = self.inner.custom_query(query, params=params) if params else self.inner.custom_query(query)
            outcome = "ok"
            return result
        finally:
            metrics.PROMETHEUS_QUERIES.labels(self.reader, outcome).inc()
            metrics.PROMETHEUS_QUERY_DURATION.labels(self.reader).observe(time.monotonic() - start)


def connect(url: str, reader: str, timeout_s: float = QUERY_TIMEOUT_S) -> CountingClient:
    from prometheus_api_client import PrometheusConnect  # imported where used

    return CountingClient(PrometheusConnect(url=url, disable_ssl=True, timeout=timeout_s), reader)
