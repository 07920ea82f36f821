"""Tenants, rate limits exact over a sliding window, and the priority queue."""
from __future__ import annotations

import asyncio

import pytest

from kvpilot.operator.gateway.admission import AdmissionQueue
from kvpilot.operator.gateway.ratelimit import SlidingWindow, TenantLimits
from kvpilot.operator.gateway.tenants import ANONYMOUS, Tenants


def test_request_limit_is_exact_over_the_window():
    limits = TenantLimits(requests_per_window=5, tokens_per_window=None, window=10.0)
    times = [0.0, 1.0, 2.0, 3.0, 4.0]
    assert all(limits.admit(t) is None for t in times)
    assert limits.admit(4.5) == ("requests", 6)  # the one at t=0 leaves the window at t=10
    assert limits.admit(9.99) is not None
    assert limits.admit(10.0) is None  # t=0 expired: exactly one more fits
    assert limits.admit(10.5) is not None
    assert limits.admit(11.0) is None
    # Any 10 s window holds at most 5 admissions.
    admitted = [0.0, 1.0, 2.0, 3.0, 4.0, 10.0, 11.0]
    for start in admitted:
        assert sum(1 for t in admitted if start <= t < start + 10) <= 5


def test_token_limit_counts_usage_and_retry_after_names_when_enough_expires():
    limits = TenantLimits(None, tokens_per_window=1000, window=60.0)
    assert limits.admit(0.0) is None
    limits.charge_tokens(1.0, 600)
    assert limits.admit(2.0) is None
    limits.charge_tokens(3.0, 500)  # 1,100 used: over
    assert limits.admit(4.0) == ("tokens", 57)  # the 600 from t=1 expire at t=61
    assert limits.admit(61.0) is None


def test_sliding_window_validation():
    with pytest.raises(ValueError, match="rate limit must be >= 1"):
        SlidingWindow(0, 1.0)
    with pytest.raises(ValueError, match="window"):
        SlidingWindow(1, 0)


def write_tenants(tmp_path, text: str, keys: dict[str, str]):
    for name, key in keys.items():
        (tmp_path / name).write_text(key + "\n")
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return path


def test_tenants_file_keys_models_and_priority(tmp_path):
    path = write_tenants(tmp_path, f"""
window: 30
tenants:
  - name: search
    apiKeyFiles: [{tmp_path}/search-key]
    models: ["llama-*"]
    requestsPerWindow: 10
    priority: 5
  - name: batch
    apiKeyFiles: [{tmp_path}/batch-key, {tmp_path}/batch-key-2]
""", {"search-key": "s" * 32, "batch-key": "b" * 32, "batch-key-2": "c" * 20})
    tenants = Tenants.load(path)
    assert tenants.window == 30 and not tenants.open
    search = tenants.authenticate("Bearer " + "s" * 32)
    assert search.name == "search" and search.priority == 5 and search.requests_per_window == 10
    assert search.may_use("llama-8b") and not search.may_use("qwen")
    assert tenants.authenticate("bearer " + "c" * 20).name == "batch"
    assert tenants.authenticate("Bearer " + "x" * 32) is None
    assert tenants.authenticate(None) is None
    assert tenants.authenticate("Basic abc") is None
    assert tenants.authenticate("Bearer " + "b" * 32).may_use("anything")


def test_open_gateway_without_tenants():
    tenants = Tenants.unrestricted()
    assert tenants.open and tenants.authenticate(None).name == ANONYMOUS


@pytest.mark.parametrize("text, keys, message", [
    ("tenants: [{name: A, apiKeyFiles: [/k]}]", {}, "tenants.0.name"),
    ("tenants: [{name: a, apiKeyFiles: []}]", {}, "apiKeyFiles"),
    ("tenants: [{name: a, apiKeyFiles: [KEY], requestsPerWindow: 0}]", {"k": "x" * 20}, "requestsPerWindow"),
    ("tenants: [{name: a, apiKeyFiles: [KEY], colour: red}]", {"k": "x" * 20}, "colour"),
    ("tenants: [{name: a, apiKeyFiles: [KEY]}, {name: a, apiKeyFiles: [KEY]}]", {"k": "x" * 20}, "unique"),
    ("tenants: [{name: a, apiKeyFiles: [KEY]}]", {"k": "short"}, "shorter than 16"),
    ("tenants: [{name: a, apiKeyFiles: [/nonexistent/key]}]", {}, "apiKeyFiles"),
    ("tenants: [{name: a, apiKeyFiles: [KEY]}, {name: b, apiKeyFiles: [KEY]}]", {"k": "x" * 20}, "share"),
    ("tenants: [", {}, "tenants file"),
])
def test_bad_tenants_files_name_the_field(tmp_path, text, keys, message):
    path = write_tenants(tmp_path, text.replace("KEY", str(tmp_path / "k")), keys)
    with pytest.raises(ValueError, match=message):
        Tenants.load(path)


def test_priority_queue_serves_higher_priority_first_then_arrival_order():
    async def main():
        queue = AdmissionQueue(capacity=1)
        assert await queue.acquire(0, 1.0)  # holds the only slot
        order = []

        async def wait(name, priority):
            assert await queue.acquire(priority, 5.0)
            order.append(name)

        tasks = [asyncio.create_task(wait(n, p)) for n, p in
                 [("low-1", 0), ("high-1", 10), ("low-2", 0), ("high-2", 10)]]
        await asyncio.sleep(0)
        assert queue.waiting == 4
        for _ in range(4):
            queue.release()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == ["high-1", "high-2", "low-1", "low-2"]
        queue.release()
        assert queue.in_flight == 0
    asyncio.run(main())


def test_queue_times_out_holds_at_zero_capacity_and_frees_slots_of_cancelled_waiters():
    async def main():
        queue = AdmissionQueue(capacity=0)  # a model at zero replicas
        assert not await queue.acquire(0, 0.01)
        assert queue.waiting == 0
        held = asyncio.create_task(queue.acquire(0, 5.0))
        await asyncio.sleep(0)
        assert queue.waiting == 1
        queue.set_capacity(1)  # a replica became ready
        assert await held and queue.in_flight == 1
        queue.release()
        # A waiter cancelled (its client left) takes no slot.
        queue.set_capacity(0)
        gone = asyncio.create_task(queue.acquire(0, 5.0))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        queue.set_capacity(1)
        assert queue.in_flight == 0 and await queue.acquire(0, 0.1)
    asyncio.run(main())
