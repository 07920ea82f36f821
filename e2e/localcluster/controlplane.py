"""Command lines of the control-plane processes: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler, all on local addresses."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .certs import Pki

# What kube-controller-manager runs: enough for Deployments, Services,
# cascade deletion, namespaces, service accounts, PodDisruptionBudgets, Jobs.
CONTROLLERS = [
    "deployment-controller", "replicaset-controller", "statefulset-controller",
    "endpoints-controller", "endpointslice-controller", "endpointslice-mirroring-controller",
    "garbage-collector-controller", "namespace-controller", "serviceaccount-controller",
    "serviceaccount-token-controller", "root-ca-certificate-publisher-controller",
    "disruption-controller", "job-controller", "ttl-after-finished-controller",
    "pod-garbage-collector-controller", "clusterrole-aggregation-controller",
    "resourcequota-controller",
    # Autoscalers (an HPA, or KEDA's ScaledObject through one) drive an LLMDeployment's scale
    # subresource; kvpilot must leave replicas to them.
    "horizontal-pod-autoscaler-controller",
    # Binds PersistentVolumeClaims to PersistentVolumes (a model cache PVC on a hostPath PV).
    "persistentvolume-binder-controller",
]


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    prometheus_operator: int


def etcd_argv(bin: Path, data: Path, p: Ports) -> list[str]:
    client, peer = f"http://127.0.0.1:{p.etcd_client}", f"http://127.0.0.1:{p.etcd_peer}"
    return [str(bin / "etcd"), "--name=local", f"--data-dir={data}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=local={peer}", "--log-level=warn",
            "--unsafe-no-fsync",  # a throwaway test cluster: speed over durability
            "--quota-backend-bytes=4294967296"]


def apiserver_argv(bin: Path, pki: Pki, p: Ports, address: str, service_cidr: str) -> list[str]:
    return [
        str(bin / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{p.etcd_client}",
        f"--bind-address={address}", f"--advertise-address={address}", f"--secure-port={p.apiserver}",
        f"--tls-cert-file={pki.cert('apiserver')}", f"--tls-private-key-file={pki.key('apiserver')}",
        f"--client-ca-file={pki.ca}",
        # Request-header authentication: the scheduler and controller manager read
        # its CA bundle, and aggregated API servers (KEDA's metrics adapter) trust
        # the front-proxy-client certificate the API server proxies to them with.
        f"--requestheader-client-ca-file={pki.ca}", "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pki.cert('front-proxy-client')}",
        f"--proxy-client-key-file={pki.key('front-proxy-client')}",
        # The aggregator dials an APIService's endpoint (from its EndpointSlice) rather
        # than its ClusterIP: KEDA's adapter runs on the host, outside kube-proxy's rules.
        "--enable-aggregator-routing=true",
        "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-cluster-ip-range={service_cidr}",
        # The `kubernetes` Service's endpoint (the gateway), for pods that reach the API via its ClusterIP.
        "--endpoint-reconciler-type=lease",
        f"--kubelet-client-certificate={pki.cert('admin')}", f"--kubelet-client-key={pki.key('admin')}",
        f"--kubelet-certificate-authority={pki.ca}", "--kubelet-preferred-address-types=InternalIP",
        "--allow-privileged=true", "--profiling=false", "--v=1",
    ]


def controller_manager_argv(bin: Path, pki: Pki, p: Ports, kubeconfig: Path, service_cidr: str,
                            extra_controllers: tuple[str, ...] = ()) -> list[str]:
    return [
        str(bin / "kube-controller-manager"),
        f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1", f"--secure-port={p.controller_manager}",
        "--leader-elect=false", "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki.sa_key}", f"--root-ca-file={pki.ca}",
        f"--service-cluster-ip-range={service_cidr}",
        f"--controllers={','.join(CONTROLLERS + list(extra_controllers))}",
        "--concurrent-deployment-syncs=10", "--concurrent-replicaset-syncs=10",
        "--horizontal-pod-autoscaler-sync-period=5s",
        "--profiling=false", "--v=1",
    ]


def scheduler_argv(bin: Path, p: Ports, kubeconfig: Path) -> list[str]:
    return [
        str(bin / "kube-scheduler"),
        f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1", f"--secure-port={p.scheduler}",
        "--leader-elect=false", "--profiling=false", "--v=1",
    ]
