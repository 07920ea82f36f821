"""pytest fixtures for tests against the local Kubernetes (e2e/localcluster).

    cluster        session-scoped LocalCluster: .kubeconfig, .prometheus_url,
                   .env(), .apply(yaml), .kubectl(...), .api_client(), .kube()
    namespace      a fresh namespace for one test, Pod Security `restricted` enforced
                   (deleted afterwards)
    wait_for       the polling helper (predicate, timeout, interval)
    tuned_operator module-scoped: the chart's operator installed with a 1 s resync
                   (skips without Prometheus); yields its kube client

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
from localcluster.build import (ensure_binaries, ensure_images, ensure_keda,  # noqa: E402
                                ensure_node_binaries, ensure_prometheus)



def pytest_collection_finish(session):
    """Builds the binaries (first run on a machine only) before any test runs,
    so the build is not counted in a test's timeout; progress is shown live."""
    if os.geteuid() != 0 or not any("cluster" in getattr(i, "fixturenames", ()) for i in session.items):
        return
    capman = session.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        ensure_binaries()
        ensure_node_binaries()
        ensure_prometheus()
        ensure_images()  # kvpilot's own images: every pod runs from one of them
        if any(Path(str(i.path)).name == "test_keda.py" for i in session.items):
            ensure_keda()  # KEDA's first build is long too; only when its test runs


@pytest.fixture(scope="session")
def cluster(request, tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the local cluster needs root (network and mount namespaces)")
    c = LocalCluster(tmp_path_factory.mktemp("localcluster"))
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


@pytest.fixture(scope="module")
def tuned_operator(cluster, wait_for):
    from test_operator import installed_operator  # a test module's helper; imported when first used
    if not cluster.prometheus_url:
        pytest.skip("the local cluster runs without Prometheus")
    with installed_operator(cluster, wait_for, resync_interval=1) as kube:
        yield kube
