"""The MetricsAvailable condition: whether the autotuner's last read of Prometheus gave it
data to decide on, and if not, why, with the URL and the error (the autotuner holds every
setting meanwhile; the diagnosis is NoData).

    True   MetricsRead            the deployment's signals were read
    False  PrometheusUnreachable  no HTTP answer (refused, timed out, unknown host)
    False  BadResponse            an answer that is not query data (HTTP error, not JSON,
                                  wrong shape)
    False  NoData                 well-formed answers without the signals a decision needs
                                  (no series yet, stale samples, NaN or infinite values)
"""
from __future__ import annotations

from ...api.status import Condition
from .client import BAD_RESPONSE, UNREACHABLE, MetricsUnavailable
from ..signals import MetricsSnapshot

METRICS_CONDITION = "MetricsAvailable"


def metrics_condition(url: str, snap: MetricsSnapshot | None, error: Exception | None) -> Condition:
    if error is not None:
        reason = error.reason if isinstance(error, MetricsUnavailable) else BAD_RESPONSE
        detail = error.detail if isinstance(error, MetricsUnavailable) else f"{type(error).__name__}: {error}"
        verb = "cannot reach" if reason == UNREACHABLE else "no usable answer from"
        return Condition(type=METRICS_CONDITION, status="False", reason=reason,
                         message=f"{verb} Prometheus at {url}: {detail}; holding every setting")
    why = snap.no_data_reason() if snap is not None else "nothing was read"
    if why is not None:
        return Condition(type=METRICS_CONDITION, status="False", reason="NoData",
                         message=f"Prometheus at {url} has no usable data for this deployment: {why}; "
                                 f"holding every setting")
    return Condition(type=METRICS_CONDITION, status="True", reason="MetricsRead",
                     message=f"the deployment's signals were read from Prometheus at {url}")
