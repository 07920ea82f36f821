"""The fleet's fast-forward through decode-only steps (engine/fleet/fast_forward.py) gives
what stepping one step at a time gives, to the bit: every request's times and counts,
every scrape's samples, the GPU timeline and the executors' counters. Each case steers
the run through one of the paths that end a run early: arrivals, finishes, a queue the
cap holds back, a cache too small (preemptions), prefix caching on and off, shared
blocks, clients that give up, EOS, live limits and replicas coming and going."""

from __future__ import annotations

import dataclasses
import math

import pytest

import kvpilot.engine.fleet.replica as replica_module
from kvpilot.engine.config.engine import EngineConfig
from kvpilot.engine.fleet.fleet import Fleet
from kvpilot.engine.fleet.trace import Phase, TraceRequest, generate


def _config(**kw) -> EngineConfig:
    kw.setdefault("max_model_len", 8192)
    sim = {"accelerator": kw.pop("accelerator", "h100-80gb"), "model": "llama-3.1-8b"}
    return EngineConfig(model=None, simulate=sim, **kw)


def _trace(duration=60, rate=4, seed=1, **kw):
    return list(generate([Phase(duration=duration, rate=rate, **kw)], seed=seed, max_len=8192))


def _outcome(fleet: Fleet) -> dict:
    replicas = fleet.replicas + fleet.retired
    return {
        "requests": [dataclasses.asdict(r) for r in fleet.requests],
        "scrapes": [(s.time, s.replica, [(x.name, x.labels, x.value) for x in s.samples]) for s in fleet.scrapes],
        "gpus": list(fleet.gpu_timeline),
        "executors": [r.engine.runner.counters() for r in replicas],
        "gaps": [(dict(r.metrics.itl_fine.bins), r.metrics.itl_fine.sum) for r in replicas],
        "prefix": [(r.engine.kv_cache.prefix_stats.queries, r.engine.kv_cache.prefix_stats.hits) for r in replicas],
    }


def _both(monkeypatch, drive, config: EngineConfig, **fleet_kw) -> tuple[dict, dict, int]:
    """`drive(fleet)` on a fleet stepping one step at a time and on one fast-forwarding;
    their outcomes and the steps the fast-forward took."""
    taken = []
    real = replica_module.decode_steps

    def counted(engine, until):
        taken.append(real(engine, until))
        return taken[-1]

    monkeypatch.setattr(replica_module, "decode_steps", counted)
    plain = Fleet(config, fast_forward=False, **fleet_kw)
    drive(plain)
    fast = Fleet(config, **fleet_kw)
    drive(fast)
    return _outcome(plain), _outcome(fast), sum(taken)


def _run(trace):
    return lambda fleet: fleet.run(trace)


@pytest.mark.parametrize("name, config, fleet_kw, trace", [
    ("open loop, prefix caching", _config(), {"scrape_interval": 5},
     _trace(input="uniform:200:2000", output="uniform:50:400", prefix_len=512, prefix_groups=3, prefix_fraction=0.5)),
    ("no prefix caching", _config(enable_prefix_caching=False), {"scrape_interval": 5},
     _trace(input="uniform:100:1500", output="uniform:20:300")),
    ("the cap holds a queue back", _config(max_num_seqs=4), {"scrape_interval": 7},
     _trace(duration=30, rate=6, input="uniform:100:800", output="uniform:100:300")),
    ("a cache too small: preemptions", _config(accelerator="a10g", max_model_len=4096, max_num_seqs=256),
     {"scrape_interval": 10}, _trace(duration=60, rate=2, input="uniform:1000:2000", output="uniform:300:600")),
    ("clients give up, closed loop, three replicas", _config(max_num_seqs=8),
     {"replicas": 3, "client_timeout": 3.0, "max_concurrency": 40, "scrape_interval": 4},
     _trace(duration=30, rate=20, input="uniform:500:3000", output="uniform:50:500")),
    ("least-loaded router, small chunks", _config(max_num_batched_tokens=512),
     {"replicas": 2, "router": "least-loaded", "scrape_interval": 3},
     _trace(duration=30, rate=8, input="uniform:100:1500", output="uniform:10:200")),
])
def test_fast_forward_matches_stepping(monkeypatch, name, config, fleet_kw, trace):
    plain, fast, taken = _both(monkeypatch, _run(trace), config, **fleet_kw)
    assert taken > 0, f"{name}: the fast path never ran"
    for key in plain:
        assert fast[key] == plain[key], f"{name}: {key} differs"


