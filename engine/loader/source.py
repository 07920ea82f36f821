"""Turn a `--model` value into a local model directory.

Accepted: `builtin:tiny` (created once in the cache with make-tiny-model defaults and
seed 0, then reused), `builtin:tiny-trained` and `builtin:tiny-draft` (the same, trained on
stdlib sources by tiny_train: the default shape and tiny_train.DRAFT_SHAPE),
`hf://ORG/NAME[@REVISION]` and `s3://BUCKET/PREFIX` (downloaded into the cache once; see
model_fetch), `file:///ABS/PATH`, or a plain path. Kubernetes sources
such as `pvc://CLAIM/PATH` are mounted by the operator and reach the engine as paths.
With KVPILOT_MODEL_OFFLINE=1 a remote source must already be in the cache (the operator's
engine container: its init container downloaded it, and the engine holds no credentials).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

from ..config.cache_root import cache_dir

# Bump the suffix whenever make_tiny_model's defaults or output change (for the trained
# ones also tiny_train's recipe), so caches written by an older kvpilot are not mistaken
# for the new model.
BUILTIN_MODELS = {
    "builtin:tiny": "builtin-tiny-v1",
    "builtin:tiny-trained": "builtin-tiny-trained-v1",
    "builtin:tiny-draft": "builtin-tiny-draft-v1",
}
BUILTIN_SEED = 0

_EXPECTED = (
    "expected a Hugging Face model directory containing config.json "
    "(a path or file:///ABS/PATH), hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX or one of "
    + ", ".join(sorted(BUILTIN_MODELS))
)
FETCH_LOG_EVERY_S = 5.0


def resolve_model(model: str) -> Path:
    """The local directory `model` names; built-in models are created on first use."""
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model={model!r}: {_EXPECTED}")
    if model.startswith("builtin:"):
        if model not in BUILTIN_MODELS:
            raise ValueError(f"model={model!r} is not a built-in model; {_EXPECTED}")
        return _builtin(model)
    if model.startswith(("hf://", "s3://")):
        return _remote(model)
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


def _remote(model: str) -> Path:
    """A fetched snapshot: from the cache alone when offline, else downloaded (or found)
    with progress in the log."""
    from ..fetch.download import FetchOptions, cached_snapshot, fetch, require_cached
    from ..fetch.uri import HubSource, parse_source

    models = cache_dir() / "models"
    if os.environ.get("KVPILOT_MODEL_OFFLINE", "").lower() in ("1", "true", "yes"):
        return require_cached(model, models)
    source = parse_source(model)
    if isinstance(source, HubSource) and source.pinned and (snap := cached_snapshot(model, models)):
        return snap  # a commit never changes: no need to ask the Hub again
    log = logging.getLogger("kvpilot.engine")
    last = [0.0]

    def progress(p) -> None:
        now = time.monotonic()
        if p.phase in ("Ready", "Verifying") or now - last[0] >= FETCH_LOG_EVERY_S:
            last[0] = now
            log.info("%s", p.line())

    return fetch(model, FetchOptions.from_env(models, progress=progress)).path


def _builtin(model: str) -> Path:
    """Create the model once; processes starting together wait on one lock file."""
    name = BUILTIN_MODELS[model]
    models = cache_dir() / "models"
    target = models / name
    if (target / "config.json").is_file():  # make_tiny_model renames a finished folder in
        return target
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (target / "config.json").is_file():
                _create_builtin(model, target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def _create_builtin(model: str, target: Path) -> None:
    if model == "builtin:tiny":
        from ..tiny.model import make_tiny_model

        make_tiny_model(target, seed=BUILTIN_SEED)
        return
    from ..tiny.train import DRAFT_SHAPE, make_trained_model

    logging.getLogger("kvpilot.engine").info(
        "training %s once into %s (a few minutes on a CPU)", model, target)
    shape = DRAFT_SHAPE if model == "builtin:tiny-draft" else {}
    make_trained_model(target, seed=BUILTIN_SEED, **shape)
