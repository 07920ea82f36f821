"""Capacity ahead of load (forecast.py): a season of history in which the request rate
rose is anticipated a pod's start-up ahead the next period; too little history, or no
rise ahead, does nothing; capacity held for a forecast rise is not given back."""

from __future__ import annotations

from dataclasses import replace

from kvpilot.operator.autotune import Action, History, decide
from kvpilot.operator.autotune.decision import Thresholds
from kvpilot.operator.autotune.forecast import forecast, record

from test_autotune_no_harm import BOUNDS, CUR, T0, snap

SEASON = 2700.0  # a compressed day
T = Thresholds(tpot_objective_s=0.05, cooldown_s=60.0, season_s=SEASON)
RISE_AT = 1200.0  # the burst: 3 req/s on one replica, then 72 req/s that came to need 4


def day_history(until: float, start: float = 0.0) -> History:
    """The rate and serving replicas as recorded every 15 s from `start` to `until`
    (seconds after T0): the rise at RISE_AT of each day, reached by the rules a few
    intervals late."""
    h = History()
    t = start
    while t < until:
        d = t % SEASON
        if RISE_AT <= d < RISE_AT + 300:
            rate, replicas = 72.0, min(4, 1 + int((d - RISE_AT) // 45))
        else:
            rate, replicas = 3.0, 1
        s = snap(T0 + t, request_rate_per_s=rate, pods=())
        h = record(h, s, replicas, T)
        t += 15.0
    return h


def test_a_forecast_from_less_than_a_season_does_nothing():
    now = RISE_AT - T.forecast_lead_s
    h = day_history(now)  # the same hour, but no day before it
    assert forecast(h, T0 + now, T) is None
    d = decide(snap(T0 + now, request_rate_per_s=3.0), CUR, BOUNDS, h, T0 + now, thresholds=T)
    assert d.action is Action.HOLD and "replicas" not in d.change


def test_a_rise_seen_the_previous_period_is_anticipated():
    now = SEASON + RISE_AT - T.forecast_lead_s  # a start-up and an interval before the rise
    h = day_history(now)
    f = forecast(h, T0 + now, T)
    assert f is not None and f.replicas == 4 and f.held_then == 4
    d = decide(snap(T0 + now, request_rate_per_s=3.0), CUR, BOUNDS, h, T0 + now, thresholds=T)
    assert d.change == {"replicas": (1, 4)}
    assert "capacity ahead of load" in d.reason and "72.00/s" in d.reason and "4 replica(s)" in d.reason


def test_lower_traffic_today_asks_for_fewer_and_no_season_means_no_forecast():
    now = SEASON + RISE_AT - T.forecast_lead_s
    h = day_history(now)
    h = record(h, snap(T0 + now, request_rate_per_s=1.5, pods=()), 1, T)  # half of yesterday's rate
    h = record(h, snap(T0 + now + 30, request_rate_per_s=1.5, pods=()), 1, T)
    f = forecast(h, T0 + now + 30, T)
    assert f is not None and f.level < 1 and f.replicas < 4
    assert forecast(h, T0 + now, replace(T, season_s=None)) is None


def test_no_rise_ahead_forecasts_nothing_and_a_distant_one_not_yet():
    now = SEASON + RISE_AT + 400  # after the burst: the quiet that followed it
    assert forecast(day_history(now), T0 + now, T) is None
    now = SEASON + RISE_AT - 3 * T.forecast_lead_s  # replicas started now would only wait
    assert forecast(day_history(now), T0 + now, T) is None


def test_capacity_held_for_a_forecast_rise_is_not_given_back():
    now = SEASON + RISE_AT - 30  # replicas added ahead; the rise has not come yet
    h = day_history(now)
    cur = replace(CUR, replicas=4)
    calm = snap(T0 + now, request_rate_per_s=3.0, num_running=3.0, kv_usage_max=0.02)
    for k in range(6):  # calm intervals that would otherwise remove a replica
        d = decide(replace(calm, time=T0 + now + 5 * k), cur, BOUNDS, h, T0 + now + 5 * k, thresholds=T)
        h = h.record(d, applied=d.changes_something)
        assert "replicas" not in d.change or d.change["replicas"][1] >= 4


def test_the_season_of_rates_survives_the_status_round_trip():
    # The operator rebuilds History from status.autotune every pass: the forecast's points live there.
    from kvpilot.operator.autotune.report import build_report, history_from_status

    now = SEASON + RISE_AT - T.forecast_lead_s
    h = day_history(now)
    d = decide(snap(T0 + now, request_rate_per_s=3.0), CUR, BOUNDS, h, T0 + now, thresholds=T)
    h = h.record(d, applied=True)
    back = history_from_status(build_report(d, h).dump())
    assert len(back.rates) == len(h.rates) <= 128
    assert forecast(back, T0 + now, T) == forecast(h, T0 + now, T)
