"""Leader election against the API server: the Lease reads and writes, and the
acquire / hold loops that election.py's decisions drive.

A 409 on a write means another candidate wrote the Lease since this one read
it (optimistic concurrency on resourceVersion): this candidate did not win,
and reads again at the next retry."""
from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import enum
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from . import election
from .election import Action, ElectionTiming, LeaseRecord, Observation

log = logging.getLogger(__name__)
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


class LeaseStore(Protocol):
    def get(self) -> LeaseRecord | None: ...
    def create(self, record: LeaseRecord) -> LeaseRecord: ...
    def replace(self, record: LeaseRecord) -> LeaseRecord: ...


class WriteConflict(Exception):
    """409: the Lease changed (or appeared) since it was read."""


class KubeLeaseStore:
    """One named Lease through the operator's Kube client (get/create/replace)."""

    def __init__(self, kube, namespace: str, name: str):
        self.kube, self.namespace, self.name = kube, namespace, name

    def _manifest(self, record: LeaseRecord) -> dict:
        meta: dict = {"name": self.name, "namespace": self.namespace}
        if record.resource_version:
            meta["resourceVersion"] = record.resource_version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": record.spec()}

    def _send(self, method: str, path: str, record: LeaseRecord) -> LeaseRecord:
        from kubernetes.client.exceptions import ApiException
        try:
            return LeaseRecord.from_lease(self.kube._call(method, path, self._manifest(record)))
        except ApiException as e:
            if e.status == 409:
                raise WriteConflict(f"{method} lease {self.namespace}/{self.name}: 409") from e
            raise

    def get(self) -> LeaseRecord | None:
        from kubernetes.client.exceptions import ApiException
        try:
            return LeaseRecord.from_lease(self.kube._call("GET", LEASES.format(ns=self.namespace) + f"/{self.name}"))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create(self, record: LeaseRecord) -> LeaseRecord:
        return self._send("POST", LEASES.format(ns=self.namespace), record)

    def replace(self, record: LeaseRecord) -> LeaseRecord:
        return self._send("PUT", LEASES.format(ns=self.namespace) + f"/{self.name}", record)


class HoldEnd(enum.Enum):
    TAKEN = "taken"      # another candidate holds the Lease: this process must stop for good
    OVERDUE = "overdue"  # no renew within the renew deadline (API server unreachable, a freeze)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


