"""The configuration files of the local cluster's node, as pure functions of
its folders and addresses (addresses.py): containerd's config.toml, the CNI
network list, the KubeletConfiguration and the KubeProxyConfiguration."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .addresses import ClusterAddresses

CLUSTER_DOMAIN = "cluster.local"


@dataclass(frozen=True)
class NodeLayout(ClusterAddresses):
    workdir: Path          # per-cluster: sockets, kubelet root, logs, CNI state
    containerd_root: Path  # images and snapshots; may be shared by successive clusters

    @property
    def containerd_state(self) -> Path:
        return self.workdir / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.containerd_state / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        return self.workdir / "kubelet"

    @property
    def pod_logs(self) -> Path:
        return self.workdir / "pod-logs"

    @property
    def cni_conf_dir(self) -> Path:
        return self.workdir / "cni" / "net.d"

    @property
    def cni_state(self) -> Path:
        return self.workdir / "cni" / "state"

    @property
    def device_plugin_dir(self) -> Path:
        # Fixed by the device-plugin API (v1beta1.DevicePluginPath), whatever --root-dir says:
        # one reason a machine runs one local cluster's node at a time.
        return Path("/var/lib/kubelet/device-plugins")


def containerd_config(n: NodeLayout, *, cni_bin: Path, runc: str, sandbox_image: str) -> str:
    """containerd 2.x's config.toml (schema version 3) for the CRI the kubelet talks to."""
    cri_runtime = "plugins.'io.containerd.cri.v1.runtime'"
    return f"""version = 3
root = {json.dumps(str(n.containerd_root))}
state = {json.dumps(str(n.containerd_state / "state"))}

[grpc]
  address = {json.dumps(str(n.containerd_socket))}

[ttrpc]
  address = {json.dumps(str(n.containerd_state / "containerd.sock.ttrpc"))}

[debug]
  level = "info"

[{cri_runtime}]
  # Pod network namespaces live under the state folder, not the host's /var/run/netns.
  netns_mounts_under_state_dir = true
  enable_selinux = false
  # This machine may not let root lower an oom_score_adj (no CAP_SYS_RESOURCE in its
  # sandbox): keep containers' scores at or above containerd's own, as rootless setups do.
  restrict_oom_score_adj = true

[{cri_runtime}.containerd]
  default_runtime_name = "runc"

[{cri_runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri_runtime}.containerd.runtimes.runc.options]
  BinaryName = {json.dumps(runc)}
  Root = {json.dumps(str(n.containerd_state / "runc"))}
  SystemdCgroup = false

[{cri_runtime}.cni]
  bin_dirs = [{json.dumps(str(cni_bin))}]
  conf_dir = {json.dumps(str(n.cni_conf_dir))}
  max_conf_num = 1

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = {json.dumps(sandbox_image)}

[plugins.'io.containerd.grpc.v1.cri']
  # kubectl exec/attach/port-forward: the kubelet proxies to this streaming server.
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""


def cni_conflist(n: NodeLayout) -> dict:
    """A bridge with host-local addresses; portmap for hostPort."""
    return {"cniVersion": "1.0.0", "name": "kvpilot", "plugins": [
        {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
         "hairpinMode": True,
         "ipam": {"type": "host-local", "dataDir": str(n.cni_state),
                  "ranges": [[{"subnet": n.pod_subnet, "gateway": n.pod_gateway}]],
                  "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ]}


def kubelet_config(n: NodeLayout, *, ca: Path, serving_cert: Path, serving_key: Path,
                   port: int, cgroup_root: str, resolv_conf: Path, max_pods: int) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        # This machine has cgroup v1 (hybrid); Kubernetes 1.35+ refuses it unless told.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        # Each cluster's pods under their own cgroup, so two clusters never meet.
        "cgroupRoot": cgroup_root, "cgroupsPerQOS": True, "enforceNodeAllocatable": ["pods"],
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{n.containerd_socket}",
        "address": n.node_ip, "port": port, "readOnlyPort": 0, "healthzPort": 0,
        "tlsCertFile": str(serving_cert), "tlsPrivateKeyFile": str(serving_key),
        "authentication": {"x509": {"clientCAFile": str(ca)}, "webhook": {"enabled": False},
                           "anonymous": {"enabled": False}},
        # The API server calls in with the admin certificate (system:masters).
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [n.dns_ip], "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(resolv_conf),
        "podLogsDir": str(n.pod_logs),
        "staticPodPath": "",
        "maxPods": max_pods,
        "serializeImagePulls": False,
        # A shared test machine's disk is not the node's to police. A disk threshold, once met,
        # makes the kubelet delete every image no running pod uses (kvpilot's own among them,
        # which no registry here can give back), so "0%" switches the disk signals off.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "0%",
                         "imagefs.available": "0%", "nodefs.inodesFree": "0%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        # Tests watch ConfigMap and Secret volumes change; the default minute is slow.
        "syncFrequency": "5s",
        "nodeStatusUpdateFrequency": "5s", "nodeStatusReportFrequency": "30s",
        "shutdownGracePeriod": "0s",
        "logging": {"format": "text", "verbosity": 1},
    }


def kube_proxy_config(n: NodeLayout, *, kubeconfig: Path, node_name: str, metrics_port: int) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": node_name,
        "clusterCIDR": n.cluster_cidr,
        "bindAddress": n.node_ip,
        "healthzBindAddress": "",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        # conntrack's table size is the host's, not the namespace's: leave it alone.
        "conntrack": {"maxPerCore": 0, "min": 0,
                      "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "iptables": {"masqueradeAll": False, "syncPeriod": "10s", "minSyncPeriod": "0s"},
    }


def resolv_conf() -> str:
    """What pods with dnsPolicy Default see (the cluster resolves nothing outside itself)."""
    return "nameserver 127.0.0.1\noptions ndots:1\n"
