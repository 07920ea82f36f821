"""Leader election: election.py's pure decisions (expiry on the candidate's own clock,
another holder, release, clock edges) and leader.py's elector against an in-memory
Lease store with resourceVersion semantics (two candidates, one winner; 409s; renew
deadline; release)."""
from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from kvpilot.operator.ha import election
from kvpilot.operator.ha.election import (Action, ElectionTiming, LeaseRecord, Observation, next_step, observe,
                                       renew_overdue)
from kvpilot.operator.ha.leader import HoldEnd, LeaderElector, WriteConflict

WALL = dt.datetime(2026, 12, 2, 10, 0, 0, tzinfo=dt.timezone.utc)
T = ElectionTiming()  # 15 / 10 / 2


def held(holder="a", renew="2026-12-02T09:59:59.000000Z", duration=15, transitions=0, rv="1") -> LeaseRecord:
    return LeaseRecord(holder, duration, "2026-12-02T09:00:00.000000Z", renew, transitions, rv)


# --- timing ------------------------------------------------------------------------------
def test_defaults_are_controller_runtimes():
    assert (T.lease_duration_s, T.renew_deadline_s, T.retry_period_s) == (15.0, 10.0, 2.0)


@pytest.mark.parametrize("args, field", [((15, 15, 2), "renew_deadline_s"), ((10, 12, 2), "renew_deadline_s"),
                                          ((15, 2, 2), "renew_deadline_s"), ((0, 10, 2), "lease_duration_s"),
                                          ((15, 10, -1), "retry_period_s")])
def test_bad_timing_is_refused_naming_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        ElectionTiming(*args)


# --- decisions -----------------------------------------------------------------------------
def test_no_lease_is_created_holding_it():
    step = next_step(None, "me", 100.0, WALL, T)
    assert step.action is Action.CREATE
    assert step.record.holder == "me" and step.record.transitions == 0 and step.record.lease_duration_s == 15
    assert step.record.acquire_time == step.record.renew_time == "2026-12-02T10:00:00.000000Z"
    assert step.record.resource_version is None


def test_another_holders_valid_lease_is_waited_on():
    obs = Observation(held("a"), observed_at=100.0)
    step = next_step(obs, "me", 114.9, WALL, T)
    assert step.action is Action.WAIT and step.record is None and "held by a" in step.reason


def test_expiry_is_measured_on_my_clock_from_when_i_saw_the_record_not_from_its_renew_time():
    # renewTime says an hour ago (skewed clock on the holder's node): still valid for 15 s after I saw it
    stale = held("a", renew="2026-12-02T09:00:00.000000Z")
    assert next_step(Observation(stale, 100.0), "me", 101.0, WALL, T).action is Action.WAIT
    # renewTime in the future (skew the other way) does not extend it either
    future = held("a", renew="2026-12-03T00:00:00.000000Z")
    assert next_step(Observation(future, 100.0), "me", 115.0, WALL, T).action is Action.ACQUIRE


def test_expiry_boundary_is_exactly_the_lease_duration():
    obs = Observation(held("a"), 100.0)
    assert next_step(obs, "me", 100.0 + 15 - 1e-6, WALL, T).action is Action.WAIT
    step = next_step(obs, "me", 115.0, WALL, T)
    assert step.action is Action.ACQUIRE
    assert step.record.holder == "me" and step.record.transitions == 1 and step.record.resource_version == "1"
    assert step.record.acquire_time == step.record.renew_time == "2026-12-02T10:00:00.000000Z"


def test_holders_own_duration_counts_and_a_missing_one_gets_mine():
    assert next_step(Observation(held("a", duration=60), 0.0), "me", 30.0, WALL, T).action is Action.WAIT
    assert next_step(Observation(held("a", duration=0), 0.0), "me", 14.0, WALL, T).action is Action.WAIT
    assert next_step(Observation(held("a", duration=0), 0.0), "me", 15.0, WALL, T).action is Action.ACQUIRE


def test_clock_before_the_observation_never_expires_it():
    assert next_step(Observation(held("a"), 100.0), "me", 50.0, WALL, T).action is Action.WAIT


def test_a_renewed_record_restarts_the_wait():
    first = observe(None, held("a", renew="2026-12-02T09:59:59.000000Z"), 100.0)
    same = observe(first, held("a", renew="2026-12-02T09:59:59.000000Z", rv="1"), 110.0)
    assert same.observed_at == 100.0
    renewed = observe(same, held("a", renew="2026-12-02T10:00:09.000000Z", rv="2"), 112.0)
    assert renewed.observed_at == 112.0
    assert next_step(renewed, "me", 120.0, WALL, T).action is Action.WAIT  # 100 + 15 passed, 112 + 15 not
    handed = observe(renewed, held("b", renew="2026-12-02T10:00:09.000000Z", transitions=1), 113.0)
    assert handed.observed_at == 113.0


