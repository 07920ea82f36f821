"""Flux's and kpt's view of an LLMDeployment: the real kstatus (sigs.k8s.io/cli-utils,
built by e2e/kstatus/build.sh) computes the status of objects the operator's own status code
writes: Current when ready at the observed generation, InProgress while it rolls out or
before the operator saw the generation, Failed when it is stuck."""
from __future__ import annotations

import json
import subprocess

import pytest

from go_tools import built_tool
from status_examples import MISSING_SECRET, READY, ROLLING, STUCK, llmd, status

@pytest.fixture(scope="module")
def kstatus() -> str:
    return built_tool("kstatus/build.sh", "kstatus")


def test_kstatus_reads_the_operators_conditions(kstatus):
    objects = [
        llmd(status(READY)),
        llmd(status(READY, generation=2)),  # the spec changed since the last status
        llmd(status(ROLLING)),
        llmd(status(READY, [MISSING_SECRET])),
        llmd(status(STUCK)),
    ]
    proc = subprocess.run([kstatus], input=json.dumps(objects), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    got = [(r["status"], r["message"]) for r in json.loads(proc.stdout)]
    assert [s for s, _ in got] == ["Current", "InProgress", "InProgress", "Failed", "Failed"], got
    assert got[2][1] == "1/2 updated, 1/2 ready"
    assert "does not exist" in got[3][1] and "no progress" in got[4][1]
