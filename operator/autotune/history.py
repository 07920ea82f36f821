"""The autotuner's memory between intervals: the diagnosis of every recent interval (for
hysteresis and "sustained" rules) and the recent changes with their verification
outcome (for cooldown, verification and revert). Immutable: `record` returns a new
History, so the policy stays a pure function of its inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .decision import Action, Decision, Diagnosis


@dataclass(frozen=True)
class HistoryEntry:
    decision: Decision  # a change or a revert
    applied: bool  # False in Recommend mode: nothing moved, nothing to verify
    checked: bool = False  # its verification window has been judged
    verified: bool | None = None  # the outcome; None while unchecked or when inconclusive


@dataclass(frozen=True)
class Observation:
    """One window of steady load, per replica: the deployment model's data (planner.py)."""

    time: float
    running: float  # mean sequences running per replica
    prompt_tokens_per_s: float  # prompt tokens processed per second per replica
    tpot_s: float  # mean TPOT of the requests that finished in the window


@dataclass(frozen=True)
class History:
    entries: tuple[HistoryEntry, ...] = ()  # changes and reverts, oldest first
    diagnoses: tuple[tuple[float, Diagnosis], ...] = ()  # one per interval, oldest first
    observations: tuple[Observation, ...] = ()  # oldest first
    plans: tuple[tuple[float, int], ...] = ()  # (time, replicas the model planned), oldest first
    # (time, request rate /s, serving replicas), oldest first: the season forecast.py learns from.
    rates: tuple[tuple[float, float, int], ...] = ()
    # (when the pods reporting last grew, how many): a scale-out is judged on a window the
    # grown fleet served whole. None until a change of the count was seen.
    grown: tuple[float, int] | None = None
    pods: int = 0  # the pods reporting at the last interval
    # Seconds from the last scale-out applied to the pods reporting growing after it: how long
    # a replica takes to start here (a scale-in waits as long, scale_in.py). None until seen.
    startup_s: float | None = None
    # (time, good and finished requests/s per replica, replicas), one per interval, oldest
    # first: what a scale-out is checked against (payoff.py).
    good_rates: tuple[tuple[float, float, float, int], ...] = ()
    limit: int = 20
    observation_limit: int = 40

    def observe(self, obs: Observation | None) -> History:
        if obs is None:
            return self
        return replace(self, observations=(self.observations + (obs,))[-self.observation_limit:])

    def saw_pods(self, now: float, n: int) -> History:
        """This interval's count of pods reporting (0: none reported, nothing learnt). Pods that
        grow after a scale-out applied since they last grew time its start-up; pods that come
        back on their own (a restart) time nothing."""
        if n <= 0 or n == self.pods:
            return self
        if not self.pods or n < self.pods:
            return replace(self, pods=n)
        since = self.grown[0] if self.grown else -math.inf
        startup = self.startup_s
        for e in reversed(self.entries):
            old, new = e.decision.change.get("replicas", (0, 0))
            if e.applied and since < e.decision.time <= now and old < n <= new:
                startup = now - e.decision.time
                break
        return replace(self, pods=n, grown=(now, n), startup_s=startup)

    def grown_within(self, now: float, window_s: float) -> float | None:
        """Seconds since the pods reporting grew, when that is less than a window ago."""
        if self.grown is None or now - self.grown[0] >= window_s or self.pods < self.grown[1]:
            return None
        return now - self.grown[0]

    def with_rates(self, rates: tuple[tuple[float, float, int], ...]) -> History:
        return replace(self, rates=rates)

    def record(self, decision: Decision, applied: bool) -> History:
        """This interval's decision added; `applied` says whether the caller applied its
        change (Auto) or only reported it (Recommend). A decision that verified an
        earlier change stamps that change's entry with the outcome."""
        entries = self.entries
        if decision.verifies is not None:
            entries = tuple(
                replace(e, checked=True, verified=decision.verified) if e.decision.time == decision.verifies else e
                for e in entries
            )
        if decision.action is not Action.HOLD and decision.change:
            entries = entries + (HistoryEntry(decision, applied),)
        diagnoses = self.diagnoses + ((decision.time, decision.diagnosis),)
        plans = self.plans
        if decision.planned_replicas is not None:
            plans = (plans + ((decision.time, decision.planned_replicas),))[-self.limit:]
        elif plans:
            plans = ()  # the run of plans is broken: a scale-in waits for a fresh one
        return replace(self, entries=entries[-self.limit:], diagnoses=diagnoses[-self.limit:], plans=plans)

    def with_good(self, now: float, good: float, finished: float, replicas: int) -> History:
        return replace(self, good_rates=(self.good_rates + ((now, good, finished, replicas),))[-self.limit:])

    def recent_good(self, replicas: int) -> tuple[tuple[float, float, float, int], ...]:
        """The good_rates of the latest run of intervals at `replicas`, oldest first."""
        run = []
        for rate in reversed(self.good_rates):
            if rate[3] != replicas:
                break
            run.append(rate)
        return tuple(reversed(run))

    def recent_plans(self, n: int) -> tuple[int, ...]:
        return tuple(r for _, r in self.plans[-n:]) if n > 0 else ()

    def last_diagnosis(self) -> Diagnosis | None:
        return self.diagnoses[-1][1] if self.diagnoses else None

    def recent_diagnoses(self, n: int) -> tuple[Diagnosis, ...]:
        """The last n diagnoses, newest last (fewer when history is short)."""
        return tuple(d for _, d in self.diagnoses[-n:]) if n > 0 else ()

    def last_applied(self) -> HistoryEntry | None:
        for entry in reversed(self.entries):
            if entry.applied:
                return entry
        return None

    def pending_verification(self) -> HistoryEntry | None:
        """The newest applied change still waiting for its verification window."""
        entry = self.last_applied()
        if (entry is not None and not entry.checked
                and entry.decision.action is Action.CHANGE and entry.decision.target is not None):
            return entry
        return None

    def applied_since(self, since: float) -> tuple[HistoryEntry, ...]:
        return tuple(e for e in self.entries if e.applied and e.decision.time >= since)