def test_my_own_lease_is_renewed_keeping_acquire_time_and_transitions():
    rec = held("me", transitions=3)
    step = next_step(Observation(rec, 0.0), "me", 1000.0, WALL, T)  # even long after: it is mine
    assert step.action is Action.RENEW
    assert step.record.acquire_time == rec.acquire_time and step.record.transitions == 3
    assert step.record.renew_time == "2026-12-02T10:00:00.000000Z" and step.record.resource_version == "1"


def test_a_released_lease_is_taken_at_once():
    rel = election.released(held("a", transitions=2), WALL)
    assert rel.holder == "" and rel.lease_duration_s == 1
    step = next_step(Observation(rel, 100.0), "me", 100.0, WALL, T)
    assert step.action is Action.ACQUIRE and step.record.transitions == 3 and step.reason == "released"


def test_empty_identity_is_refused():
    with pytest.raises(ValueError, match="identity"):
        next_step(None, "", 0.0, WALL, T)


def test_renew_deadline():
    assert renew_overdue(None, 0.0, T)
    assert not renew_overdue(100.0, 109.9, T)
    assert renew_overdue(100.0, 110.0, T)


def test_lease_round_trip():
    lease = {"metadata": {"resourceVersion": "42"},
             "spec": {"holderIdentity": "p", "leaseDurationSeconds": 15, "acquireTime": "x", "renewTime": "y",
                      "leaseTransitions": 4}}
    rec = LeaseRecord.from_lease(lease)
    assert rec == LeaseRecord("p", 15, "x", "y", 4, "42") and rec.spec() == lease["spec"]
    assert LeaseRecord.from_lease({"spec": {}}) == LeaseRecord()
    assert election.parse_micro_time(election.format_micro_time(WALL)) == WALL
    assert election.parse_micro_time("garbage") is None


# --- the elector against an in-memory API with optimistic concurrency ---------------------
class FakeStore:
    """One Lease, with the API server's resourceVersion check on create and replace."""

    def __init__(self):
        self.lease: LeaseRecord | None = None
        self.version = 0
        self.fail = False
        self.writes = []

    def get(self):
        if self.fail:
            raise ConnectionError("API server unreachable")
        return self.lease

    def _commit(self, record):
        self.version += 1
        self.lease = LeaseRecord(**{**record.__dict__, "resource_version": str(self.version)})
        self.writes.append(self.lease)
        return self.lease

    def create(self, record):
        if self.fail:
            raise ConnectionError("API server unreachable")
        if self.lease is not None:
            raise WriteConflict("409 AlreadyExists")
        return self._commit(record)

    def replace(self, record):
        if self.fail:
            raise ConnectionError("API server unreachable")
        if self.lease is None or record.resource_version != self.lease.resource_version:
            raise WriteConflict("409 Conflict")
        return self._commit(record)


class Clock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def elector(store, name, clock, changes=None):
    return LeaderElector(store, name, T, clock=clock, wall=lambda: WALL + dt.timedelta(seconds=clock.t),
                         on_change=(changes.append if changes is not None else (lambda v: None)))


def test_first_candidate_creates_the_second_waits_then_takes_over_after_the_lease_duration():
    store, clock, changes = FakeStore(), Clock(), []
    a, b = elector(store, "a", clock), elector(store, "b", clock, changes)
    assert a.try_once() and a.is_leader
    assert not b.try_once() and not b.is_leader
    clock.t = 14.0
    assert not b.try_once()  # a stopped renewing at 0; b saw the record at 0
    clock.t = 15.0
    assert b.try_once() and b.is_leader and changes == [True]
    assert store.lease.holder == "b" and store.lease.transitions == 1


def test_two_candidates_racing_on_an_expired_lease_cannot_both_win():
    store, clock = FakeStore(), Clock()
    old = elector(store, "old", clock)
    assert old.try_once()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    assert not a.try_once() and not b.try_once()
    clock.t = 20.0
    # both read the same expired record, then write: the second write carries a stale resourceVersion
    rec = store.get()
    for c in (a, b):
        c.observation = observe(c.observation, rec, clock.t)
    steps = [next_step(c.observation, c.identity, clock.t, WALL, T) for c in (a, b)]
    assert [s.action for s in steps] == [Action.ACQUIRE, Action.ACQUIRE]
    store.replace(steps[0].record)
    with pytest.raises(WriteConflict):
        store.replace(steps[1].record)
    assert store.lease.holder == "a"


def test_conflict_on_create_means_someone_else_won():
    store, clock = FakeStore(), Clock()
    a = elector(store, "a", clock)
    store.get = lambda: None  # a reads "no Lease" ...
    store.lease = held("b", rv="7")  # ... but b created it meanwhile
    assert not a.try_once() and not a.is_leader


def test_leader_renews_and_sees_a_takeover_as_loss():
    store, clock, changes = FakeStore(), Clock(), []
    a = elector(store, "a", clock, changes)
    assert a.try_once()
    clock.t = 2.0
    assert a.try_once() and store.lease.renew_time.endswith("10:00:02.000000Z") and store.lease.transitions == 0
    store.lease = LeaseRecord("b", 15, "t", "t", 1, "99")  # b took it (a was partitioned too long)
    assert not a.try_once() and not a.is_leader and changes == [True, False]


