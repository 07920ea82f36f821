"""kubeconfig files: one with the admin identity for people and tests, and one
per control-plane component."""
from __future__ import annotations

from pathlib import Path

import yaml


def write_kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path,
                     user: str, cluster: str = "kvpilot-local") -> Path:
    cfg = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": cluster, "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": user, "namespace": "default"}}],
        "current-context": cluster,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    path.chmod(0o600)
    return path
