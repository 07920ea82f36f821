"""What gpu_check's end-to-end parts share: a scratch folder removed afterwards, and a
failure recorded in the part's result (with its traceback) instead of raised, so one
part's failure leaves the others' figures."""

from __future__ import annotations

import gc
import shutil
import tempfile
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def part_workdir(result: dict[str, Any], prefix: str) -> Iterator[Path]:
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield workdir
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        result["traceback"] = traceback.format_exc()
    finally:
        gc.collect()
        shutil.rmtree(workdir, ignore_errors=True)


def status_lines(result: dict[str, Any], title: str) -> list[str] | None:
    """The part's one line when it was skipped or failed; None when it has figures."""
    if "skipped" in result:
        return [f"{title}: skipped ({result['skipped']})"]
    if "error" in result:
        return [f"{title}: FAILED {result['error']}"]
    return None
