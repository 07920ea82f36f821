"""Hand torch's CPU threads from the loading thread to the engine thread.

OpenMP (libgomp, which torch ships) keeps one worker pool per thread that has started a
parallel region. The server loads the model on its main thread, then steps the engine on
another, so two pools exist; with more pool threads than cores, libgomp stops spinning
between parallel regions and every op of every step waits on a futex wake-up instead.
Measured on the 2-core benchmark host: the engine stepped from a second thread made
395-445 output tok/s against 495-540 from the main thread; freeing the main thread's
pool first brought it to 495-520."""

from __future__ import annotations

import ctypes
import os


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP pool (OpenMP 5's omp_pause_resource_all, soft).
    True if libgomp was loaded and did it; a later parallel region on this thread would
    make a new pool."""
    try:  # only the runtime already loaded (torch's); never load one for this
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(1) == 0  # 1: omp_pause_soft
