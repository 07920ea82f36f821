"""A scale-in waits for calm intervals that cover a replica's start-up as seen here (the
ski-rental rule, scale_in.calm_needed): five before any start-up was seen, three at the
least, and up to the twenty intervals the history keeps where pods take minutes to start."""

from __future__ import annotations

from dataclasses import replace

from kvpilot.operator.autotune import Action, Decision, Diagnosis, History, Thresholds
from kvpilot.operator.autotune.report import build_report, history_from_status
from kvpilot.operator.autotune.scale_in import calm_needed

from test_autotune_no_harm import CUR, T0, run_intervals, snap

T = Thresholds(tpot_objective_s=0.05, cooldown_s=60.0)
ADDED = Decision(T0 - 1000, Diagnosis.HARDWARE_BOUND, Action.CHANGE, "queue", change={"replicas": (1, 2)})


def _started(startup_s: float) -> History:
    """A history in which a scale-out 1 -> 2 applied at T0 - 1000 saw its pod report `startup_s` later."""
    return History().saw_pods(T0 - 1100, 1).record(ADDED, applied=True).saw_pods(T0 - 1000 + startup_s, 2)


def _every_15s(h: History, n: int, start: float) -> History:
    for k in range(n):
        h = h.record(Decision(start + 15 * k, Diagnosis.HEALTHY, Action.HOLD, "calm"), applied=False)
    return h


def test_the_start_up_is_timed_from_the_scale_out_to_its_pods_reporting():
    h = _started(75.0)
    assert h.startup_s == 75.0 and h.grown == (T0 - 925, 2)
    # A pod that goes and comes back on its own (a restart) times nothing.
    again = h.saw_pods(T0 - 800, 1).saw_pods(T0 - 700, 2)
    assert again.startup_s == 75.0 and again.grown == (T0 - 700, 2)
    # Nothing before a scale-out was seen; and it survives an operator restart (status.autotune).
    assert History().saw_pods(T0, 1).saw_pods(T0 + 15, 2).startup_s is None
    restored = history_from_status(build_report(ADDED, h).dump())
    assert restored.startup_s == 75.0


def test_the_calm_a_scale_in_waits_for_covers_the_start_up():
    assert calm_needed(_every_15s(History(), 3, T0), 60.0, T)[0] == T.scale_in_windows == 5  # none seen yet
    # n calm intervals 15 s apart see (n - 1) x 15 s + the 60 s window of calm.
    assert calm_needed(_every_15s(_started(60.0), 3, T0), 60.0, T)[0] == 3  # the floor
    assert calm_needed(_every_15s(_started(120.0), 3, T0), 60.0, T)[0] == 5
    n, why = calm_needed(_every_15s(_started(600.0), 3, T0), 60.0, T)
    assert n == 20 and "a replica took 600s to start here" in why  # at most what the history keeps


def test_a_replica_that_starts_in_a_minute_goes_sooner_than_one_that_takes_ten():
    cur = replace(CUR, replicas=2)
    calm = snap(num_running=3.0, kv_usage_max=0.02)
    removed = {}
    for startup in (60.0, 600.0):
        decisions, after = run_intervals([calm] * 24, cur, t=T, history=_started(startup))
        assert after.replicas == 1
        k = next(k for k, d in enumerate(decisions) if d.change.get("replicas") == (2, 1))
        removed[startup] = k
        assert f"a replica took {startup:.0f}s to start here" in decisions[k].reason
    assert removed == {60.0: 2, 600.0: 19}, removed
