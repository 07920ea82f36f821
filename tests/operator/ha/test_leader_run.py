"""`kvpilot operator --leader-elect`'s process life: a standby runs nothing and answers
/healthz; the leader runs the operator; when the operator stops (kopf on SIGTERM) the
Lease is released; a Lease taken by another candidate, or a pass still in flight when the
renew deadline passes, exits the process at once, non-zero; an unreachable API server with
nothing in flight only stops the passes until the Lease is renewed. The API is an
in-memory Lease store (tests/operator/ha/test_leader_election.py)."""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import httpx
import pytest
from test_leader_election import FakeStore

from kvpilot.operator.ha import leader, leader_run
from kvpilot.operator.runtime import metrics
from kvpilot.operator.ha.election import ElectionTiming, LeaseRecord
from kvpilot.operator.ha.leader_run import ElectionConfig, default_identity, default_namespace

FAST = ElectionTiming(1.0, 0.6, 0.1)


class Exited(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store(monkeypatch):
    s = FakeStore()
    monkeypatch.setattr(leader, "KubeLeaseStore", lambda kube, ns, name: s)
    monkeypatch.setattr("kvpilot.operator.kube_config.load_kube_config", lambda: None)
    monkeypatch.setattr("kvpilot.operator.runtime.apply.Kube.__init__", lambda self, api_client=None: None)

    def exit_(code):
        raise Exited(code)
    monkeypatch.setattr(leader_run.os, "_exit", exit_)
    return s


class Process:
    """_main in a thread with its own loop. Signal handlers need the main thread, so they are
    captured: `sigterm()` calls the one _main installed, as the signal would."""

    def __init__(self, config, operator, port):
        self.result: dict = {}
        self.handlers: list = []
        self.thread = threading.Thread(target=self._run, args=(config, operator, port), daemon=True)
        self.thread.start()

    def _run(self, config, operator, port):
        loop = asyncio.new_event_loop()
        loop.add_signal_handler = lambda sig, fn, *a: self.handlers.append(lambda: loop.call_soon_threadsafe(fn, *a))
        try:
            self.result["rc"] = loop.run_until_complete(leader_run._main(config, operator, "127.0.0.1", port))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.result["error"] = e

    def sigterm(self):
        self.handlers[0]()

    def join(self):
        self.thread.join(10)
        assert not self.thread.is_alive()
        return self.result


def until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def fake_operator():
    """What kopf.operator() is to _main: runs until told to stop (kopf stops on SIGTERM)."""
    started, stop = threading.Event(), threading.Event()

    async def run(leading):
        assert leading()  # the operator is started holding the Lease
        run.gate = leading
        started.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
    return run, started, stop


def test_defaults_for_identity_and_namespace(tmp_path):
    assert default_identity({"POD_NAME": "op-1"}) == "op-1"
    assert default_identity({}).endswith(f"_{os.getpid()}")
    f = tmp_path / "ns"
    f.write_text("kvpilot-system\n")
    assert default_namespace({"POD_NAMESPACE": "x"}, f) == "x"
    assert default_namespace({}, f) == "kvpilot-system"
    assert default_namespace({}, tmp_path / "absent") == "default"
    with pytest.raises(ValueError, match="identity"):
        ElectionConfig("ns", "lease", "", FAST)


def test_a_standby_runs_nothing_answers_healthz_and_stops_on_sigterm(store):
    store.lease, store.version = LeaseRecord("other", 60, "t", "t", 0, "5"), 5
    run, started, _ = fake_operator()
    port = free_port()
    p = Process(ElectionConfig("ns", "lease", "me", FAST), run, port)
    until(lambda: p.handlers)
    r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    assert r.status_code == 200 and "standby" in r.text
    time.sleep(0.5)
    assert not started.is_set() and store.lease.holder == "other"
    p.sigterm()
    assert p.join() == {"rc": 0} and not started.is_set() and store.lease.holder == "other"


def test_the_leader_runs_the_operator_and_releases_the_lease_when_it_stops(store):
    store.lease, store.version = LeaseRecord("other", 1, "t", "t", 0, "5"), 5  # will expire in 1 s
    run, started, stop = fake_operator()
    port = free_port()
    p = Process(ElectionConfig("ns", "lease", "me", FAST), run, port)
    until(started.is_set, timeout=5)
    assert store.lease.holder == "me" and store.lease.transitions == 1
    assert "leader" in httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).text
    assert metrics.LEADER._value.get() == 1
    renewed = store.lease.renew_time
    until(lambda: store.lease.renew_time != renewed)  # renews every retry period
    stop.set()  # kopf stopping on SIGTERM
    assert p.join() == {"rc": 0}
    assert store.lease.holder == "" and store.lease.lease_duration_s == 1  # released: handover at once
    assert metrics.LEADER._value.get() == 0


