"""The Prometheus HTTP client the operator's readers use, and what its answers may be: the
QueryClient protocol, well-formed instant vectors, and MetricsUnavailable for anything else.
The client is prometheus_api_client with a request timeout (a Prometheus that hangs must not
hold a reconcile forever), and every query counted and timed in the operator's own metrics,
by reader (`deployment`: the per-deployment reader; `fleet`: one grouped read for a resync
pass). Both are imported by connect(), where a client is made: the autotuner's pure parts
(and `kvpilot operator --help`) load neither."""
from __future__ import annotations

import math
import time
from typing import Any, Protocol


class QueryClient(Protocol):
    """The one method used of prometheus_api_client.PrometheusConnect."""

    def custom_query(self, query: str, params: dict | None = None) -> list[dict[str, Any]]: ...


QUERY_TIMEOUT_S = 10
UNREACHABLE = "PrometheusUnreachable"  # no HTTP answer: refused, timed out, name not found
BAD_RESPONSE = "BadResponse"  # an answer that is not query data: HTTP error, not JSON, wrong shape


class MetricsUnavailable(Exception):
    """Prometheus gave nothing a decision may rest on; `reason` is UNREACHABLE or BAD_RESPONSE."""

    def __init__(self, reason: str, url: str, detail: str) -> None:
        super().__init__(f"{'cannot reach' if reason == UNREACHABLE else 'bad answer from'} "
                         f"Prometheus at {url}: {detail}")
        self.reason, self.url, self.detail = reason, url, detail


def sample_number(text: Any) -> float | None:
    """A sample value as Prometheus writes it ("1.5", "NaN", "+Inf"); None unless finite."""
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"sample value {str(text)[:40]!r} is not a number") from None
    return v if math.isfinite(v) else None


def instant_samples(result: Any) -> list[tuple[dict, float, float | None]]:
    """(labels, evaluation time, finite value or None) of each series of an instant vector;
    ValueError for anything shaped otherwise."""
    if not isinstance(result, list):
        raise ValueError(f"result is a {type(result).__name__}, not a list")
    out = []
    for series in result:
        pair = series.get("value") if isinstance(series, dict) else None
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"series {str(series)[:80]!r} has no [time, value] pair")
        ts = sample_number(pair[0])
        if ts is None:
            raise ValueError(f"series {str(series)[:80]!r} has no finite time")
        labels = series.get("metric")
        out.append((labels if isinstance(labels, dict) else {}, ts, sample_number(pair[1])))
    return out


def first_sample(result: Any) -> tuple[float, float | None] | None:
    """(evaluation time, finite value or None) of a single-sample result, or None when empty."""
    samples = instant_samples(result)
    if not samples:
        return None
    _, ts, value = samples[0]
    return ts, value


def checked_query(client: QueryClient, url: str, q: str, params: dict | None = None) -> list[dict]:
    """One instant query; MetricsUnavailable for anything but a well-formed vector."""
    try:
        result = client.custom_query(q, params=params) if params else client.custom_query(q)
        instant_samples(result)  # the shape, checked once here
    except ValueError as e:  # not JSON (requests' JSONDecodeError is an OSError too)
        raise MetricsUnavailable(BAD_RESPONSE, url, f"{type(e).__name__}: {e}"[:300]) from e
    except OSError as e:  # requests' errors are OSErrors: refused, reset, timed out
        raise MetricsUnavailable(UNREACHABLE, url, f"{type(e).__name__}: {e}"[:300]) from e
    except Exception as e:  # HTTP error status, non-JSON body, wrong shape
        raise MetricsUnavailable(BAD_RESPONSE, url, f"{type(e).__name__}: {e}"[:300]) from e
    return result


class CountingClient:
    """A QueryClient that counts its queries and their outcome."""

    def __init__(self, inner: QueryClient, reader: str, url: str = "") -> None:
        from ...runtime import metrics  # prometheus_client's registry: only where queries are sent

        self.inner, self.reader, self.url, self.metrics = inner, reader, url, metrics

    def custom_query(self, query: str, params: dict | None = None) -> list[dict[str, Any]]:
        start = time.monotonic()
        outcome = "error"
        try:
            result = self.inner.custom_query(query, params=params) if params else self.inner.custom_query(query)
            outcome = "ok"
            return result
        finally:
            self.metrics.PROMETHEUS_QUERIES.labels(self.reader, outcome).inc()
            self.metrics.PROMETHEUS_QUERY_DURATION.labels(self.reader).observe(time.monotonic() - start)


def connect(url: str, reader: str, timeout_s: float = QUERY_TIMEOUT_S) -> CountingClient:
    from prometheus_api_client import PrometheusConnect  # imported where used
    from urllib3.util.retry import Retry

    # No retries: PrometheusConnect's default retries refusals and 5xx answers with backoff,
    # stalling the pass; the next pass is the retry. A timeout: a blackholed address must
    # not hold the reconcile forever.
    client = PrometheusConnect(url=url, disable_ssl=True, retry=Retry(total=0, status_forcelist=()),
                               timeout=timeout_s)
    return CountingClient(client, reader, url)
