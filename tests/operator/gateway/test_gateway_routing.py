"""The gateway's pure routing: consistent hashing with bounded loads, prefix keys, the
picker's order and reasons, the routing table's refreshes."""
from __future__ import annotations

import collections
import random

import pytest

from kvpilot.operator.gateway.hashing import HashRing, bounded_order, load_bound
from kvpilot.operator.gateway.picker import LEAST_LOADED, PREFIX_HIT, PREFIX_SPILL, Picker
from kvpilot.operator.gateway.prefix import prefix_key
from kvpilot.operator.gateway.replicas import Replica, ReplicaLoad, parse_load
from kvpilot.operator.gateway.table import BackendSnapshot, RoutingTable

KEYS = [f"system prompt {i} " .encode() * 8 for i in range(5000)]


def owners(ring: HashRing) -> dict[bytes, str]:
    return {k: ring.walk(k)[0] for k in KEYS}


def test_ring_spreads_keys_and_walk_lists_every_replica_once():
    ring = HashRing([f"pod-{i}" for i in range(4)])
    counts = collections.Counter(owners(ring).values())
    assert set(counts) == {f"pod-{i}" for i in range(4)}
    assert min(counts.values()) > 0.15 * len(KEYS), counts  # 100 virtual nodes: within ~±40 % of 25 %
    for key in KEYS[:50]:
        walk = ring.walk(key)
        assert sorted(walk) == sorted(ring.replicas)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_adding_a_replica_moves_about_one_nth_of_the_prefixes(n):
    before = owners(HashRing([f"pod-{i}" for i in range(n)]))
    after = owners(HashRing([f"pod-{i}" for i in range(n + 1)]))
    moved = [k for k in KEYS if before[k] != after[k]]
    share = len(moved) / len(KEYS)
    assert all(after[k] == f"pod-{n}" for k in moved)  # keys move only onto the new replica
    assert 0.5 / (n + 1) < share < 1.6 / (n + 1), share
    print(f"{n} -> {n + 1} replicas: {share:.1%} of prefixes moved (1/{n + 1} = {1 / (n + 1):.1%})")


def test_removing_a_replica_moves_only_its_prefixes():
    before = owners(HashRing(["a", "b", "c", "d"]))
    after = owners(HashRing(["a", "b", "d"]))
    assert all(after[k] == before[k] for k in KEYS if before[k] != "c")


def test_bounded_loads_never_exceed_the_bound():
    """Every key the same (one hot prefix): placements spill around the ring and no replica
    goes over ceil(c * (total + 1) / n) when it is placed."""
    ring = HashRing([f"pod-{i}" for i in range(4)])
    loads = collections.Counter()
    hot = b"the same system prompt"
    for placed in range(200):
        order, _ = bounded_order(ring, hot, loads, 1.25)
        bound = load_bound(placed, 4, 1.25)
        loads[order[0]] += 1
        assert loads[order[0]] <= bound
    assert max(loads.values()) <= load_bound(199, 4, 1.25)
    assert len(loads) == 4


def test_bounded_order_keeps_the_own_replica_while_under_the_bound():
    ring = HashRing(["a", "b", "c"])
    key = b"k"
    own = ring.walk(key)[0]
    order, spilled = bounded_order(ring, key, {own: 0}, 1.25)
    assert order[0] == own and not spilled
    order, spilled = bounded_order(ring, key, {own: 10}, 1.25)
    assert order[0] != own and spilled and order[-1] == own


def test_random_loads_property():
    rng = random.Random(7)
    ring = HashRing([f"p{i}" for i in range(5)])
    for _ in range(500):
        loads = {f"p{i}": rng.randint(0, 20) for i in range(5)}
        order, _ = bounded_order(ring, rng.randbytes(8), loads, 1.25)
        bound = load_bound(sum(loads.values()), 5, 1.25)
        assert sorted(order) == sorted(loads)
        if any(v + 1 <= bound for v in loads.values()):
            assert loads[order[0]] + 1 <= bound


def test_prefix_keys():
    system = "You are a retrieval assistant. " * 20
    a = prefix_key({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "q1"}]})
    b = prefix_key({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "q2"}]})
    assert a == b and len(a) == 256
    parts = prefix_key({"messages": [{"role": "system", "content": [{"type": "text", "text": system}]}]})
    assert parts == a
    assert prefix_key({"prompt": "abc"}) == b"abc"
    assert prefix_key({"prompt": ["abc", "def"]}) == b"abc"
    assert prefix_key({"prompt": list(range(100))}) == prefix_key({"prompt": list(range(64)) + [0]})
    assert prefix_key({"prompt": ""}) is None
    assert prefix_key({"messages": []}) is None
    assert prefix_key({"messages": "nonsense"}) is None
    assert prefix_key({}) is None


def test_parse_load_sums_label_sets_and_ignores_the_rest():
    text = ('# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{model_name="m"} 7.0 1700000000000\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
            'kvpilot:num_requests_preempted{model_name="m"} 2.0\n'
            'vllm:num_requests_waiting_by_reason{reason="capacity"} 99\n'
            'garbage line without value\n')
    load = parse_load(text, now=1.0)
    assert (load.running, load.waiting, load.kv_usage, load.scraped_at) == (5.0, 9.0, 0.5, 1.0)  # preempted ones wait too


def replicas(n, **loads):
    out = [Replica(f"pod-{i}", f"http://10.0.0.{i}:8000") for i in range(n)]
    for r in out:
        if r.name in loads:
            r.load = ReplicaLoad(*loads[r.name])
    return out


