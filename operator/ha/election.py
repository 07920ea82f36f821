"""Leader election over a coordination.k8s.io/v1 Lease: the pure decisions.

The semantics are client-go's leaderelection (what controller-runtime uses):

- the Lease's spec holds holderIdentity, leaseDurationSeconds, acquireTime,
  renewTime and leaseTransitions;
- a candidate never compares its clock with the renewTime another process wrote
  (clocks differ between nodes): it remembers when *it* last saw the record
  change, on its own monotonic clock, and takes the Lease over only after the
  record has stayed unchanged for leaseDurationSeconds;
- every write carries the resourceVersion that was read, so of two candidates
  that both saw an expired Lease only one write succeeds (the other gets 409);
- a leader that cannot renew within renewDeadline of its last successful renew
  gives up (renewDeadline < leaseDuration, so it stops before anyone else may
  take over);
- a released Lease (empty holderIdentity) may be taken at once.

leader.py runs these against the API server; everything here is a function of
its arguments, so the edge cases are unit-tested without a cluster.
"""
from __future__ import annotations

import datetime as dt
import enum
from dataclasses import dataclass, replace

# client-go's leaderelection.JitterFactor: a renew deadline must leave room for
# more than one retry.
JITTER_FACTOR = 1.2


@dataclass(frozen=True)
class ElectionTiming:
    """controller-runtime's defaults: 15 s lease, 10 s renew deadline, 2 s retry period."""

    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("lease_duration_s", "renew_deadline_s", "retry_period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not self.lease_duration_s > self.renew_deadline_s:
            raise ValueError(f"renew_deadline_s ({self.renew_deadline_s}) must be shorter than "
                             f"lease_duration_s ({self.lease_duration_s})")
        if not self.renew_deadline_s > JITTER_FACTOR * self.retry_period_s:
            raise ValueError(f"renew_deadline_s ({self.renew_deadline_s}) must exceed "
                             f"{JITTER_FACTOR} x retry_period_s ({self.retry_period_s})")


def format_micro_time(t: dt.datetime) -> str:
    """A Kubernetes MicroTime: RFC 3339 in UTC with microseconds."""
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_micro_time(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


@dataclass(frozen=True)
class LeaseRecord:
    """The election fields of one Lease as read (resource_version: the read's, for the write)."""

    holder: str = ""
    lease_duration_s: int = 0
    acquire_time: str | None = None
    renew_time: str | None = None
    transitions: int = 0
    resource_version: str | None = None

    @classmethod
    def from_lease(cls, lease: dict) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(holder=spec.get("holderIdentity") or "",
                   lease_duration_s=int(spec.get("leaseDurationSeconds") or 0),
                   acquire_time=spec.get("acquireTime"), renew_time=spec.get("renewTime"),
                   transitions=int(spec.get("leaseTransitions") or 0),
                   resource_version=(lease.get("metadata") or {}).get("resourceVersion"))

    def spec(self) -> dict:
        out: dict = {"holderIdentity": self.holder, "leaseDurationSeconds": self.lease_duration_s,
                     "leaseTransitions": self.transitions}
        if self.acquire_time:
            out["acquireTime"] = self.acquire_time
        if self.renew_time:
            out["renewTime"] = self.renew_time
        return out

    def same_term(self, other: LeaseRecord) -> bool:
        """Whether nobody wrote the election fields in between (a renew changes renewTime)."""
        return (self.holder, self.renew_time, self.acquire_time, self.transitions, self.lease_duration_s) == (
            other.holder, other.renew_time, other.acquire_time, other.transitions, other.lease_duration_s)


@dataclass(frozen=True)
class Observation:
    """A record and when this candidate first saw it, on its own monotonic clock."""

    record: LeaseRecord
    observed_at: float


def observe(previous: Observation | None, record: LeaseRecord, now: float) -> Observation:
    """Keep the first-seen time while the record is unchanged; restart it when it changed."""
    if previous is not None and previous.record.same_term(record):
        return Observation(record, previous.observed_at)
    return Observation(record, now)


class Action(enum.Enum):
    CREATE = "create"    # no Lease yet: create it, holding it
    ACQUIRE = "acquire"  # free or expired: take it over (leaseTransitions + 1)
    RENEW = "renew"      # mine: bump renewTime
    WAIT = "wait"        # held by someone else and still valid


@dataclass(frozen=True)
class Step:
    action: Action
    record: LeaseRecord | None  # what to write (with the read's resourceVersion); None for WAIT
    reason: str


def expires_at(observation: Observation, timing: ElectionTiming) -> float:
    """When the observed record expires on this candidate's clock. The holder's own
    leaseDurationSeconds counts (it may run with other settings); a Lease without one
    gets ours."""
    duration = observation.record.lease_duration_s or timing.lease_duration_s
    return observation.observed_at + duration


def next_step(observation: Observation | None, me: str, now: float, wall_now: dt.datetime,
              timing: ElectionTiming) -> Step:
    """What candidate `me` does at monotonic time `now` (wall_now only goes into the record)."""
    if not me:
        raise ValueError("identity must not be empty (an empty holderIdentity means released)")
    stamp = format_micro_time(wall_now)
    duration = max(1, round(timing.lease_duration_s))
    if observation is None:
        return Step(Action.CREATE, LeaseRecord(me, duration, stamp, stamp, 0, None), "no Lease yet")
    rec = observation.record
    if rec.holder == me:
        return Step(Action.RENEW, replace(rec, lease_duration_s=duration, renew_time=stamp,
                                          acquire_time=rec.acquire_time or stamp), "held by me")
    if rec.holder:
        left = expires_at(observation, timing) - now
        if left > 0:
            return Step(Action.WAIT, None, f"held by {rec.holder} (expires in {left:.1f}s unless renewed)")
        reason = f"{rec.holder} did not renew for {now - observation.observed_at:.1f}s"
    else:
        reason = "released"
    return Step(Action.ACQUIRE, replace(rec, holder=me, lease_duration_s=duration, acquire_time=stamp,
                                        renew_time=stamp, transitions=rec.transitions + 1), reason)


def released(record: LeaseRecord, wall_now: dt.datetime) -> LeaseRecord:
    """What a leader writes on clean shutdown (client-go's ReleaseOnCancel): no holder,
    a 1 s duration, so the next candidate takes over at its next retry."""
    return replace(record, holder="", lease_duration_s=1, renew_time=format_micro_time(wall_now))


def renew_overdue(last_renew: float | None, now: float, timing: ElectionTiming) -> bool:
    """A leader that has not renewed within the renew deadline has lost the Lease (it must
    stop before another candidate's lease-duration wait ends)."""
    return last_renew is None or now - last_renew >= timing.renew_deadline_s
