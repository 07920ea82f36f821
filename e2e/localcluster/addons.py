"""The cluster's DNS: CoreDNS (built from its Go module, e2e/coredns) as a
Deployment in kube-system behind the `kube-dns` Service at the address the
kubelet hands pods (nodeconfig.NodeLayout.dns_ip), as kubeadm sets it up.
The cluster has no upstream resolver, so only cluster names resolve."""
from __future__ import annotations

from .nodeconfig import CLUSTER_DOMAIN

DNS_PORT = 1053  # unprivileged inside the pod; the Service maps 53 to it

COREFILE = f"""\
.:{DNS_PORT} {{
    errors
    health :8080
    ready :8181
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    prometheus :9153
    cache 5
    loop
    reload
    loadbalance
}}
"""


def build_coredns(image: str, dns_ip: str) -> list[dict]:
    ns, name = "kube-system", "coredns"
    labels = {"k8s-app": "kube-dns"}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "system:coredns"},
         "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "system:coredns"},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": ns},
         "data": {"Corefile": COREFILE}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": ns,
                                                                    "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels}, "spec": {
                      "serviceAccountName": name, "dnsPolicy": "Default",
                      "priorityClassName": "system-cluster-critical",
                      "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                          "seccompProfile": {"type": "RuntimeDefault"}},
                      "containers": [{
                          "name": "coredns", "image": image, "imagePullPolicy": "IfNotPresent",
                          "args": ["-conf", "/etc/coredns/Corefile"],
                          "ports": [{"name": "dns", "containerPort": DNS_PORT, "protocol": "UDP"},
                                    {"name": "dns-tcp", "containerPort": DNS_PORT, "protocol": "TCP"},
                                    {"name": "metrics", "containerPort": 9153, "protocol": "TCP"}],
                          "resources": {"requests": {"cpu": "10m", "memory": "32Mi"},
                                        "limits": {"memory": "128Mi"}},
                          "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181},
                                             "periodSeconds": 2},
                          "livenessProbe": {"httpGet": {"path": "/health", "port": 8080},
                                            "periodSeconds": 10, "failureThreshold": 5},
                          "securityContext": {"allowPrivilegeEscalation": False,
                                              "readOnlyRootFilesystem": True,
                                              "capabilities": {"drop": ["ALL"]}},
                          "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns",
                                            "readOnly": True}],
                      }],
                      "volumes": [{"name": "config", "configMap": {"name": name}}],
                  }}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": ns, "labels": labels},
         "spec": {"selector": labels, "clusterIP": dns_ip,
                  "ports": [{"name": "dns", "port": 53, "targetPort": DNS_PORT, "protocol": "UDP"},
                            {"name": "dns-tcp", "port": 53, "targetPort": DNS_PORT, "protocol": "TCP"},
                            {"name": "metrics", "port": 9153, "targetPort": 9153, "protocol": "TCP"}]}},
    ]
