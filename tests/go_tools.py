"""Go programs the tests run (promtool, kstatus), built once per machine by their e2e build
scripts into ~/.cache/kvpilot; a test is skipped only where Go itself is missing."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def built_tool(script: str, executable: str) -> str:
    """Runs e2e/SCRIPT (prints its bin folder last) and returns the path of EXECUTABLE in it."""
    if shutil.which("go") is None:
        pytest.skip(f"Go is not installed: cannot build {executable} from its module")
    proc = subprocess.run([str(ROOT / "e2e" / script)], stdout=subprocess.PIPE, text=True)
    assert proc.returncode == 0, f"building {executable} failed (see the output above)"
    return str(Path(proc.stdout.strip().splitlines()[-1]) / executable)
