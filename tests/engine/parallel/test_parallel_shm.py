"""The shared-memory collectives of CPU ranks on one host, with two threads standing in
for two ranks (the same file mapped twice): sums and gathers equal on both sides, bit for
bit; the slots alternate so back-to-back operations never read a half-written one; what
does not fit says so (the group then uses gloo); a vanished peer ends the wait."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from kvpilot.engine.parallel import shm_channel
from kvpilot.engine.parallel.shm_channel import ShmChannel

pytestmark = pytest.mark.skipif(not shm_channel.available(), reason="x86-64 with /dev/shm only")


@pytest.fixture
def pair(tmp_path):
    path = f"/dev/shm/kvpilot-test-{uuid.uuid4().hex}"
    ShmChannel(path, 0, 2, 4096, create=True).close()
    channels = [ShmChannel(path, r, 2, 4096, create=False) for r in range(2)]
    import os

    os.unlink(path)
    yield channels
    for c in channels:
        c.close()


def both(fn0, fn1):
    out, errors = [None, None], []

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate((fn0, fn1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def alive():
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_gives_both_ranks_the_same_sum_over_many_rounds(pair, dtype):
    gen = torch.Generator().manual_seed(0)
    for round_ in range(50):  # many rounds: both parities, reused slots
        a, b = (torch.randn(7, 33, generator=gen).to(dtype) for _ in range(2))
        want = (a.float() + b.float()).to(dtype)
        x, y = a.clone(), b.clone()
        assert both(lambda: pair[0].all_reduce(x, alive, 10), lambda: pair[1].all_reduce(y, alive, 10)) == [True, True]
        assert torch.equal(x, y) and torch.equal(x, want), round_


def test_all_gather_and_broadcast(pair):
    a, b = torch.arange(6.0).view(2, 3), -torch.arange(6.0).view(2, 3)
    ga, gb = both(lambda: pair[0].all_gather(a, alive, 10), lambda: pair[1].all_gather(b, alive, 10))
    assert all(torch.equal(g[0], a) and torch.equal(g[1], b) for g in (ga, gb))
    message = ("step", {"ids": list(range(100))})
    got = both(lambda: pair[0].broadcast(message, alive), lambda: pair[1].broadcast(None, alive))
    assert got == [(True, message), (True, message)]


def test_what_does_not_fit_a_slot_is_left_to_gloo(pair):
    big = torch.zeros(2048)  # 8 KiB > 4 KiB slots
    assert pair[0].all_reduce(big, alive, 10) is False and pair[0].all_gather(big, alive, 10) is None
    # A broadcast too large for the slot still meets the other rank, and tells it to use gloo.
    got = both(lambda: pair[0].broadcast("x" * 10_000, alive), lambda: pair[1].broadcast(None, alive))
    assert got == [(False, None), (False, None)]


def test_a_peer_that_never_comes_ends_the_wait(pair):
    with pytest.raises(RuntimeError, match="did not reach the collective within 0.05 s"):
        pair[1].all_reduce(torch.ones(4), alive, 0.05)
    with pytest.raises(RuntimeError, match="its process is gone"):
        pair[1].all_reduce(torch.ones(4), lambda: False, 10)
