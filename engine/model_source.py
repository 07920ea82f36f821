"""Turn a `--model` value into a local model directory.

Accepted: `builtin:tiny` (created once in the cache with make-tiny-model defaults and
seed 0, then reused), `file:///ABS/PATH`, or a plain path. Kubernetes sources such as
`pvc://CLAIM/PATH` are mounted by the operator and reach the engine as paths.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

# Bump the suffix whenever make_tiny_model's defaults or output change, so caches
# written by an older kvpilot are not mistaken for the new model.
BUILTIN_MODELS = {"builtin:tiny": "builtin-tiny-v1"}
BUILTIN_SEED = 0

_EXPECTED = (
    "expected a Hugging Face model directory containing config.json "
    "(a path or file:///ABS/PATH) or one of " + ", ".join(sorted(BUILTIN_MODELS))
)


def cache_dir() -> Path:
    """$KVPILOT_CACHE_DIR, default ~/.cache/kvpilot."""
    return Path(os.environ.get("KVPILOT_CACHE_DIR") or "~/.cache/kvpilot").expanduser()


def resolve_model(model: str) -> Path:
    """The local directory `model` names; built-in models are created on first use."""
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model={model!r}: {_EXPECTED}")
    if model.startswith("builtin:"):
        if model not in BUILTIN_MODELS:
            raise ValueError(f"model={model!r} is not a built-in model; {_EXPECTED}")
        return _builtin(BUILTIN_MODELS[model])
    if model.startswith("file:"):
        url = urlparse(model)
        if url.netloc not in ("", "localhost") or not url.path.startswith("/"):
            raise ValueError(f"model={model!r}: a file URL needs an absolute path; {_EXPECTED}")
        path = Path(unquote(url.path))
    elif "://" in model:
        raise ValueError(f"model={model!r}: unsupported scheme; {_EXPECTED}")
    else:
        path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model={model!r}: {path} is not a directory; {_EXPECTED}")
    if not (path / "config.json").is_file():
        raise ValueError(f"model={model!r}: {path} has no config.json; {_EXPECTED}")
    return path.absolute()


def _builtin(name: str) -> Path:
    """Create the model once; processes starting together wait on one lock file."""
    models = cache_dir() / "models"
    target = models / name
    if (target / "config.json").is_file():  # make_tiny_model renames a finished folder in
        return target
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (target / "config.json").is_file():
                from .tiny_model import make_tiny_model

                make_tiny_model(target, seed=BUILTIN_SEED)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target
