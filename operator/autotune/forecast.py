"""Capacity ahead of load, from the traffic's own history: when the deployment's request
rate a period ago (a day, spec'd as the traffic's season) rose soon after this time of
day, the replicas it came to hold for that rise are started now, a pod's start-up ahead
of it (and no earlier), instead of a few intervals after the queue has built.

Pure functions of the History (the request rate and serving replicas the autotuner saw
at each interval, as Prometheus showed them: `vllm:request_success_total`'s rate and the
pods reporting) and the Thresholds; never the traffic itself. A forecast needs a whole
season of history, a rise of at least `forecast_rise` x in the rate a period ago, and
only ever asks for what the deployment then held, scaled down where today's rate is
lower than the rate then: it adds capacity before a rise it has seen, and otherwise
leaves every decision to the rules."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .decision import Bounds, Settings, Thresholds
from .history import History
from .signals import MetricsSnapshot


@dataclass(frozen=True)
class Forecast:
    """What a period ago says about the next `lead_s`: a rise, and the replicas it came to hold."""

    replicas: int  # what the deployment should hold now, ahead of the rise
    held_then: int  # the most replicas it served with in the settle time after the rise a period ago
    rate_then: float  # request rate a period ago at this time of day (req/s)
    rate_peak_then: float  # its highest rate in that time
    rate_now: float
    level: float  # today's rate / the rate then (at most 1: a forecast never asks for more)
    lead_s: float  # the rise comes within this (a pod's start-up and an interval)
    points: int  # history points the forecast read

    def reason(self) -> str:
        return (f"a period ago the request rate rose from {self.rate_then:.2f}/s to {self.rate_peak_then:.2f}/s "
                f"within the next {self.lead_s:.0f}s and {self.held_then} replica(s) came to serve it; today's rate "
                f"{self.rate_now:.2f}/s is x{self.level:.2f} of then, so {self.replicas} replica(s) ahead of the "
                f"rise (from {self.points} points of history)")


def record(history: History, s: MetricsSnapshot, replicas: int, t: Thresholds) -> History:
    """The history with this interval's request rate and serving replicas (one point per
    season / season_points seconds, a season and the forecast's horizon kept)."""
    if not t.season_s or s.request_rate_per_s is None:
        return history
    spacing = t.season_s / t.season_points
    if history.rates and s.time - history.rates[-1][0] < spacing:
        return history
    keep = t.season_s + horizon(t) + 2 * spacing
    serving = s.serving(replicas)
    rates = tuple(p for p in history.rates if p[0] >= s.time - keep) + ((s.time, s.request_rate_per_s, serving),)
    return history.with_rates(rates)


def horizon(t: Thresholds) -> float:
    """How far ahead a forecast looks: a new pod's start-up and an interval (the lead),
    plus the time the rules took to settle a rise."""
    return t.forecast_lead_s + t.forecast_settle_s


def forecast(history: History, now: float, t: Thresholds) -> Forecast | None:
    """The replicas a period ago says to hold now, when it saw a rise coming; None with
    no season, too little history (less than a whole season), or no rise ahead."""
    season = t.season_s
    if not season or not history.rates:
        return None
    spacing = season / t.season_points
    pts = history.rates
    if pts[0][0] > now - season - spacing:
        return None  # less than a whole season of history: nothing to learn a day from
    then = [p for p in pts if now - season - 2 * spacing <= p[0] <= now - season]
    ahead = [p for p in pts if now - season < p[0] <= now - season + t.forecast_lead_s]
    if not then or not ahead:
        return None
    rate_then = sum(p[1] for p in then) / len(then)
    level_up = max(t.forecast_rise * max(rate_then, t.idle_rate_per_s), t.forecast_min_rate)
    rise = next((p for p in ahead if p[1] >= level_up), None)
    if rise is None:
        return None  # no rise ahead (a quiet hour after a busy one forecasts nothing)
    if rise[0] - (now - season) > t.forecast_lead_s:
        return None  # not within a start-up yet: replicas started now would only wait
    after = [p for p in pts if rise[0] <= p[0] <= rise[0] + t.forecast_settle_s]
    peak = max(after, key=lambda p: p[1])
    held = max(p[2] for p in after)  # what the rules came to hold for it, once settled
    rate_now = sum(p[1] for p in pts[-2:]) / len(pts[-2:])  # the newest points (one every spacing)
    level = min(1.0, rate_now / rate_then) if rate_then >= t.forecast_min_rate else 1.0
    return Forecast(max(1, math.ceil(held * level - 1e-9)), held, rate_then, peak[1], rate_now, level,
                    t.forecast_lead_s, len(then) + len(after))


def ahead_of_load(s: MetricsSnapshot, cur: Settings, bounds: Bounds, history: History, now: float,
                  t: Thresholds):
    """(change, target, sentence, diagnosis) adding the replicas a forecast asks for, or
    None. Never while an HPA owns the replica count; never past the bounds."""
    f = forecast(history, now, t)
    if f is None or cur.hpa_owns_scale or f.replicas <= cur.replicas:
        return None
    new = bounds.replicas.clamp(f.replicas)
    if new <= cur.replicas:
        return None
    return ({"replicas": (cur.replicas, new)}, None,
            f"capacity ahead of load: {f.reason()}; add {cur.replicas} -> {new}", None)


def holds_capacity(history: History, now: float, t: Thresholds, replicas: int) -> str | None:
    """Why a scale-in to `replicas` would give back capacity a forecast rise needs, or None."""
    f = forecast(history, now, t)
    if f is None or f.replicas <= replicas:
        return None
    return f"keeping the replicas for a forecast rise: {f.reason()}"
