"""Where the kubernetes client's configuration comes from, for every process that talks
to the API (the operator, its leader election, the gateway)."""
from __future__ import annotations

import os


class NoKubeConfig(ValueError):
    """No configuration to reach a Kubernetes API (a command-line error: one line, exit 2)."""


def load_kube_config() -> None:
    """$KUBECONFIG when set (how the e2e node runs it), else in-cluster, else ~/.kube/config;
    NoKubeConfig, saying where it looked, when none of them is there."""
    from kubernetes import config
    try:
        if os.environ.get("KUBECONFIG"):
            config.load_kube_config()
            return
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
    except (config.ConfigException, OSError, TypeError, ValueError) as e:
        where = f"$KUBECONFIG ({os.environ['KUBECONFIG']})" if os.environ.get("KUBECONFIG") else \
            "in-cluster service account or ~/.kube/config"
        raise NoKubeConfig(f"no Kubernetes API configuration ({where}): {e}".rstrip(". ")) from None
