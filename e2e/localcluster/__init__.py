"""A real local Kubernetes for tests and the demo (see e2e/README.md):
etcd, kube-apiserver, kube-controller-manager and kube-scheduler built from
their Go modules, a node whose pods are local processes, and Prometheus.

    from localcluster import LocalCluster, wait_for
    with LocalCluster("/tmp/c") as c:
        c.apply(yaml_text); c.kubectl("get", "pods")
"""
from .cluster import ClusterError, LocalCluster
from .waiting import wait_for

__all__ = ["ClusterError", "LocalCluster", "wait_for"]
