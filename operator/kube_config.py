"""Where the kubernetes client's configuration comes from, for every process that talks
to the API (the operator, its leader election, the gateway)."""
from __future__ import annotations

import os


def load_kube_config() -> None:
    """$KUBECONFIG when set (how the e2e node runs it), else in-cluster, else ~/.kube/config."""
    from kubernetes import config
    if os.environ.get("KUBECONFIG"):
        config.load_kube_config()
        return
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
