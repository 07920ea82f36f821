"""Scale to zero: a pure rule over what Prometheus says about the last idle period.

A deployment with `autoscaling.minReplicas: 0` goes to zero replicas once no request
finished on it for `scaleToZeroAfter`, none is running or waiting, and every pod has been
up at least that long (so the period covers the pods' whole recent life, and a pod just
woken by the gateway is not put back to sleep before its first request lands). Back from
zero is the gateway's job: it holds the request and sets replicas to 1 through the scale
subresource, so the operator learns of it from the API, not by guessing."""
from __future__ import annotations

from dataclasses import dataclass

from .decision import Action, Bounds, Decision, Diagnosis, Settings
from .history import History
from .signals import MetricsSnapshot


@dataclass(frozen=True)
class IdleReport:
    """Over the period ending now, summed over the deployment's pods."""
    requests: float | None  # requests finished in the period (None: no series at all)
    in_flight: float | None  # running + waiting now
    youngest_pod_s: float | None  # seconds since the youngest pod's process started


def quiet(snapshot: MetricsSnapshot) -> bool:
    """No request in the autotuner's own window: only then is the longer period asked about."""
    return all((v or 0) == 0 for v in (snapshot.request_rate_per_s, snapshot.num_running, snapshot.num_waiting))


def _span(seconds: float) -> str:
    return f"{seconds / 60:.0f}m" if seconds >= 120 else f"{seconds:.0f}s"


def last_to_zero(history: History) -> float | None:
    """When this autotuner last took the deployment to zero (an applied change), if ever."""
    times = [e.decision.time for e in history.entries
             if e.applied and (e.decision.change or {}).get("replicas", (None, None))[1] == 0]
    return max(times, default=None)


def scale_to_zero(idle: IdleReport | None, current: Settings, bounds: Bounds, after_s: float,
                  now: float, last_zero: float | None = None) -> Decision | None:
    """The change to zero replicas, or None when the rule does not apply or the period was
    not idle. `last_zero`: when it last went to zero (last_to_zero); within `after_s` of
    that the deployment was woken since, and Prometheus may still hold the old pod's
    series for a few scrapes (its age, not the woken pod's, which reports nothing until
    its process starts), so the rule waits: the woken pod must serve its first request."""
    if bounds.replicas.min != 0 or current.replicas < 1 or current.hpa_owns_scale or idle is None:
        return None
    if last_zero is not None and now - last_zero < after_s:
        return None
    if idle.requests is None or idle.requests > 0 or (idle.in_flight or 0) > 0:
        return None
    if idle.youngest_pod_s is None or idle.youngest_pod_s < after_s:
        return None
    return Decision(now, Diagnosis.IDLE, Action.CHANGE,
                    f"no request for {_span(after_s)} and every pod up at least that long "
                    f"(youngest {_span(idle.youngest_pod_s)}): scale {current.replicas} -> 0 (minReplicas 0); "
                    f"the gateway holds the next request and scales back to 1",
                    change={"replicas": (current.replicas, 0)})
