"""A leader handover in the middle of an autotune interval: the new leader rebuilds
the autotuner's memory from status.autotune (the only place it lives), so it neither
repeats the old leader's change nor loses it. Two "operators" (separate hook
instances, separate API clients, no shared process state) take turns over one
LLMDeployment whose status is what the API server would hold."""
from __future__ import annotations

import copy
import functools

from test_autotune_hook import SCHED, T0, FakeKube, FakeReader, snap, spec_body

from kvpilot.operator.autotune.hook import autotune_step
from kvpilot.operator.reconcile import reconcile


class Operator:
    """One operator process: its own API client (Events, applies) and its own hook."""

    def __init__(self, snaps):
        self.kube = FakeKube()
        reader = FakeReader([None])
        reader.snapshot = lambda ns, name, w: snaps["s"]
        self.hook = functools.partial(autotune_step, reader_factory=reader)

    def pass_(self, stored: dict, now: float) -> dict:
        """What handlers._pass does: reconcile the object as read from the API, write status back."""
        body = copy.deepcopy(stored)
        result = reconcile(self.kube, body, lambda c: self.hook(c, now=now))
        stored["status"] = result.status.dump()
        return stored["status"]

    def changes(self) -> list:
        return [e for e in self.kube.events if e[3] in ("AutotuneChange", "AutotuneRevert")]

    def tuning(self) -> list[str]:
        return [m["data"]["tuning.json"] for m, _ in self.kube.applied if m["kind"] == "ConfigMap"]


def stored_llmd() -> dict:
    return {"metadata": {"name": "tiny", "namespace": "demo", "uid": "u", "generation": 1},
            "spec": spec_body(seqs=4, seqs_range=(2, 64)), "status": {}}


def test_a_new_leader_mid_interval_does_not_decide_again():
    snaps = {"s": snap(seqs=4, **SCHED)}  # scheduler-bound: the autotuner raises max_num_seqs
    stored = stored_llmd()
    old, new = Operator(snaps), Operator(snaps)

    st = old.pass_(stored, T0)  # the old leader decides and applies 4 -> 6, then is killed
    assert st["autotune"]["lastDecision"]["change"] == {"maxNumSeqs": [4, 6]}
    assert st["effective"]["maxNumSeqs"] == 6 and len(old.changes()) == 1

    # The new leader starts 2 s later (interval 5 s): it reads the decision time from status.
    snaps["s"] = snap(t=T0 + 2, seqs=6, **SCHED)
    st = new.pass_(stored, T0 + 2)
    assert st["autotune"]["lastDecision"]["change"] == {"maxNumSeqs": [4, 6]}  # the old one, kept
    assert st["effective"]["maxNumSeqs"] == 6  # not lost: the ConfigMap it writes says 6
    assert '"max_num_seqs": 6' in new.tuning()[-1]
    assert new.changes() == []

    # Due again (T0 + 6, within the 10 s cooldown): a hold, still no second change.
    snaps["s"] = snap(t=T0 + 6, seqs=6, **SCHED)
    st = new.pass_(stored, T0 + 6)
    assert st["autotune"]["lastDecision"]["action"] == "hold" and new.changes() == []
    changed = [h for h in st["autotune"]["history"] if h.get("change")]
    assert [h["change"] for h in changed] == [{"maxNumSeqs": [4, 6]}]
    assert st["effective"]["maxNumSeqs"] == 6 and '"max_num_seqs": 6' in new.tuning()[-1]
    assert len(old.changes()) + len(new.changes()) == 1


def test_without_the_status_the_new_leader_would_decide_again():
    """The control: a new leader that read a body predating the old leader's status write
    (what handlers._pass's re-read under the lock prevents) repeats the change."""
    snaps = {"s": snap(seqs=4, **SCHED)}
    stored = stored_llmd()
    stale = copy.deepcopy(stored)
    old, new = Operator(snaps), Operator(snaps)
    old.pass_(stored, T0)
    new.pass_(stale, T0 + 2)
    assert len(old.changes()) + len(new.changes()) == 2


def test_a_leader_killed_before_its_status_write_announces_nothing():
    """Killed at the status write (the first write of a pass: the ConfigMap follows it): no
    ConfigMap change and no Event from the dead leader; the new leader, finding no decision
    in status, makes it (same change) and announces it once."""
    snaps = {"s": snap(seqs=4, **SCHED)}
    stored = stored_llmd()
    old, new = Operator(snaps), Operator(snaps)

    def killed_at_status_write(manifest, subresource=""):
        if subresource == "status":
            raise SystemExit("killed")  # the process dies here: nothing after runs
        return FakeKube.apply(old.kube, manifest, subresource)
    old.kube.apply = killed_at_status_write
    try:
        old.pass_(stored, T0)
    except SystemExit:
        pass
    assert old.tuning() == [] and stored["status"] == {} and old.changes() == []
    st = new.pass_(stored, T0 + 2)
    assert st["autotune"]["lastDecision"]["change"] == {"maxNumSeqs": [4, 6]}
    assert '"max_num_seqs": 6' in new.tuning()[-1]
    assert len(new.changes()) == 1 and [h["change"] for h in st["autotune"]["history"]] == [{"maxNumSeqs": [4, 6]}]
