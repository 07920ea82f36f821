"""The resync pool (operator/runtime/resync.py) with fake reconciles: bounded concurrency, never two
passes of one object at once, a pass in flight skipped rather than queued twice, failures
isolated, a slow object delaying no other, and the event loop left free."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvpilot.operator.runtime import metrics
from kvpilot.operator.runtime.resync import ResyncPool


def passes_started() -> float:
    return metrics.RESYNC_PASSES_STARTED._value.get()


def passes_completed() -> float:
    return next(s.value for m in metrics.RESYNC_PASSES.collect() for s in m.samples if s.name.endswith("_count"))


def body(name: str, ns: str = "n", deleting: bool = False) -> dict:
    meta = {"name": name, "namespace": ns}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta}


class Recorder:
    """A fake reconcile that blocks for `work_s` (as an API or Prometheus call would) and
    records how many ran at once, overall and per object."""

    def __init__(self, work_s: float = 0.0, fail: set[str] = frozenset(), block: dict | None = None):
        self.work_s, self.fail, self.block = work_s, fail, block or {}
        self.guard = threading.Lock()
        self.running: dict[tuple, int] = {}
        self.now = self.peak = 0
        self.peak_per_object = 0
        self.done: dict[tuple, float] = {}
        self.contexts: list = []

    def __call__(self, b: dict, context) -> None:
        key = (b["metadata"]["namespace"], b["metadata"]["name"])
        with self.guard:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.running[key] = self.running.get(key, 0) + 1
            self.peak_per_object = max(self.peak_per_object, self.running[key])
            self.contexts.append(context)
        try:
            gate = self.block.get(key[1])
            if gate is not None:
                assert gate.wait(timeout=30), "the test never released the gate"
            elif self.work_s:
                time.sleep(self.work_s)  # the fake's blocking work, not a wait for a condition
            if key[1] in self.fail:
                raise RuntimeError(f"reconcile of {key[1]} failed")
        finally:
            with self.guard:
                self.now -= 1
                self.running[key] -= 1
                self.done[key] = time.monotonic()


def test_a_hundred_objects_take_about_n_over_bound_times_t():
    fake = Recorder(work_s=0.05)
    pool = ResyncPool(fake, max_concurrent=8)
    start = time.monotonic()
    out = asyncio.run(pool.run_pass([body(f"d{i}") for i in range(100)], context="pass-1"))
    took = time.monotonic() - start
    pool.shutdown()
    assert len(out.submitted) == 100 and not out.failed and not out.skipped
    assert len(fake.done) == 100
    assert fake.peak == 8  # the bound was reached and never passed
    assert fake.peak_per_object == 1
    ideal = 100 / 8 * 0.05  # 13 rounds of 50 ms: 0.65 s; serial would be 5 s
    assert ideal * 0.9 < took < ideal * 3, took
    assert set(fake.contexts) == {"pass-1"}  # the pass's shared context reached every reconcile


def test_one_failing_reconcile_stops_no_other():
    fake = Recorder(fail={"d3", "d7"})
    pool = ResyncPool(fake, max_concurrent=4)
    out = asyncio.run(pool.run_pass([body(f"d{i}") for i in range(20)]))
    pool.shutdown()
    assert sorted(k[1] for k in out.failed) == ["d3", "d7"]
    assert len(fake.done) == 20
    assert not pool.in_flight()  # a failure releases its object too


def test_a_slow_object_delays_no_other():
    gate = threading.Event()
    fake = Recorder(work_s=0.01, block={"slow": gate})

    async def scenario():
        pool = ResyncPool(fake, max_concurrent=4)
        task = asyncio.create_task(pool.run_pass([body("slow")] + [body(f"d{i}") for i in range(40)]))
        deadline = time.monotonic() + 20
        while len(fake.done) < 40 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        others_done = len(fake.done)
        gate.set()
        out = await task
        pool.shutdown()
        return others_done, out

    others_done, out = asyncio.run(scenario())
    assert others_done == 40  # every other object finished while "slow" still blocked its worker
    assert len(out.submitted) == 41 and ("n", "slow") in fake.done


def test_an_object_in_flight_is_skipped_not_queued_twice():
    gate = threading.Event()
    fake = Recorder(block={"slow": gate})

    async def scenario():
        pool = ResyncPool(fake, max_concurrent=2)
        first = asyncio.create_task(pool.run_pass([body("slow"), body("a")]))
        deadline = time.monotonic() + 20
        while ("n", "a") not in fake.done and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        second = await pool.run_pass([body("slow"), body("a"), body("b")])
        in_flight = pool.in_flight()
        passes_in_flight = passes_started() - passes_completed()
        gate.set()
        await first
        pool.shutdown()
        return second, in_flight, passes_in_flight

    started0, completed0 = passes_started(), passes_completed()
    second, in_flight, passes_in_flight = asyncio.run(scenario())
    # started minus completed is the passes in flight (the first, held by "slow")
    assert passes_in_flight - (started0 - completed0) == 1
    assert (passes_started() - started0, passes_completed() - completed0) == (2, 2)
    assert second.skipped == [("n", "slow")]
    assert sorted(second.submitted) == [("n", "a"), ("n", "b")]
    assert in_flight == {("n", "slow")}
    assert fake.peak_per_object == 1


def test_the_event_loop_stays_free_while_reconciles_block():
    fake = Recorder(work_s=0.2)

    async def scenario():
        pool = ResyncPool(fake, max_concurrent=2)
        task = asyncio.create_task(pool.run_pass([body(f"d{i}") for i in range(6)]))
        gaps, last = [], time.monotonic()
        while not task.done():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        pool.shutdown()
        return gaps

    gaps = asyncio.run(scenario())
    assert len(gaps) > 20 and max(gaps) < 0.15  # 0.6 s of blocking work never held the loop


def test_objects_being_deleted_and_same_names_in_other_namespaces():
    fake = Recorder()
    pool = ResyncPool(fake, max_concurrent=3)
    out = asyncio.run(pool.run_pass([body("a", "n1"), body("a", "n2"), body("gone", deleting=True)]))
    pool.shutdown()
    assert sorted(out.submitted) == [("n1", "a"), ("n2", "a")]
    assert ("n", "gone") not in fake.done


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8"])
def test_the_bound_is_validated(bad):
    with pytest.raises(ValueError, match="max_concurrent_reconciles"):
        ResyncPool(Recorder(), max_concurrent=bad)


def test_the_cli_flag():
    import argparse

    from kvpilot.operator import cli
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    assert parser.parse_args(["operator"]).max_concurrent_reconciles == 8
    assert parser.parse_args(["operator", "--max-concurrent-reconciles", "16"]).max_concurrent_reconciles == 16
    with pytest.raises(SystemExit):
        parser.parse_args(["operator", "--max-concurrent-reconciles", "0"])
