"""pytest fixtures for tests against the local Kubernetes (e2e/localcluster).

    cluster        session-scoped LocalCluster: .kubeconfig, .prometheus_url,
                   .env(), .apply(yaml), .kubectl(...), .api_client(), .kube()
    namespace      a fresh namespace for one test, Pod Security `restricted` enforced
                   (deleted afterwards)
    wait_for       the polling helper (predicate, timeout, interval)
    shared_operator session-scoped SharedOperator: one chart install reused by every module
                   that asks for the same settings (`.get(resync, values)` returns its kube
                   client; a module that kills or reconfigures the operator sets
                   SPOILS_OPERATOR = True, and the next module gets a fresh install). A
                   module that wants other settings names them in OPERATOR; one that installs
                   its own sets OWN_OPERATOR = True. Modules run grouped by these
                   (operator_rank), so that the session installs as few times as it can
    tuned_operator module-scoped: the shared operator with a 1 s resync (skips without
                   Prometheus); yields its kube client

The first run on a machine builds Kubernetes from the Go module proxy (see
e2e/README.md); later runs start the cluster in well under a minute."""
from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from localcluster import LocalCluster, wait_for as _wait_for  # noqa: E402
from localcluster.build import BuildError, ensure_cluster_parts, ensure_keda  # noqa: E402

IMAGES = pytest.StashKey[list]()  # (name, OCI archive) of the images built for this session


def pytest_configure(config):
    config.addinivalue_line("markers", "keda: needs KEDA built from its Go module (~11 min the first time); "
                                       "run by make autotune-bench, not make test")


# The shared operator's settings where a module does not name its own (`OPERATOR`, the
# keyword arguments of SharedOperator.get): tuned_operator's.
DEFAULT_OPERATOR = {"resync_interval": 1}


def operator_rank(module) -> tuple[int, str]:
    """Where a module runs in the session. Each change of the shared operator's settings is
    one more install, so: the modules on the default operator (or none) first, then those that
    spoil it (each needs a fresh install after it anyway), then those that ask for other
    settings, grouped, and last the module that installs its own with helm."""
    if getattr(module, "OWN_OPERATOR", False):
        return 3, ""
    settings = getattr(module, "OPERATOR", DEFAULT_OPERATOR)
    if settings != DEFAULT_OPERATOR:
        return 2, repr(sorted(settings.items()))
    return (1 if getattr(module, "SPOILS_OPERATOR", False) else 0), ""


def pytest_collection_modifyitems(session, config, items):
    # A stable sort: within a rank, modules (and the tests in each) keep pytest's order.
    items.sort(key=lambda item: operator_rank(item.module) if getattr(item, "module", None) else (0, ""))


def image_targets(items) -> tuple[str, ...]:
    """kvpilot's images the selected tests need: the operator's always (the operator, the
    gateway and simulated pods run it); the engine's (torch, several GB) only where a module
    runs the real engine, which it says with ENGINE_IMAGE = True."""
    modules = {i.module for i in items if getattr(i, "module", None) is not None}
    return ("operator", "engine") if any(getattr(m, "ENGINE_IMAGE", False) for m in modules) else ("operator",)


def pytest_collection_finish(session):
    """Builds the binaries (first run on a machine only) before any test runs,
    so the build is not counted in a test's timeout; progress is shown live."""
    if os.geteuid() != 0 or not any("cluster" in getattr(i, "fixturenames", ()) for i in session.items):
        return
    capman = session.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        try:
            # kvpilot's own images (every pod runs from one of them), built beside the Go programs
            session.config.stash[IMAGES] = ensure_cluster_parts(image_targets(session.items))
            if any(Path(str(i.path)).name == "test_keda.py" for i in session.items):
                ensure_keda()  # KEDA's first build is long too; only when its test runs
        except BuildError as e:
            # One line, not an INTERNALERROR traceback: no test can run without these parts.
            pytest.exit(f"the local cluster's parts could not be built: {e}", returncode=pytest.ExitCode.INTERNAL_ERROR)


@pytest.fixture(scope="session")
def cluster(request, tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the local cluster needs root (network and mount namespaces)")
    images = request.config.stash.get(IMAGES, None)
    c = LocalCluster(tmp_path_factory.mktemp("localcluster"), images=images)
    # Shown live (not captured): the first run builds Kubernetes, with progress.
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        c.start()  # stops what it started if it fails
    yield c
    swept = c.stop()
    left = c.leftover_processes()
    assert not left, f"processes still running after the cluster stopped: {left}"
    assert not swept, f"processes had to be killed after the node and control plane stopped: {swept}"


@pytest.fixture
def namespace(cluster):
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.restore_images()  # pods of this test start from kvpilot's image
    cluster.create_namespace(name)  # Pod Security `restricted` enforced, as users run it
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def wait_for():
    return _wait_for


class SharedOperator:
    """The chart's operator, installed once for every module that asks for the same settings:
    an install waits for the last one's namespace to go and for two operator pods to start,
    about 20 s on this host, and most modules want the same one."""

    def __init__(self, cluster: LocalCluster, wait_for):
        self.cluster, self.wait_for = cluster, wait_for
        self.key: tuple | None = None
        self.install = None  # the installed_operator context manager in use
        self.kube = None

    def get(self, resync_interval: float, values: dict | None = None):
        from test_operator import installed_operator, operator_ready  # a test module's helpers
        key = (resync_interval, tuple(sorted((values or {}).items())))
        if key == self.key and self.kube is not None and operator_ready(self.kube):
            return self.kube
        self.release()
        install = installed_operator(self.cluster, self.wait_for, resync_interval=resync_interval, values=values)
        self.kube = install.__enter__()
        self.install, self.key = install, key
        return self.kube

    def release(self) -> None:
        """Uninstall (the next get() installs afresh)."""
        install, self.install, self.key = self.install, None, None
        if install is not None:
            install.__exit__(None, None, None)


@pytest.fixture(scope="session")
def shared_operator(cluster, wait_for):
    shared = SharedOperator(cluster, wait_for)
    yield shared
    shared.release()


@pytest.fixture(scope="module")
def tuned_operator(request, cluster, shared_operator):
    if not cluster.prometheus_url:
        pytest.skip("the local cluster runs without Prometheus")
    yield shared_operator.get(**DEFAULT_OPERATOR)
    if getattr(request.module, "SPOILS_OPERATOR", False):
        shared_operator.release()
