"""The Prometheus HTTP client the operator's readers use: prometheus_api_client with a
request timeout (a Prometheus that hangs must not hold a reconcile forever), and every
query counted and timed in the operator's own metrics, by reader (`deployment`: the
per-deployment reader; `fleet`: one grouped read for a resync pass)."""
from __future__ import annotations

import time
from typing import Any

from ..runtime import metrics
from .prometheus import QUERY_TIMEOUT_S, QueryClient


class CountingClient:
    """A QueryClient that counts its queries and their outcome."""

    def __init__(self, inner: QueryClient, reader: str, url: str = "") -> None:
        self.inner, self.reader, self.url = inner, reader, url

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
    from urllib3.util.retry import Retry

    # No retries: PrometheusConnect's default retries refusals and 5xx answers with backoff,
    # stalling the pass; the next pass is the retry. A timeout: a blackholed address must
    # not hold the reconcile forever.
    client = PrometheusConnect(url=url, disable_ssl=True, retry=Retry(total=0, status_forcelist=()),
                               timeout=timeout_s)
    return CountingClient(client, reader, url)
