"""The real KEDA (operator and metrics API server, built from its Go module by
e2e/keda/build.sh) started against a running LocalCluster, as host processes:

    from localcluster.keda import start_keda
    keda = start_keda(cluster)      # builds once (~7 min on 2 cores), then ~3 s
    ...                             # apply ScaledObjects
    keda.stop()                     # or cluster.stop(), which stops it too

How the pieces reach each other, with no pods and no kube-proxy:
- both processes use the cluster's admin kubeconfig (system:masters), so
  KEDA's RBAC manifests are not needed;
- the adapter asks the operator for metric values over KEDA's mTLS gRPC link
  on 127.0.0.1; one certificate from the cluster's CA (server and client
  usages, every name either side checks) serves both ends, as KEDA's own cert
  rotation does with its kedaorg-certs secret;
- the API server reaches the adapter as the APIService
  v1beta1.external.metrics.k8s.io -> Service keda/keda-metrics-apiserver, a
  Service without selector whose EndpointSlice names the host address where
  the adapter listens (the pod network's gateway: EndpointSlices refuse
  loopback addresses). The API server runs with --enable-aggregator-routing
  (controlplane.py), so it dials that endpoint rather than the ClusterIP,
  which nothing routes here, and authenticates with its front-proxy-client
  certificate, which the adapter trusts through the requestheader settings it
  reads from kube-system/extension-apiserver-authentication."""
from __future__ import annotations

import base64
import json
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

from .build import ensure_keda
from .certs import issue
from .paths import E2E_DIR
from .ports import free_port
from .procs import Proc
from .waiting import wait_for

NAMESPACE = "keda"
SERVICE = "keda-metrics-apiserver"
APISERVICE = "v1beta1.external.metrics.k8s.io"
OPERATOR, ADAPTER = "keda-operator", "keda-adapter"
# What the adapter logs once its gRPC link to the operator is up (pkg/provider/provider.go).
GRPC_UP = "Connection to KEDA Metrics Service gRPC server has been successfully established"
# KEDA's config/crd: its operator watches all six kinds, so all must exist.
CRDS = ("scaledobjects", "scaledjobs", "triggerauthentications", "clustertriggerauthentications",
        "cloudeventsources", "clustercloudeventsources")


@dataclass
class Keda:
    """Handle on KEDA's two processes (also in `cluster.procs`, so the cluster's
    stop() stops them). Logs: cluster.workdir/logs/keda-{operator,adapter}.log."""

    cluster: object
    bin_dir: Path
    operator: Proc
    adapter: Proc
    adapter_address: str  # host:port the API server proxies external metrics to
    operator_metrics_url: str  # KEDA's own Prometheus metrics, e.g. keda_scaler_metrics_value

    def running(self) -> bool:
        return self.operator.running() and self.adapter.running()

    def stop(self) -> None:
        """Stops both processes and removes the APIService (so that the API
        server's discovery does not report an unavailable group)."""
        self.cluster.kubectl("delete", "apiservice", APISERVICE, "--ignore-not-found", check=False)
        for proc in (self.adapter, self.operator):
            proc.stop()
            self.cluster.procs.pop(proc.name, None)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def module_dir() -> Path:
    """KEDA's module source in Go's module cache (for its CRDs)."""
    r = subprocess.run(["go", "mod", "download", "-json", "github.com/kedacore/keda/v2"],
                       cwd=E2E_DIR / "keda", capture_output=True, text=True, check=True)
    return Path(json.loads(r.stdout)["Dir"])


def _certs(cluster, gateway: str) -> Path:
    """KEDA's cert folder (ca.crt, tls.crt, tls.key), the layout both binaries read."""
    d = cluster.workdir / "keda" / "certs"
    d.mkdir(parents=True, exist_ok=True)
    names = [f"{SERVICE}.{NAMESPACE}.svc",  # the aggregator's TLS ServerName
             f"{SERVICE}.{NAMESPACE}.svc.cluster.local",
             f"{OPERATOR}.{NAMESPACE}.svc.cluster.local", "localhost"]
    cert, key = issue(cluster.pki, "keda", "/CN=keda", [f"DNS:{n}" for n in names]
                      + ["IP:127.0.0.1", f"IP:{gateway}"], usage="serverAuth,clientAuth")
    (d / "ca.crt").write_bytes(cluster.pki.ca.read_bytes())
    (d / "tls.crt").write_bytes(cert.read_bytes())
    (d / "tls.key").write_bytes(key.read_bytes())
    return d


def _registration(cluster, port: int) -> list[dict]:
    """The Service without selector, its EndpointSlice, and the APIService."""
    meta = {"name": SERVICE, "namespace": NAMESPACE}
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": meta,
         "spec": {"ports": [{"name": "https", "port": 443, "targetPort": port}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": SERVICE, "namespace": NAMESPACE,
                      "labels": {"kubernetes.io/service-name": SERVICE,
                                 # not the endpointslice controller's: it leaves this one alone
                                 "endpointslice.kubernetes.io/managed-by": "localcluster.kvpilot.dev"}},
         "addressType": "IPv4",
         "endpoints": [{"addresses": [cluster.gateway], "conditions": {"ready": True}}],
         "ports": [{"name": "https", "port": port, "protocol": "TCP"}]},
        {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": APISERVICE},
         "spec": {"service": {"name": SERVICE, "namespace": NAMESPACE, "port": 443},
                  "group": "external.metrics.k8s.io", "version": "v1beta1",
                  "caBundle": base64.b64encode(cluster.pki.ca.read_bytes()).decode(),
                  "groupPriorityMinimum": 100, "versionPriority": 100}},
    ]


