"""The addresses of one local cluster, all inside 10.K.0.0/16 (K chosen by
podnet.choose_octet so it overlaps nothing on the machine):
  cni0 bridge   10.K.0.1/17, pods 10.K.0.2 .. 10.K.127.254 (host-local IPAM)
  veth          10.K.255.253 (the node's InternalIP) <-> 10.K.255.254 on the host,
                where the API server and Prometheus listen
  Services      10.K.254.0/24 (kube-proxy's iptables rules live in the namespace)
  cluster DNS   10.K.254.10
  Prometheus    10.K.254.9:9090 (the Service in front of the Prometheus Operator's pod)"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterAddresses:
    octet: int

    @property
    def cluster_cidr(self) -> str:
        """Pods and Services: the host routes this into the cluster's namespace."""
        return f"10.{self.octet}.0.0/16"

    @property
    def host_ip(self) -> str:
        """The host's end of the veth pair."""
        return f"10.{self.octet}.255.254"

    @property
    def node_ip(self) -> str:
        """The namespace's end of the veth pair: the node's InternalIP."""
        return f"10.{self.octet}.255.253"

    @property
    def pod_subnet(self) -> str:
        return f"10.{self.octet}.0.0/17"

    @property
    def pod_gateway(self) -> str:
        return f"10.{self.octet}.0.1"

    @property
    def service_cidr(self) -> str:
        return f"10.{self.octet}.254.0/24"

    @property
    def dns_ip(self) -> str:
        return f"10.{self.octet}.254.10"

    @property
    def prometheus_ip(self) -> str:
        """The fixed ClusterIP of Service monitoring/prometheus: the host reaches it through
        the namespace's kube-proxy rules, pods through their own."""
        return f"10.{self.octet}.254.9"
