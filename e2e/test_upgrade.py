"""`helm upgrade` reaches running engine pods: the chart installed with helm itself, a simulated
LLMDeployment Ready on the operator's image, then `helm upgrade --reuse-values --set
image.tag=NEW`. The operator pods roll to the new tag, and the engine pod, whose image comes
from the operator's configuration (not from a default stored in the LLMDeployment), rolls
to it too. NEW is the same image under a second tag, so that both start on this node."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import kvsession as ks
from localcluster.build import KVPILOT_OPERATOR_IMAGE
from localcluster.kubeletnode import Ctr
from test_operator import (CHART, OPERATOR_NS, RELEASE, diagnose, earlier_install_gone, helm_binary,
                           operator_ready)

pytestmark = pytest.mark.e2e
SPOILS_OPERATOR = True  # the release is helm's own: the next module installs afresh
OWN_OPERATOR = True  # (conftest runs this module last)

NEW_TAG = "upgraded"
NAME = "sim"


def helm(cluster, *args: str) -> str:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    r = subprocess.run([helm_binary(), *args], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, f"helm {' '.join(args)}: {r.stderr}"
    return r.stdout


@pytest.fixture(scope="module")
def release(cluster, shared_operator, wait_for):
    if not cluster.prometheus_url:
        pytest.skip("the local cluster runs without Prometheus")
    shared_operator.release()  # this module's install is helm's, under the same name
    kube = cluster.kube()
    wait_for(lambda: earlier_install_gone(kube), timeout=180,
             what=f"the shared install's pods in {OPERATOR_NS} to be gone")
    ctr = Ctr(Path(cluster.state["containerd_bin"]), Path(cluster.state["containerd_socket"]))
    new_ref = KVPILOT_OPERATOR_IMAGE.rsplit(":", 1)[0] + f":{NEW_TAG}"
    ctr.run("images", "tag", "--force", KVPILOT_OPERATOR_IMAGE, new_ref)
    # --take-ownership: the cluster-wide objects (ClusterRole, its binding) of the earlier
    # modules' installs, applied without helm, are adopted, as when a kubectl-applied install
    # moves to helm.
    helm(cluster, "install", RELEASE, str(CHART), "-n", OPERATOR_NS, "--create-namespace", "--take-ownership",
         "--set", "gateway.enabled=false", "--set", "resyncInterval=1", "--set", "logLevel=INFO")
    try:
        wait_for(lambda: operator_ready(kube), timeout=180, what="the operator pod to be Ready")
    except TimeoutError:
        raise AssertionError(diagnose(cluster, OPERATOR_NS)) from None
    yield kube
    helm(cluster, "uninstall", RELEASE, "-n", OPERATOR_NS, "--wait=false")
    cluster.kubectl("delete", "namespace", OPERATOR_NS, "--wait=false", check=False)
    ctr.run("images", "rm", new_ref, check=False)


def pod_images(kube, ns: str, selector: str) -> set[str]:
    """The images of the Ready pods' containers, without the default registry's name."""
    pods = kube.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector})["items"]
    return {c["image"].removeprefix("docker.io/") for p in pods if not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
            for c in p["spec"]["containers"]}


def test_helm_upgrade_rolls_the_operator_and_the_engine_pods(cluster, release, namespace, wait_for):
    kube = release
    engine = {"maxNumSeqs": 16, "maxModelLen": 1024, "simulate": {"accelerator": "l4", "model": "llama-3.1-8b"}}
    m = ks.llmd_manifest(namespace, NAME, engine, {"mode": "Off"},
                         resources={"gpus": 1, "cpu": "100m", "memory": "256Mi"}, model={"servedName": NAME})
    try:
        ks.deploy(cluster, kube, m)
    except ks.SetupError as e:
        raise AssertionError(f"{e}\n{diagnose(cluster, namespace)}") from None
    engine_selector = f"{ks.INSTANCE_LABEL}={NAME}"
    old = KVPILOT_OPERATOR_IMAGE.removeprefix("docker.io/")
    assert pod_images(kube, namespace, engine_selector) == {old}

    helm(cluster, "upgrade", RELEASE, str(CHART), "-n", OPERATOR_NS, "--reuse-values", "--set", f"image.tag={NEW_TAG}")
    new = f"kvpilot/operator:{NEW_TAG}"
    try:
        wait_for(lambda: pod_images(kube, OPERATOR_NS, "app.kubernetes.io/name=kvpilot-operator") == {new},
                 timeout=240, interval=1, what="every operator pod on the new tag")
        wait_for(lambda: pod_images(kube, namespace, engine_selector) == {new},
                 timeout=240, interval=1, what="the engine pod rolled to the new tag")
    except TimeoutError as e:
        raise AssertionError(f"{e}\n{diagnose(cluster, namespace)}") from None
    obj = ks.get_llmd(kube, namespace, NAME)
    assert "image" not in obj["spec"]["engine"]  # nothing stored in the object had to change
