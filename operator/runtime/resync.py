"""The resync's worker pool: one reconcile per LLMDeployment of a pass, at most
`max_concurrent` at once, each in a worker thread.

Why: a reconcile blocks (API calls, the autotuner's Prometheus reads). Run one after
another, a fleet of N waits N x t between passes, and one slow deployment (a Prometheus
that times out) delays every other. Here a pass submits every object to a pool of
`max_concurrent` threads of its own (not asyncio's default executor, whose size follows
the CPU count and which kopf's sync handlers share), so:

- the event loop never blocks, and a pass over N objects takes about N / bound x t;
- an object whose previous pass is still queued or running is skipped, not queued twice
  (so a backlog never grows past one entry per object, and one object never has two
  passes at once); the next pass picks it up again;
- an exception in one reconcile is logged and counted, and the others go on.

The per-object lock that also serializes event-triggered passes stays in the reconcile
function itself (handlers._pass); this pool only decides what runs when."""
from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import metrics

log = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENT = 8
Key = tuple[str, str]  # (namespace, name)
ReconcileOne = Callable[[dict, Any], None]  # (body, the pass's shared context) in a worker thread


def key_of(body: dict) -> Key:
    meta = body["metadata"]
    return meta.get("namespace", ""), meta["name"]


@dataclass
class PassOutcome:
    """What one resync pass did (for its log line and the tests)."""

    submitted: list[Key] = field(default_factory=list)
    skipped: list[Key] = field(default_factory=list)
    failed: list[Key] = field(default_factory=list)
    duration_s: float = 0.0


class ResyncPool:
    def __init__(self, reconcile_one: ReconcileOne, max_concurrent: int = DEFAULT_MAX_CONCURRENT) -> None:
        if not isinstance(max_concurrent, int) or max_concurrent < 1:
            raise ValueError(f"max_concurrent_reconciles must be an integer >= 1, got {max_concurrent!r}")
        self.max_concurrent = max_concurrent
        self._reconcile_one = reconcile_one
        self._executor = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="kvpilot-resync")
        self._guard = threading.Lock()
        self._in_flight: set[Key] = set()
        self._running = 0

    def in_flight(self) -> set[Key]:
        with self._guard:
            return set(self._in_flight)

    def _claim(self, key: Key) -> bool:
        with self._guard:
            if key in self._in_flight:
                return False
            self._in_flight.add(key)
            metrics.RECONCILES_IN_FLIGHT.set(len(self._in_flight))
            return True

    def _release(self, key: Key) -> None:
        with self._guard:
            self._in_flight.discard(key)
            metrics.RECONCILES_IN_FLIGHT.set(len(self._in_flight))

    def _run(self, body: dict, context: Any, submitted_at: float) -> bool:
        """In a worker thread: one reconcile; False when it raised (logged, not re-raised)."""
        key = key_of(body)
        metrics.RECONCILE_QUEUE_WAIT.observe(time.monotonic() - submitted_at)
        with self._guard:
            self._running += 1
            metrics.RECONCILE_CONCURRENCY.observe(self._running)
        try:
            self._reconcile_one(body, context)
            return True
        except Exception:
            log.exception("resync: reconcile %s/%s failed", *key)
            return False
        finally:
            with self._guard:
                self._running -= 1
            self._release(key)

    async def run_pass(self, bodies: Iterable[dict], context: Any = None) -> PassOutcome:
        """Reconcile every body not being deleted nor already in flight; returns when the
        ones this pass submitted are done."""
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        metrics.RESYNC_PASSES_STARTED.inc()
        outcome = PassOutcome()
        futures: list[tuple[Key, asyncio.Future]] = []
        for body in bodies:
            if body["metadata"].get("deletionTimestamp"):
                continue
            key = key_of(body)
            if not self._claim(key):
                outcome.skipped.append(key)
                metrics.RESYNC_SKIPPED.labels("in_flight").inc()
                continue
            try:
                # Each reconcile runs in a copy of this task's context, as asyncio.to_thread
                # would: kopf's Event posting (kopf.warn) lives in context variables.
                fut = loop.run_in_executor(self._executor, contextvars.copy_context().run, self._run, body,
                                           context, time.monotonic())
            except RuntimeError:  # the pool was shut down (operator stopping)
                self._release(key)
                raise
            outcome.submitted.append(key)
            futures.append((key, fut))
        for key, fut in futures:
            if not await fut:
                outcome.failed.append(key)
        outcome.duration_s = time.monotonic() - start
        metrics.RESYNC_PASSES.observe(outcome.duration_s)
        return outcome

    def shutdown(self) -> None:
        """Drops queued reconciles; a running one finishes in its thread."""
        self._executor.shutdown(wait=False, cancel_futures=True)
