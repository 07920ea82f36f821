"""A real Prometheus server (built from its Go module with Kubernetes service
discovery, see e2e/prometheus/) that discovers pods through the local API
server (kubernetes_sd_configs, role: pod) and scrapes those annotated
prometheus.io/scrape: "true" (prometheus.io/port, prometheus.io/path,
prometheus.io/scheme), labelled with namespace, pod and the pod's labels."""
from __future__ import annotations

from pathlib import Path

import yaml

from .certs import Pki


def config(server: str, pki: Pki, scrape_interval: str) -> dict:
    tls = {"ca_file": str(pki.ca), "cert_file": str(pki.cert("admin")), "key_file": str(pki.key("admin"))}
    meta = "__meta_kubernetes_pod_"
    return {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval,
                   "scrape_timeout": scrape_interval},
        "scrape_configs": [{
            "job_name": "kubernetes-pods",
            "kubernetes_sd_configs": [{"role": "pod", "api_server": server, "tls_config": tls}],
            "relabel_configs": [
                {"source_labels": [meta + "annotation_prometheus_io_scrape"], "action": "keep", "regex": "true"},
                {"source_labels": [meta + "phase"], "action": "drop", "regex": "Pending|Succeeded|Failed"},
                {"source_labels": [meta + "annotation_prometheus_io_scheme"], "action": "replace",
                 "regex": "(https?)", "target_label": "__scheme__"},
                {"source_labels": [meta + "annotation_prometheus_io_path"], "action": "replace",
                 "regex": "(.+)", "target_label": "__metrics_path__"},
                {"source_labels": [meta + "ip", meta + "annotation_prometheus_io_port"], "action": "replace",
                 "regex": r"(.+);(\d+)", "replacement": "$1:$2", "target_label": "__address__"},
                {"action": "labelmap", "regex": meta + "label_(.+)"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": [meta + "name"], "target_label": "pod"},
                {"source_labels": [meta + "node_name"], "target_label": "node"},
            ],
        }],
    }


def write_config(path: Path, server: str, pki: Pki, scrape_interval: str) -> Path:
    path.write_text(yaml.safe_dump(config(server, pki, scrape_interval), sort_keys=False))
    return path


def argv(exe: Path, cfg: Path, data: Path, address: str, port: int) -> list[str]:
    return [str(exe), f"--config.file={cfg}", f"--storage.tsdb.path={data}",
            f"--web.listen-address={address}:{port}", "--web.enable-lifecycle",
            "--storage.tsdb.retention.time=1d", "--log.level=warn"]
