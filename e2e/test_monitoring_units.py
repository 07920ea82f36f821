"""The local cluster's monitoring objects (localcluster/monitoring.py), without a cluster: the
Prometheus object selects exactly what kvpilot's chart labels with the values the cluster
installs it with, and the single-binary images put their executables where the Prometheus
Operator's pods run them."""
from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import yaml

from localcluster import monitoring
from localcluster.addresses import ClusterAddresses
from localcluster.build import version_of
from localcluster.ociarchive import BinaryImage, write_archive

ROOT = Path(__file__).resolve().parents[1]


def by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


def test_the_prometheus_release_follows_the_go_module_version():
    module = version_of("prometheus")  # v0.3XX.Y is Prometheus 3.XX.Y
    assert module.startswith("v0.3")
    release = monitoring.prometheus_release()
    assert release == f"v3.{int(module[4:].split('.')[0])}.{module.rsplit('.', 1)[1]}"


def test_prometheus_selects_the_stacks_label_everywhere_and_sits_behind_a_fixed_clusterip():
    addr = ClusterAddresses(42)
    docs = by_kind(monitoring.manifests(addr.prometheus_ip, "1s"))
    spec = docs["Prometheus"]["spec"]
    for kind in ("serviceMonitor", "podMonitor", "rule"):
        assert spec[f"{kind}Selector"] == {"matchLabels": monitoring.SELECT_LABELS}
        assert spec[f"{kind}NamespaceSelector"] == {}  # every namespace
    assert spec["scrapeInterval"] == spec["evaluationInterval"] == "1s"
    assert spec["image"].endswith(":" + monitoring.prometheus_release())
    # The reloader re-reads the config every few seconds (a monitor's change is scraped within
    # a test's patience), with every other argument the operator gives it, for this Prometheus.
    reloader, prometheus = spec["containers"]
    assert prometheus["name"] == "prometheus" and prometheus["startupProbe"]["periodSeconds"] == 1
    assert reloader["name"] == "config-reloader" and "--watch-interval=5s" in reloader["args"]
    assert f"--watched-dir=/etc/prometheus/rules/prometheus-{monitoring.PROMETHEUS}-rulefiles-0" in reloader["args"]
    assert any(a.startswith("--config-file=") for a in reloader["args"])
    svc = docs["Service"]["spec"]
    assert svc["clusterIP"] == "10.42.254.9" and svc["ports"][0]["port"] == monitoring.PORT
    assert svc["clusterIP"] not in (addr.dns_ip,)
    # Prometheus reads pods, Services and EndpointSlices everywhere (its service discovery)
    rules = docs["ClusterRole"]["rules"]
    assert any("pods" in r.get("resources", []) and "watch" in r["verbs"] for r in rules)
    assert any("endpointslices" in r.get("resources", []) for r in rules)


def test_the_chart_rendered_with_the_clusters_values_is_what_its_prometheus_selects():
    helm = subprocess.run([str(ROOT / "e2e" / "build-helm.sh")], capture_output=True, text=True, check=True)
    values = monitoring.chart_values("1s")
    args = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
    out = subprocess.run([helm.stdout.strip().splitlines()[-1], "template", "kvpilot", str(ROOT / "charts" / "kvpilot"),
                          "-n", "kvpilot-system", "--kube-version", "1.31.0",
                          "--api-versions", f"{monitoring.CRD_GROUP}/v1", *args],
                         capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    monitors = [d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor", "PrometheusRule")]
    assert {d["kind"] for d in monitors} == {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    for d in monitors:
        labels = d["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in monitoring.SELECT_LABELS.items()), d["metadata"]
    (pm,) = [d for d in monitors if d["kind"] == "PodMonitor"]
    assert pm["spec"]["podMetricsEndpoints"][0]["interval"] == "1s"
    assert pm["spec"]["namespaceSelector"] == {"any": True}


def test_the_images_hold_their_executable_under_bin(tmp_path):
    exe = tmp_path / "prometheus"
    exe.write_bytes(b"\x7fELF not really")
    out = write_archive(BinaryImage("docker.io/kvpilot/prometheus:v3", exe, "/bin/prometheus"), tmp_path / "p.tar")
    with tarfile.open(out) as tar:
        blobs = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.name.startswith("blobs/")}
    layers = [b for b in blobs.values() if b[257:262] == b"ustar"]  # the one tar among the blobs
    (layer,) = layers
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["bin"].isdir() and members["bin"].mode == 0o755
    assert members["bin/prometheus"].isreg() and members["bin/prometheus"].mode == 0o755
    bins = monitoring.MonitoringBinaries(Path("/x/prometheus"), Path("/y/bin"))
    paths = {img.path_in_image for img, _ in bins.images()}
    # where the operator's Prometheus StatefulSet runs them (upstream's images have them there)
    assert paths == {"/bin/prometheus", "/bin/prometheus-config-reloader"}
