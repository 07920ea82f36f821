"""Locates the Go-built binaries, building them once (progress on stderr):
the control plane (e2e/k8s), Prometheus (e2e/prometheus) and KEDA (e2e/keda)."""
from __future__ import annotations

import subprocess
from pathlib import Path

from .paths import E2E_DIR, cache_dir

K8S_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")


def _version(module: str) -> str:
    return (E2E_DIR / module / "VERSION").read_text().strip()


def _ensure(module: str, binaries: tuple[str, ...]) -> Path:
    d = cache_dir() / module / _version(module) / "bin"
    if (d / ".complete").exists() and all((d / b).exists() for b in binaries):
        return d
    r = subprocess.run([str(E2E_DIR / module / "build.sh")], stdout=subprocess.PIPE, stderr=None,
                       text=True)
    if r.returncode != 0:
        raise RuntimeError(f"building {module} {_version(module)} failed (see the output above)")
    return Path(r.stdout.strip().splitlines()[-1])


def ensure_binaries() -> Path:
    """The bin folder with etcd, kube-apiserver, kube-controller-manager,
    kube-scheduler and kubectl."""
    return _ensure("k8s", K8S_BINARIES)


def ensure_prometheus() -> Path:
    """The prometheus executable (with Kubernetes service discovery)."""
    return _ensure("prometheus", ("prometheus",)) / "prometheus"


def ensure_keda() -> Path:
    """The bin folder with KEDA's `operator` and `adapter` (its metrics API server)."""
    return _ensure("keda", ("operator", "adapter"))