def test_a_lost_lease_exits_at_once_with_a_non_zero_code(store):
    run, started, _ = fake_operator()
    p = Process(ElectionConfig("ns", "lease", "me", FAST), run, 0)
    until(started.is_set, timeout=5)
    store.lease = LeaseRecord("thief", 15, "t", "t", 5, "99")  # another candidate took it
    result = p.join()
    assert isinstance(result.get("error"), Exited) and result["error"].args == (leader_run.LOST_EXIT_CODE,)
    assert store.lease.holder == "thief"  # nothing released, nothing overwritten


def test_an_unreachable_api_past_the_renew_deadline_stops_acting_then_leads_again_without_exiting(store):
    """An API server restart: at the renew deadline the leader stops acting (no pass may
    start), and with no pass in flight it stays up and renews once the API answers."""
    run, started, stop = fake_operator()
    p = Process(ElectionConfig("ns", "lease", "me", FAST), run, 0)
    until(started.is_set, timeout=5)
    gate, failed_reads, read = run.gate, [], store.get

    def get():
        if store.fail:
            failed_reads.append(time.monotonic())
        return read()
    store.get = get
    store.fail = True
    until(lambda: metrics.LEADER._value.get() == 0, timeout=5)
    with gate.acting() as may_act:
        assert not may_act and gate.in_flight() == 0  # a pass started now writes nothing
    # an outage longer than the lease, the leader trying all along: still no exit
    until(lambda: failed_reads and failed_reads[-1] - failed_reads[0] > FAST.lease_duration_s)
    assert p.thread.is_alive() and "error" not in p.result
    store.fail = False
    until(lambda: metrics.LEADER._value.get() == 1, timeout=5)
    assert gate() and store.lease.holder == "me" and store.lease.transitions == 0  # the same term
    stop.set()
    assert p.join() == {"rc": 0}


def test_a_pass_in_flight_at_the_renew_deadline_exits(store):
    run, started, _ = fake_operator()
    p = Process(ElectionConfig("ns", "lease", "me", FAST), run, 0)
    until(started.is_set, timeout=5)
    t0 = time.monotonic()
    with run.gate.acting() as may_act:  # a pass stuck on an API call that does not return
        assert may_act and run.gate.in_flight() == 1
        store.fail = True
        result = p.join()
    assert isinstance(result.get("error"), Exited) and result["error"].args == (leader_run.LOST_EXIT_CODE,)
    assert time.monotonic() - t0 < FAST.lease_duration_s + 0.5  # before a standby could take over


def test_a_suspended_leader_that_finds_the_lease_taken_exits(store):
    run, started, _ = fake_operator()
    p = Process(ElectionConfig("ns", "lease", "me", FAST), run, 0)
    until(started.is_set, timeout=5)
    store.fail = True
    until(lambda: metrics.LEADER._value.get() == 0, timeout=5)
    store.lease = LeaseRecord("thief", 15, "t", "t", 5, "99")  # the standby won meanwhile
    store.fail = False
    result = p.join()
    assert isinstance(result.get("error"), Exited) and result["error"].args == (leader_run.LOST_EXIT_CODE,)
    assert store.lease.holder == "thief"


def test_leader_election_flags(monkeypatch):
    import argparse

    from kvpilot.operator.cli import add_parser, election_config

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["operator"])
    assert a.leader_elect is False and a.leader_election_id == "kvpilot-operator"
    assert (a.leader_elect_lease_duration, a.leader_elect_renew_deadline, a.leader_elect_retry_period) == (15, 10, 2)
    monkeypatch.setenv("POD_NAME", "op-7")
    monkeypatch.setenv("POD_NAMESPACE", "ops")
    cfg = election_config(parser.parse_args(["operator", "--leader-elect", "--leader-election-id", "x"]))
    assert (cfg.namespace, cfg.lease_name, cfg.identity) == ("ops", "x", "op-7")
    assert cfg.timing == ElectionTiming()
    cfg = election_config(parser.parse_args(["operator", "--leader-elect", "--leader-election-namespace", "n"]))
    assert cfg.namespace == "n"
    with pytest.raises(ValueError, match="renew_deadline_s"):
        election_config(parser.parse_args(["operator", "--leader-elect", "--leader-elect-renew-deadline", "20"]))
