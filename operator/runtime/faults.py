"""Fault injection for the fault tests only (e2e/test_operator_faults.py): a process exit at
a named point of the reconcile, so a test can kill the operator exactly between two writes.

Off unless KVPILOT_FAULT_EXIT_AFTER names the point (nothing sets it in a real install).
KVPILOT_FAULT_ONCE_FILE, when set, makes it fire once: the file is created just before the
exit, and a process that finds it there does not exit again. A file under the operator pod's
emptyDir (/scratch) survives the container's restart, so the restarted operator runs clean.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

EXIT_AFTER_ENV = "KVPILOT_FAULT_EXIT_AFTER"
ONCE_FILE_ENV = "KVPILOT_FAULT_ONCE_FILE"
EXIT_CODE = 86  # what the test looks for in the container's last termination state
# Fired after status (with a new autotune decision) is written, before the owned objects are.
STATUS_WRITTEN = "status-written"


def should_exit(point: str, environ: dict[str, str] | None = None) -> bool:
    """Whether the fault at `point` is armed (and, with a once-file, has not fired yet)."""
    env = os.environ if environ is None else environ
    if env.get(EXIT_AFTER_ENV) != point:
        return False
    once = env.get(ONCE_FILE_ENV)
    return not (once and Path(once).exists())


def exit_if_armed(point: str, environ: dict[str, str] | None = None) -> None:
    """Test hook: end the process at once (no cleanup, as a kill would) when armed."""
    if not should_exit(point, environ):
        return
    env = os.environ if environ is None else environ
    once = env.get(ONCE_FILE_ENV)
    if once:
        Path(once).touch()
    log.error("fault injection: exiting after %s (%s)", point, EXIT_AFTER_ENV)
    logging.shutdown()
    os._exit(EXIT_CODE)
