"""Where things live: the repository, its venv, the build caches."""
from __future__ import annotations

import os
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = E2E_DIR.parent
VENV_BIN = REPO_ROOT / ".venv" / "bin"
K8S_MODULE_DIR = E2E_DIR / "k8s"
K8S_VERSION = (K8S_MODULE_DIR / "VERSION").read_text().strip()


def cache_dir() -> Path:
    """The per-user cache (binaries keyed by version), outside the repository."""
    return Path(os.environ.get("KVPILOT_CACHE_DIR") or Path.home() / ".cache" / "kvpilot")
PROJECT_VERSION = next(line.split('"')[1] for line in (REPO_ROOT / "pyproject.toml").read_text().splitlines()
                       if line.startswith("version = "))