@dataclass
class LeaderElector:
    """One candidate. `try_once` is one read-decide-write round (blocking); `acquire` and
    `hold` are the async loops around it. `on_change(is_leader)` is called on every
    transition (metric and log)."""

    store: LeaseStore
    identity: str
    timing: ElectionTiming = field(default_factory=ElectionTiming)
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], dt.datetime] = utcnow
    on_change: Callable[[bool], None] = lambda is_leader: None
    observation: Observation | None = None
    last_renew: float | None = None
    is_leader: bool = False

    def _set_leader(self, value: bool) -> None:
        if value != self.is_leader:
            self.is_leader = value
            self.on_change(value)

    def try_once(self) -> bool:
        """Read the Lease, decide, write. True when this candidate holds it afterwards."""
        record = self.store.get()
        now = self.clock()
        self.observation = None if record is None else election.observe(self.observation, record, now)
        step = election.next_step(self.observation, self.identity, now, self.wall(), self.timing)
        if step.action is Action.WAIT:
            if self.is_leader:  # someone else took it: this process is no longer the leader
                log.error("leader election: lost the Lease: %s", step.reason)
                self._set_leader(False)
            return False
        try:
            if step.action is Action.CREATE:
                written = self.store.create(step.record)
            else:
                written = self.store.replace(step.record)
        except WriteConflict as e:
            log.info("leader election: %s lost a race (%s)", step.action.value, e)
            return False
        self.observation = Observation(written, now)
        self.last_renew = now
        if step.action is not Action.RENEW:
            log.info("leader election: %s is now the leader (%s; %s)", self.identity, step.action.value, step.reason)
        self._set_leader(True)
        return True

    def holds(self) -> bool:
        """Whether this process may act as the leader now: it holds the Lease and renewed it
        within the renew deadline. After a freeze (SIGSTOP, a VM pause, a long GC) the
        monotonic clock has moved on, so this says False before the hold loop has even
        noticed: the operator checks it before each reconcile pass."""
        return self.is_leader and not election.renew_overdue(self.last_renew, self.clock(), self.timing)

    def _attempt(self) -> bool:
        try:
            return self.try_once()
        except Exception as e:  # API server unreachable, 5xx, RBAC: retry; the deadline decides
            log.warning("leader election: %s", e)
            # Forget when the record was last seen to change: a candidate that could not read
            # cannot tell a leader that stopped renewing from an outage they share (an API
            # server restart), so after one it waits a whole lease duration from its first
            # successful read, and the leader, renewing at its next retry, keeps the Lease.
            self.observation = None
            return False

    def taken(self) -> bool:
        """Whether the last read saw the Lease held by another candidate."""
        return self.observation is not None and self.observation.record.holder not in ("", self.identity)

    def _pause(self) -> float:
        # client-go's wait.JitterUntil: a retry period plus up to JITTER_FACTOR of it
        return self.timing.retry_period_s * (1 + random.random() * (election.JITTER_FACTOR - 1))

    async def acquire(self) -> None:
        """Return once this candidate holds the Lease (a standby waits here)."""
        while not await asyncio.to_thread(self._attempt):
            await asyncio.sleep(self._pause())

    async def hold(self) -> HoldEnd:
        """Renew every retry period. Return TAKEN when another candidate holds the Lease, and
        OVERDUE (no longer the leader) when no renew succeeded within the renew deadline.
        Called again after OVERDUE, it keeps trying: a renew that then succeeds (the Lease
        still names this candidate, at the resourceVersion just read, so nobody led in
        between) makes it the leader again."""
        while True:
            await asyncio.sleep(self.timing.retry_period_s)
            if await asyncio.to_thread(self._attempt):
                continue
            if self.taken():
                self._set_leader(False)
                return HoldEnd.TAKEN
            if self.is_leader and election.renew_overdue(self.last_renew, self.clock(), self.timing):
                log.error("leader election: no renew for %.1fs (renew deadline %.1fs)",
                          self.clock() - (self.last_renew or 0), self.timing.renew_deadline_s)
                self._set_leader(False)
                return HoldEnd.OVERDUE

    def release(self) -> bool:
        """Give the Lease up on a clean shutdown, so a standby takes over at its next retry."""
        if not self.is_leader:
            return False
        try:
            record = self.store.get()
            if record is None or record.holder != self.identity:
                return False
            self.store.replace(election.released(record, self.wall()))
            log.info("leader election: %s released the Lease", self.identity)
            return True
        except Exception as e:  # the Lease expires on its own
            log.warning("leader election: releasing the Lease failed: %s", e)
            return False
        finally:
            self._set_leader(False)


class PassGate:
    """Fences the operator's passes (reconcile, autotune) by the Lease. A pass runs inside
    `acting()`, which admits it only while `holds()` and counts it until it ends, so a leader
    whose renew deadline passed knows whether anything of its own may still write: if nothing
    is in flight it can stay up and wait to renew; if a pass is, only exiting stops it."""

    def __init__(self, holds: Callable[[], bool]):
        self._holds = holds
        self._lock = threading.Lock()
        self._in_flight = 0

    def __call__(self) -> bool:
        return self._holds()

    @contextlib.contextmanager
    def acting(self) -> Iterator[bool]:
        """Yields whether the pass may act; one that may is counted while it runs."""
        with self._lock:
            admitted = self._holds()
            self._in_flight += admitted
        try:
            yield admitted
        finally:
            if admitted:
                with self._lock:
                    self._in_flight -= 1

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight
