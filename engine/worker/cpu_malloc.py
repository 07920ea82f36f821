"""Keep freed memory in the process on the CPU path (glibc's mallopt).

Every step allocates and frees activations of a few to tens of MiB. With glibc's
defaults the larger ones are mmap'd and unmapped each time, and the heap's free top is
trimmed back to the kernel, so the next step faults the same pages in again (zeroed by
the kernel): on the 55M-parameter benchmark that was ~940k page faults in 18 s. vLLM's
CPU backend preloads tcmalloc for the same reason; this does it without a preload. The
cost: the resident set stays at its peak. A no-op where libc has no mallopt (musl)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("kvpilot.engine")

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's <malloc.h>
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit: larger blocks are always mmap'd
TOP_PAD = 256 << 20


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; True if glibc took all three settings."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, TOP_PAD)))
    if not ok:
        log.info("glibc refused a mallopt setting; freed memory may go back to the kernel")
    return ok
