"""A throwaway PKI for one local cluster, made with the `openssl` CLI: a CA,
the API server's serving certificate, client certificates (admin in
system:masters, controller manager, scheduler, and the aggregation layer's
front-proxy-client), and the service-account key. `issue` makes more
certificates from the same CA later (KEDA's, see keda.py)."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def cert(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"


def _key(d: Path, name: str) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", f"{name}.key", cwd=d)


def _issue(d: Path, name: str, subject: str, *, sans: list[str] | None = None,
           usage: str = "clientAuth") -> None:
    _key(d, name)
    ext = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
    ]
    if sans:
        ext.append("subjectAltName=" + ",".join(sans))
    (d / f"{name}.ext").write_text("\n".join(ext) + "\n")
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "3650", "-sha256", "-extfile", f"{name}.ext",
             "-out", f"{name}.crt", cwd=d)


def issue(pki: Pki, name: str, subject: str, sans: list[str], usage: str) -> tuple[Path, Path]:
    """One more certificate signed by the cluster's CA: (cert, key) in the PKI folder."""
    _issue(pki.dir, name, subject, sans=sans, usage=usage)
    for f in (pki.dir / f"{name}.csr", pki.dir / f"{name}.ext"):
        f.unlink(missing_ok=True)
    return pki.cert(name), pki.key(name)


def make_pki(d: Path, ips: list[str]) -> Pki:
    """`ips`: the addresses the API server serves on (the node's certificates are issued
    later, see kubeletnode.write_node_files)."""
    d.mkdir(parents=True, exist_ok=True)
    _key(d, "ca")
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=kvpilot-local-ca",
             "-days", "3650", "-sha256", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
             "-out", "ca.crt", cwd=d)
    ip_sans = ["IP:127.0.0.1"] + [f"IP:{ip}" for ip in ips]
    serving_sans = ip_sans + ["DNS:localhost", "DNS:kubernetes",
                    "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
                    "DNS:kubernetes.default.svc.cluster.local"]
    _issue(d, "apiserver", "/CN=kube-apiserver", sans=serving_sans, usage="serverAuth")
    _issue(d, "admin", "/O=system:masters/CN=kvpilot-admin")
    _issue(d, "controller-manager", "/CN=system:kube-controller-manager")
    _issue(d, "scheduler", "/CN=system:kube-scheduler")
    # What the API server presents when it proxies to an aggregated API server
    # (KEDA's metrics adapter); that server trusts it through
    # --requestheader-client-ca-file and --requestheader-allowed-names.
    _issue(d, "front-proxy-client", "/CN=front-proxy-client")
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
             "-out", "sa.key", cwd=d)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    for f in d.glob("*.csr"):
        f.unlink()
    for f in d.glob("*.ext"):
        f.unlink()
    return Pki(d)
