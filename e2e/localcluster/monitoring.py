"""The local cluster's monitoring, as kube-prometheus-stack sets it up: the real
Prometheus Operator (built from its Go module, e2e/prometheus-operator/) runs
as a host process and runs Prometheus as a pod from a `Prometheus` object, and
Prometheus scrapes what ServiceMonitors, PodMonitors and PrometheusRules select.
No scrape annotations: kvpilot's chart must bring its own PodMonitor and
ServiceMonitors with the stack's `release` label, as on a user's cluster.

    namespace monitoring
      Prometheus `local`       selects monitors and rules labelled release: kube-prometheus-stack
                               in every namespace (the label kube-prometheus-stack selects on)
      Service prometheus-operated  the operator's governing Service (the autotuner's default URL,
                               http://prometheus-operated.monitoring.svc:9090)
      Service prometheus       a fixed ClusterIP (addresses.prometheus_ip) the host reaches too:
                               the cluster's PROMETHEUS_URL

The images are single static binaries (ociarchive.py): Prometheus from
e2e/prometheus and the operator's config reloader, both at /bin as in the
upstream images. The operator talks to the API server with the admin client
certificate (system:masters), so it needs no RBAC of its own; Prometheus gets
the ClusterRole kube-prometheus-stack gives it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .build import version_of
from .ociarchive import BinaryImage
from .paths import cache_dir

NAMESPACE = "monitoring"
PROMETHEUS = "local"  # the Prometheus object's name
SERVICE = "prometheus"  # the fixed-ClusterIP Service in front of its pod
PORT = 9090
# What kube-prometheus-stack's Prometheus selects monitors and rules by (its release's name).
SELECT_LABELS = {"release": "kube-prometheus-stack"}
PROMETHEUS_IMAGE_REPO = "docker.io/kvpilot/prometheus"
RELOADER_IMAGE_REPO = "docker.io/kvpilot/prometheus-config-reloader"
CRD_GROUP = "monitoring.coreos.com"
# The config reloader's own arguments as the operator (v0.85.0, pkg/operator/config_reloader.go)
# generates them for Prometheus `local`, plus a 5 s re-read. The reloader's inotify watch is on
# the config file's inode, which the kubelet replaces on a Secret's first update, so later
# monitor changes wait for its periodic re-read, 3 minutes by default (what users of the stack
# see); the rules folder is watched as a folder and reloads at once. `spec.containers` merges
# into the operator's container by name, and `args` is replaced whole, hence the full list.
RELOADER_ARGS = ["--listen-address=:8080", "--reload-url=http://localhost:9090/-/reload",
                 "--config-file=/etc/prometheus/config/prometheus.yaml.gz",
                 "--config-envsubst-file=/etc/prometheus/config_out/prometheus.env.yaml",
                 f"--watched-dir=/etc/prometheus/rules/prometheus-{PROMETHEUS}-rulefiles-0",
                 "--watch-interval=5s"]


def prometheus_release() -> str:
    """v3.X.Y for the Go module version v0.3XX.Y that e2e/prometheus builds."""
    module = version_of("prometheus")
    minor = module.removeprefix("v0.3")
    return f"v3.{int(minor.split('.')[0])}.{module.rsplit('.', 1)[-1]}"


@dataclass(frozen=True)
class MonitoringBinaries:
    prometheus: Path  # e2e/prometheus's executable
    operator_bin: Path  # e2e/prometheus-operator's bin folder (operator, prometheus-config-reloader)

    @property
    def operator(self) -> Path:
        return self.operator_bin / "operator"

    @property
    def crds(self) -> Path:
        """The operator's CRDs as its release ships them (copied by its build.sh)."""
        return self.operator_bin.parent / "crds"

    def images(self) -> list[tuple[BinaryImage, Path]]:
        out = cache_dir() / "images"
        prom, po = prometheus_release(), version_of("prometheus-operator")
        return [
            (BinaryImage(f"{PROMETHEUS_IMAGE_REPO}:{prom}", self.prometheus, "/bin/prometheus"),
             out / f"prometheus-{prom}.tar"),
            (BinaryImage(f"{RELOADER_IMAGE_REPO}:{po}", self.operator_bin / "prometheus-config-reloader",
                         "/bin/prometheus-config-reloader"), out / f"prometheus-config-reloader-{po}.tar"),
        ]


def operator_argv(bins: MonitoringBinaries, server: str, ca: Path, cert: Path, key: Path,
                  listen_port: int) -> list[str]:
    return [str(bins.operator), f"--apiserver={server}", f"--ca-file={ca}", f"--cert-file={cert}",
            f"--key-file={key}", f"--web.listen-address=127.0.0.1:{listen_port}",
            f"--prometheus-config-reloader={RELOADER_IMAGE_REPO}:{version_of('prometheus-operator')}",
            "--log-level=warn"]


def manifests(prometheus_ip: str, scrape_interval: str) -> list[dict]:
    """Namespace, Prometheus's ServiceAccount and RBAC, the Prometheus object and the Service
    with the fixed ClusterIP."""
    release = prometheus_release()
    meta = {"namespace": NAMESPACE}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "prometheus", **meta}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "local-prometheus"},
         "rules": [{"apiGroups": [""], "resources": ["nodes", "nodes/metrics", "services", "endpoints", "pods"],
                    "verbs": ["get", "list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]},
                   {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]},
                   {"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "local-prometheus"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "local-prometheus"},
         "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": NAMESPACE}]},
        {"apiVersion": f"{CRD_GROUP}/v1", "kind": "Prometheus", "metadata": {"name": PROMETHEUS, **meta},
         "spec": {
             "image": f"{PROMETHEUS_IMAGE_REPO}:{release}", "version": release, "replicas": 1,
             "serviceAccountName": "prometheus",
             "scrapeInterval": scrape_interval, "evaluationInterval": scrape_interval,
             "scrapeTimeout": scrape_interval, "retention": "1d",
             # {} namespace selectors: every namespace. Each is its own dict (one shared object
             # would be dumped as a YAML anchor and aliases).
             "serviceMonitorSelector": {"matchLabels": dict(SELECT_LABELS)},
             "serviceMonitorNamespaceSelector": {},
             "podMonitorSelector": {"matchLabels": dict(SELECT_LABELS)},
             "podMonitorNamespaceSelector": {},
             "ruleSelector": {"matchLabels": dict(SELECT_LABELS)}, "ruleNamespaceSelector": {},
             "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
             "containers": [
                 {"name": "config-reloader", "args": RELOADER_ARGS},
                 # The operator's startup probe runs every 15 s, so a Prometheus up in 2 s would
                 # count as started at 15: probe every second instead (same 15 min allowance).
                 {"name": "prometheus", "startupProbe": {"periodSeconds": 1, "failureThreshold": 900}}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVICE, **meta},
         "spec": {"clusterIP": prometheus_ip, "selector": {"prometheus": PROMETHEUS},
                  "ports": [{"name": "web", "port": PORT, "targetPort": "web"}]}},
    ]


def chart_values(scrape_interval: str) -> dict[str, str]:
    """The kvpilot chart's values on this cluster, as docs/kubernetes.md gives them for
    kube-prometheus-stack: its monitors and rules carry the stack's label; they scrape at the
    cluster's interval (tests judge windows of seconds). The autotuner's URL is the chart's
    default, prometheus-operated in `monitoring`."""
    values = {}
    for obj in ("serviceMonitor", "podMonitor", "prometheusRule"):
        for k, v in SELECT_LABELS.items():
            values[f"{obj}.labels.{k}"] = v
    values["serviceMonitor.interval"] = values["podMonitor.interval"] = scrape_interval
    return values
