"""The root of kvpilot's on-disk cache (models, compiled kernels), shared by every part of
the engine; its own module so low layers (the C++ decode kernel) can find it without
importing the model loader above them."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$KVPILOT_CACHE_DIR, default ~/.cache/kvpilot."""
    return Path(os.environ.get("KVPILOT_CACHE_DIR") or "~/.cache/kvpilot").expanduser()
