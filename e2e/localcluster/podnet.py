"""The network of one local cluster: a network namespace holding the node
(containerd, kubelet, kube-proxy) and, through its CNI bridge, every pod's own
namespace, joined to the host by a veth pair: the node's end 10.K.255.253, the
host's 10.K.255.254, where the API server and Prometheus listen, reachable from
the host and from pods alike. The host routes 10.K.0.0/16 (pods, Services) into
the namespace, which forwards between the veth and the bridge (addresses.py
has the addresses).

The namespace is held by a `sleep` process made by `unshare --net`; the kernel
removes the namespace and the veth pair once that process and the pods are
gone, so nothing persists after the cluster's processes end."""
from __future__ import annotations

import ipaddress
import json
import os
import random
import subprocess
import time
from dataclasses import dataclass

from .addresses import ClusterAddresses


def _ip(*args: str, netns: str | None = None) -> str:
    cmd = ["ip", *args]
    if netns:
        cmd = ["nsenter", f"--net={netns}", *cmd]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def choose_octet() -> int:
    """K such that 10.K.0.0/16 overlaps no route or address on this machine
    (other local clusters included)."""
    used = []
    for r in json.loads(_ip("-j", "-4", "route", "show", "table", "all") or "[]"):
        dst = r.get("dst", "")
        if dst and dst != "default":
            try:
                used.append(ipaddress.ip_network(dst if "/" in dst else dst + "/32", strict=False))
            except ValueError:
                pass
    free = [k for k in range(16, 250)
            if not any(ipaddress.ip_network(f"10.{k}.0.0/16").overlaps(u) for u in used)]
    if not free:
        raise RuntimeError("no free 10.K.0.0/16 subnet for the pod network")
    return random.choice(free)


@dataclass(frozen=True)
class PodNetwork(ClusterAddresses):
    holder_pid: int

    @property
    def netns(self) -> str:
        return f"/proc/{self.holder_pid}/ns/net"

    def setup(self) -> None:
        """Links the holder's namespace to the host with a veth pair."""
        deadline = time.monotonic() + 10
        me = os.readlink("/proc/self/ns/net")
        while os.readlink(self.netns) == me:  # unshare has not run yet
            if time.monotonic() > deadline:
                raise RuntimeError("pod network namespace did not appear")
            time.sleep(0.01)
        host, peer = f"kvp{self.octet}h", f"kvp{self.octet}p"
        _ip("link", "add", host, "type", "veth", "peer", "name", peer, "netns", str(self.holder_pid))
        _ip("addr", "add", f"{self.host_ip}/24", "dev", host)
        _ip("link", "set", host, "up")
        _ip("link", "set", "lo", "up", netns=self.netns)
        _ip("addr", "add", f"{self.node_ip}/24", "dev", peer, netns=self.netns)
        _ip("link", "set", peer, "up", netns=self.netns)
        # Pods and Services are routed through the namespace; it routes the rest back.
        _ip("route", "add", self.cluster_cidr, "via", self.node_ip, "dev", host)
        _ip("route", "add", "default", "via", self.host_ip, netns=self.netns)
        subprocess.run(["nsenter", f"--net={self.netns}", "sysctl", "-q", "-w",
                        "net.ipv4.ip_forward=1"], check=True)

    @staticmethod
    def remove_leftover(octet: int) -> None:
        """Deletes the host end of the veth pair if it outlived the namespace
        (normally the kernel removes it with the namespace)."""
        if subprocess.run(["ip", "link", "show", f"kvp{octet}h"], capture_output=True).returncode == 0:
            subprocess.run(["ip", "link", "del", f"kvp{octet}h"], capture_output=True)