def test_picker_prefix_then_spill_then_least_loaded():
    picker = Picker("prefix")
    pods = replicas(4)
    route = picker.pick(pods, b"prompt")
    assert route.reason == PREFIX_HIT and sorted(r.name for r in route.order) == [r.name for r in pods]
    own = route.order[0]
    own.in_flight = 50  # far over the bound
    route = picker.pick(pods, b"prompt")
    assert route.reason == PREFIX_SPILL and route.order[0] is not own and route.order[-1] is own
    own.in_flight = 0
    own.load = ReplicaLoad(running=4, waiting=3, kv_usage=0.99)  # saturated
    route = picker.pick(pods, b"prompt")
    assert route.order[0] is not own and route.reason == PREFIX_SPILL
    route = picker.pick(pods, None)
    assert route.reason == LEAST_LOADED and route.order[-1] is own
    assert picker.pick([], b"x") is None


def test_round_robin_and_least_loaded_policies():
    pods = replicas(3, **{"pod-1": (5, 0, 0.1), "pod-2": (1, 0, 0.1)})
    rr = Picker("round-robin")
    firsts = [rr.pick(pods, b"k").order[0].name for _ in range(6)]
    assert firsts == ["pod-0", "pod-1", "pod-2"] * 2
    ll = Picker("least-loaded")
    assert [r.name for r in ll.pick(pods, b"k").order] == ["pod-0", "pod-2", "pod-1"]
    with pytest.raises(ValueError, match="routing policy"):
        Picker("random")


def test_least_loaded_ties_take_turns():
    """Idle replicas share the requests: each pick puts the next of the equally loaded
    ones first, the busier ones stay behind them."""
    pods = replicas(4, **{"pod-1": (3, 0, 0.1)})
    ll = Picker("least-loaded")
    orders = [[r.name for r in ll.pick(pods, b"k").order] for _ in range(6)]
    assert [o[0] for o in orders] == ["pod-0", "pod-2", "pod-3"] * 2
    assert all(o[-1] == "pod-1" and sorted(o) == [r.name for r in pods] for o in orders)
    keyless = Picker("prefix")  # a request with no prompt to key on goes least-loaded too
    assert [keyless.pick([pods[0], pods[2]], None).order[0].name for _ in range(4)] == ["pod-0", "pod-2"] * 2


def test_table_keeps_replicas_across_refreshes_and_sets_capacity():
    table = RoutingTable(Picker, per_replica_capacity=4)
    table.update([BackendSnapshot("m", "ns", "d", (("p0", "http://a"), ("p1", "http://b")))])
    kept = table.get("m").replicas["p0"]
    kept.in_flight = 3
    table.update([BackendSnapshot("m", "ns", "d", (("p0", "http://a"),))])
    backend = table.get("m")
    assert backend.replicas["p0"] is kept and list(backend.replicas) == ["p0"]
    assert backend.queue.capacity == 4
    table.update([BackendSnapshot("m", "ns", "d", (("p0", "http://a-new"),))])
    assert table.get("m").replicas["p0"] is not kept  # same pod name, new IP: a new replica
    table.update([BackendSnapshot("m", "ns", "d", ()),
                  BackendSnapshot("m", "other", "d2", (("x", "http://x"),), created="2099")])
    assert table.get("m").namespace == "ns" and table.get("m").queue.capacity == 0  # the older one wins
    table.update([])
    assert table.get("m") is None and table.models() == []


def pod(name, ns="demo", owner="llama", ip="10.1.0.1", ready=True, terminating=False, port=None):
    meta = {"name": name, "namespace": ns, "labels": {"serving.kvpilot.dev/llmdeployment": owner}}
    if terminating:
        meta["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    containers = [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}] if port else [{}]
    return {"metadata": meta, "spec": {"containers": containers},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_discovery_snapshots_from_the_api_objects():
    from kvpilot.operator.gateway.discovery import parse_backend_flag, snapshots_from_objects

    deployments = [
        {"metadata": {"name": "llama", "namespace": "demo", "creationTimestamp": "2026-01-01T00:00:00Z"},
         "spec": {"model": {"servedName": "llama-3.1-8b"}, "replicas": 3}},
        {"metadata": {"name": "idle", "namespace": "demo"}, "spec": {"replicas": 0}},
        {"metadata": {"name": "gone", "namespace": "demo", "deletionTimestamp": "x"}, "spec": {}},
    ]
    pods = [pod("llama-b", ip="10.1.0.2"), pod("llama-a", ip="10.1.0.1", port=9000),
            pod("llama-c", ready=False), pod("llama-d", terminating=True),
            pod("other-ns", ns="prod"), pod("no-ip", ip=None)]
    llama, idle = snapshots_from_objects(deployments, pods)
    assert (llama.model, llama.namespace, llama.deployment, llama.desired_replicas) == (
        "llama-3.1-8b", "demo", "llama", 3)
    assert llama.endpoints == (("llama-a", "http://10.1.0.1:9000"), ("llama-b", "http://10.1.0.2:8000"))
    assert (idle.model, idle.endpoints, idle.desired_replicas) == ("idle", (), 0)
    snap = parse_backend_flag("tiny=http://a:1, http://b:2/")
    assert snap.endpoints == (("tiny-0", "http://a:1"), ("tiny-1", "http://b:2")) and snap.deployment is None
    for bad in ("tiny", "=http://a", "tiny=ftp://a"):
        with pytest.raises(ValueError, match="--backend"):
            parse_backend_flag(bad)
