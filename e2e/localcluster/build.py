"""Locates the Go-built binaries, building them once (progress on stderr):
Kubernetes (e2e/k8s), the node's runtime (e2e/containerd, e2e/cni, e2e/pause,
e2e/coredns, e2e/deviceplugin), Prometheus (e2e/prometheus), the Prometheus Operator
(e2e/prometheus-operator) and KEDA (e2e/keda)."""
from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .paths import E2E_DIR, PROJECT_VERSION, cache_dir

K8S_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl",
                "kubelet", "kube-proxy")


class BuildError(RuntimeError):
    """A part of the local cluster (a Go program, helm, kvpilot's images) failed to build; the
    build's own output, above, says why."""


def version_of(module: str) -> str:
    """The pinned version of an e2e Go module (its VERSION file)."""
    return (E2E_DIR / module / "VERSION").read_text().strip()


def _ensure(module: str, binaries: tuple[str, ...]) -> Path:
    d = cache_dir() / module / version_of(module) / "bin"
    if (d / ".complete").exists() and all((d / b).exists() for b in binaries):
        return d
    r = subprocess.run([str(E2E_DIR / module / "build.sh")], stdout=subprocess.PIPE, stderr=None,
                       text=True)
    if r.returncode != 0:
        raise BuildError(f"building {module} {version_of(module)} failed (see the output above)")
    return Path(r.stdout.strip().splitlines()[-1])


def ensure_binaries() -> Path:
    """The bin folder with etcd, kube-apiserver, kube-controller-manager,
    kube-scheduler, kubectl, kubelet and kube-proxy."""
    return _ensure("k8s", K8S_BINARIES)


def ensure_node_binaries() -> dict[str, Path]:
    """The node's runtime pieces: containerd's bin folder, the CNI plugins' bin
    folder, and the pause, CoreDNS and device plugin executables."""
    return {
        "containerd": _ensure("containerd", ("containerd", "containerd-shim-runc-v2", "ctr")),
        "cni": _ensure("cni", ("bridge", "host-local", "loopback", "portmap")),
        "pause": _ensure("pause", ("pause",)) / "pause",
        "coredns": _ensure("coredns", ("coredns",)) / "coredns",
        "device_plugin": _ensure("deviceplugin", ("kvpilot-device-plugin",)) / "kvpilot-device-plugin",
    }


def ensure_prometheus() -> Path:
    """The prometheus executable (with Kubernetes service discovery)."""
    return _ensure("prometheus", ("prometheus", "promtool")) / "prometheus"


def ensure_promtool() -> Path:
    """promtool from the same Prometheus release (checks and unit-tests alerting rules)."""
    return _ensure("prometheus", ("prometheus", "promtool")) / "promtool"


def ensure_prometheus_operator() -> Path:
    """The bin folder with the Prometheus Operator's `operator` and
    `prometheus-config-reloader`; its release's CRDs are in ../crds."""
    return _ensure("prometheus-operator", ("operator", "prometheus-config-reloader",
                                           "../crds/monitoring.coreos.com_prometheuses.yaml"))


def ensure_keda() -> Path:
    """The bin folder with KEDA's `operator` and `adapter` (its metrics API server)."""
    return _ensure("keda", ("operator", "adapter"))


KVPILOT_IMAGE = f"docker.io/kvpilot/engine:{PROJECT_VERSION}"  # the real engine (torch)
KVPILOT_OPERATOR_IMAGE = f"docker.io/kvpilot/operator:{PROJECT_VERSION}"  # operator, gateway, simulated pods


IMAGE_REFS = {"operator": KVPILOT_OPERATOR_IMAGE, "engine": KVPILOT_IMAGE}


def ensure_images(targets: tuple[str, ...] = ("operator", "engine")) -> list[tuple[str, Path]]:
    """kvpilot's own images (`make image`, e2e/image/build.sh) as (name, OCI archive): the
    operator's (the operator, the gateway and simulated pods) and, where real engine pods
    run, the engine's (torch, several GB: built only for what needs it). Built on the first
    run and after any change to what goes into them."""
    unknown = set(targets) - set(IMAGE_REFS)
    if unknown:
        raise ValueError(f"targets: unknown image target(s) {sorted(unknown)}; known: {sorted(IMAGE_REFS)}")
    r = subprocess.run([str(E2E_DIR / "image" / "build.sh"), *targets],
                       stdout=subprocess.PIPE, stderr=None, text=True)
    if r.returncode != 0:
        free = shutil.disk_usage(cache_dir()).free / 2**30
        raise BuildError(f"building kvpilot's images {', '.join(targets)} failed (see the output above; "
                         f"{free:.1f} GiB free now under {cache_dir()})")
    archives = r.stdout.strip().splitlines()[-len(targets):]
    return [(IMAGE_REFS[t], Path(a)) for t, a in zip(targets, archives)]


# The Go programs a cluster start builds after Kubernetes, in build order.
LATER_GO_MODULES = ("prometheus", "prometheus-operator", "containerd", "cni", "pause", "coredns", "deviceplugin")


def prefetch_modules(modules: tuple[str, ...]) -> None:
    """Downloads the Go modules of the programs not built yet (`go mod download`, into Go's
    module cache), so a cold start fetches them while Kubernetes compiles instead of before
    each build. Best effort: a failure here is the build's to report, with its output."""
    for module in modules:
        if (cache_dir() / module / version_of(module) / "bin" / ".complete").exists():
            continue
        try:
            subprocess.run(["go", "mod", "download"], cwd=E2E_DIR / module, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return


def ensure_cluster_parts(image_targets: tuple[str, ...]) -> list[tuple[str, Path]]:
    """Everything a cluster start and a chart install need, built once, and kvpilot's images
    as (name, archive). The Go programs build one after another (each build keeps both cores
    busy) while the images build beside them: theirs is mostly downloading and unpacking
    (Debian's packages, wheels), which a cold start would otherwise wait for on its own. The
    later Go programs' modules download beside them too."""
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="cluster-parts") as pool:
        images = pool.submit(ensure_images, image_targets)
        pool.submit(prefetch_modules, LATER_GO_MODULES)
        ensure_binaries()
        ensure_prometheus()
        ensure_prometheus_operator()
        ensure_node_binaries()
        r = subprocess.run([str(E2E_DIR / "build-helm.sh")], stdout=subprocess.DEVNULL, stderr=None)
        if r.returncode != 0:
            raise BuildError("building helm failed (see the output above)")
        return images.result()