@pytest.mark.parametrize("config, fleet_kw, trace, all_in_time", [
    (_config(), {"client_timeout": 10.0, "scrape_interval": 5},
     _trace(duration=60, rate=4, input="uniform:200:1500", output="uniform:20:200"), True),
    (_config(max_num_seqs=8), {"replicas": 2, "client_timeout": 3.0, "max_concurrency": 30, "scrape_interval": 4},
     _trace(duration=30, rate=20, input="uniform:500:3000", output="uniform:50:500"), False),
])
def test_a_deadline_that_would_do_nothing_is_no_event(monkeypatch, config, fleet_kw, trace, all_in_time):
    # A client's deadline is dropped once its request has a token or has finished: the same
    # outcome as keeping it as an event (give_up would refuse), with fewer, longer runs.
    real, outcomes, runs = replica_module.decode_steps, {}, {}
    for keep in (False, True):
        taken = []
        monkeypatch.setattr(replica_module, "decode_steps", lambda e, u: taken.append(real(e, u)) or taken[-1])
        if keep:  # every deadline an event, as before they were dropped
            monkeypatch.setattr(Fleet, "_next_deadline", lambda self: self._deadlines[0][0] if self._deadlines else math.inf)
        fleet = Fleet(config, **fleet_kw)
        fleet.run(trace)
        outcomes[keep], runs[keep] = _outcome(fleet), sum(1 for k in taken if k)
    assert outcomes[False] == outcomes[True]
    if all_in_time:
        assert all(r["error"] is None for r in outcomes[False]["requests"])
        assert runs[False] < 0.8 * runs[True], runs
    else:
        assert any(r["error"] for r in outcomes[False]["requests"]), "no client gave up"


def test_shared_blocks_and_eos_match_stepping(monkeypatch):
    # Mooncake-style block ids (requests sharing leading blocks) and requests that stop at
    # their drawn EOS (not fast-forwarded: their stop tokens may end them any step).
    trace = [TraceRequest(0.2 * i, 1200 + 37 * (i % 5), 60 + 13 * (i % 7), hash_ids=(1, 2, i % 3 + 3), block_size=512,
                          ignore_eos=i % 4 != 0) for i in range(60)]
    plain, fast, taken = _both(monkeypatch, _run(trace), _config(), scrape_interval=2)
    assert taken > 0
    assert fast == plain


def test_a_prompt_whose_last_chunk_is_one_token_matches_stepping(monkeypatch):
    # 1025 prompt tokens in 512-token chunks: the third step computes one token, as a
    # decode does, but it is the prompt's last and gives the first token (TTFT).
    trace = [TraceRequest(0.0, 1025, 50), TraceRequest(5.0, 300, 40), TraceRequest(5.0, 1024 + 511 + 1, 30)]
    plain, fast, taken = _both(monkeypatch, _run(trace), _config(max_num_batched_tokens=512), scrape_interval=1)
    assert taken > 0
    assert fast == plain


def test_live_limits_and_replica_changes_match_stepping(monkeypatch):
    trace = _trace(duration=90, rate=8, input="uniform:300:900", output="uniform:200:600")

    def drive(fleet):
        fleet.submit(trace)
        fleet.run_until(20)
        fleet.set_limits(max_num_seqs=3, max_num_batched_tokens=1024)
        fleet.add_replica(ready_in=5.0)
        fleet.run_until(50)
        fleet.set_limits(max_num_seqs=64)
        fleet.remove_replica()
        fleet.run_until(70)
        fleet.run(())

    plain, fast, taken = _both(monkeypatch, drive, _config(), replicas=2, scrape_interval=5)
    assert taken > 0
    assert fast == plain