def test_hold_returns_when_no_renew_succeeds_within_the_deadline():
    store, clock = FakeStore(), Clock()
    a = LeaderElector(store, "a", ElectionTiming(0.5, 0.3, 0.05), clock=clock)
    assert a.try_once()
    store.fail = True

    async def run():
        async def advance():
            while True:
                await asyncio.sleep(0.01)
                clock.t += 0.01
        ticker = asyncio.create_task(advance())
        end = await asyncio.wait_for(a.hold(), timeout=5)
        ticker.cancel()
        return clock.t, end
    lost_at, end = asyncio.run(run())
    assert end is HoldEnd.OVERDUE
    assert 0.3 <= lost_at < 0.5 and not a.is_leader  # before anyone could take it over (0.5)


def run_hold_on_a_fake_clock(a: LeaderElector, clock: Clock, during) -> HoldEnd | None:
    """hold() with the fake clock moving 0.01 s per loop tick; `during(t)` runs at each tick
    (it changes the store); returns what hold() returned, or None if it still holds at t=2."""
    async def run():
        holding = asyncio.create_task(a.hold())
        while clock.t < 2.0 and not holding.done():
            during(clock.t)
            await asyncio.sleep(0.01)
            clock.t += 0.01
        if holding.done():
            return holding.result()
        holding.cancel()
        return None
    return asyncio.run(run())


def test_hold_after_overdue_renews_once_the_api_answers_and_leads_again():
    store, clock, changes = FakeStore(), Clock(), []
    a = LeaderElector(store, "a", ElectionTiming(0.5, 0.3, 0.05), clock=clock, on_change=changes.append)
    assert a.try_once()
    store.fail = True
    assert run_hold_on_a_fake_clock(a, clock, lambda t: None) is HoldEnd.OVERDUE and not a.holds()
    # the API server answers again: nobody wrote the Lease meanwhile, so the renew succeeds
    store.fail = False
    assert run_hold_on_a_fake_clock(a, clock, lambda t: None) is None
    assert a.is_leader and a.holds() and store.lease.holder == "a" and store.lease.transitions == 0
    assert changes == [True, False, True]


def test_hold_returns_taken_when_another_candidate_holds_the_lease():
    store, clock = FakeStore(), Clock()
    a = LeaderElector(store, "a", ElectionTiming(0.5, 0.3, 0.05), clock=clock)
    assert a.try_once()

    def steal(t):
        if t >= 0.1 and store.lease.holder == "a":
            store.lease = LeaseRecord("b", 15, "t", "t", 1, "99")
    assert run_hold_on_a_fake_clock(a, clock, steal) is HoldEnd.TAKEN and not a.is_leader


def test_a_standby_that_could_not_read_waits_a_whole_lease_from_its_next_read():
    """An API server restart that both candidates see: the standby does not count the outage
    against the leader, so the leader's renew after the outage keeps the Lease."""
    store, clock = FakeStore(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    assert a.try_once() and not b.try_once()
    store.fail = True
    clock.t = 5.0
    assert not b._attempt()  # the outage: b's read fails
    store.fail = False
    clock.t = 20.0  # past the 15 s lease since b last saw the record change
    assert not b._attempt() and store.lease.holder == "a"  # first read after the outage: wait
    clock.t = 21.0
    assert a.try_once() and store.lease.holder == "a"  # the leader renews: the record changed
    clock.t = 22.0
    assert not b._attempt()  # b sees the renewed record at 22
    clock.t = 36.9
    assert not b._attempt()
    clock.t = 37.0  # a stopped renewing at 21: b takes over a whole lease after it saw that
    assert b._attempt() and store.lease.holder == "b"


def test_hold_survives_a_short_outage():
    store, clock = FakeStore(), Clock()
    a = LeaderElector(store, "a", ElectionTiming(0.5, 0.3, 0.05), clock=clock)
    assert a.try_once()

    async def run():
        store.fail = True
        holding = asyncio.create_task(a.hold())
        for _ in range(10):  # 0.1 s of failures on the fake clock
            await asyncio.sleep(0.01)
            clock.t += 0.01
        store.fail = False
        for _ in range(40):
            await asyncio.sleep(0.01)
            clock.t += 0.01
        done = holding.done()
        holding.cancel()
        return done
    assert asyncio.run(run()) is False and a.is_leader and store.lease.holder == "a"


def test_release_hands_over_at_the_next_retry():
    store, clock = FakeStore(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    assert a.try_once() and not b.try_once()
    assert a.release() and not a.is_leader and store.lease.holder == ""
    clock.t = 2.0
    assert b.try_once() and store.lease.holder == "b" and store.lease.transitions == 1
    assert not a.release()  # not the leader: nothing to give up


def test_holds_is_false_once_the_renew_deadline_passed_even_before_the_loop_notices():
    store, clock = FakeStore(), Clock()
    a = elector(store, "a", clock)
    assert not a.holds()
    assert a.try_once() and a.holds()
    clock.t = 9.9
    assert a.holds()
    clock.t = 10.0  # e.g. the process was frozen: no renew for the whole deadline
    assert not a.holds() and a.is_leader