def start_keda(cluster, *, log_level: str = "info", timeout: float = 120.0) -> Keda:
    """Builds KEDA if needed (cached, e2e/keda/build.sh), installs its CRDs,
    starts its operator and metrics adapter with leader election off,
    registers the external metrics APIService, and returns once
    /apis/external.metrics.k8s.io/v1beta1 answers through the API server."""
    bin_dir = ensure_keda()
    gw = cluster.gateway
    # The CRDs as KEDA's own `make install` applies them (kustomize, with its
    # patches; server-side, since the ScaledJob CRD exceeds the 256 KiB
    # last-applied annotation of a client-side apply).
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(module_dir() / "config" / "crd"))
    kube = cluster.kube()

    def established():  # polled: `kubectl wait` fails on a CRD that has no conditions yet
        crds = kube.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions")["items"]
        ours = [c for c in crds if c["spec"]["group"] in ("keda.sh", "eventing.keda.sh")]
        return len(ours) == len(CRDS) and all(
            any(x["type"] == "Established" and x["status"] == "True" for x in c.get("status", {}).get("conditions") or [])
            for c in ours)
    try:
        wait_for(established, timeout=60, what="KEDA's CRDs to be established")
    finally:
        kube.close()
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    certs = _certs(cluster, gw)
    kc = str(cluster.kubeconfig)
    env = {"KUBECONFIG": kc, "WATCH_NAMESPACE": "", "POD_NAMESPACE": NAMESPACE,
           "KEDA_CLUSTER_OBJECT_NAMESPACE": NAMESPACE}
    grpc, probe, metrics = free_port(), free_port(), free_port()
    operator = cluster._spawn(OPERATOR, [
        str(bin_dir / "operator"), "--leader-elect=false", f"--cert-dir={certs}",
        f"--metrics-service-bind-address=127.0.0.1:{grpc}",
        f"--metrics-bind-address=127.0.0.1:{metrics}", f"--health-probe-bind-address=127.0.0.1:{probe}",
        f"--zap-log-level={log_level}", "--zap-encoder=console", "--zap-time-encoding=rfc3339"],
        extra_env=env)
    try:
        cluster._wait(OPERATOR, lambda: httpx.get(f"http://127.0.0.1:{probe}/readyz", timeout=2).status_code == 200
                      and _listening(grpc), timeout=timeout)
    except BaseException:
        operator.stop()
        cluster.procs.pop(OPERATOR, None)
        raise
    # Started once the operator's gRPC server listens: gRPC's reconnect backoff
    # would otherwise delay the adapter's first link to it.
    port = free_port(gw)
    log = cluster.workdir / "logs" / f"{ADAPTER}.log"
    log_start = log.stat().st_size if log.exists() else 0  # logs are appended to across starts
    adapter = cluster._spawn(ADAPTER, [
        str(bin_dir / "adapter"), f"--bind-address={gw}", f"--secure-port={port}", f"--cert-dir={certs}",
        f"--tls-cert-file={certs / 'tls.crt'}", f"--tls-private-key-file={certs / 'tls.key'}",
        f"--client-ca-file={certs / 'ca.crt'}",
        f"--lister-kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
        f"--metrics-service-address=127.0.0.1:{grpc}", f"--port={free_port()}",
        f"--zap-log-level={log_level}", "--zap-encoder=console", "--zap-time-encoding=rfc3339"],
        extra_env=env)
    keda = Keda(cluster, bin_dir, operator, adapter, f"{gw}:{port}", f"http://127.0.0.1:{metrics}/metrics")
    try:
        # Serving, and its mTLS link to the operator up (KEDA logs it, and nothing else shows it).
        cluster._wait(ADAPTER, lambda: httpx.get(f"https://{gw}:{port}/readyz", verify=False,
                                                 timeout=2).status_code == 200
                      and GRPC_UP.encode() in log.read_bytes()[log_start:], timeout=timeout)
        cluster.apply(_registration(cluster, port))

        def answers():  # through the API server, the aggregator and the adapter's authn/authz
            if not keda.running():
                raise RuntimeError(f"KEDA exited; see {cluster.workdir / 'logs'}/keda-*.log")
            return cluster.kubectl("get", "--raw", "/apis/external.metrics.k8s.io/v1beta1",
                                   check=False).returncode == 0
        wait_for(answers, timeout=timeout, interval=0.5, what=f"{APISERVICE} to answer", fatal=(RuntimeError,))
    except BaseException:
        keda.stop()
        raise
    return keda
