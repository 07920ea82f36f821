"""LocalCluster: starts, health-waits and stops a whole local Kubernetes
(etcd, kube-apiserver, kube-controller-manager, kube-scheduler, a real node of
containerd, kubelet, kube-proxy and a device plugin, CoreDNS, the Prometheus
Operator and the Prometheus it runs, monitoring.py) in one work folder:

    workdir/kubeconfig      admin kubeconfig (client certificate in system:masters)
    workdir/env             KUBECONFIG=... and PROMETHEUS_URL=... lines
    workdir/state.json      what `LocalCluster.attach(workdir)` reads back
    workdir/logs/*.log      one log per process
    workdir/node/pod-logs/<ns>_<pod>_<uid>/<container>/<restarts>.log   pod output (CRI format)
    workdir/run/*.pid       pid files: exactly what `stop` stops
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterable

import httpx
import yaml

from . import cgroups, monitoring
from .addons import build_coredns
from .build import (ensure_binaries, ensure_images, ensure_node_binaries, ensure_prometheus,
                    ensure_prometheus_operator, version_of)
from .certs import Pki, make_pki
from .controlplane import Ports, apiserver_argv, controller_manager_argv, etcd_argv, scheduler_argv
from .kube import Credentials, Kube
from .kubeconfig import write_kubeconfig
from .kubeletnode import (CGROUP_PREFIX, COREDNS_IMAGE_REPO, Ctr, NodeBinaries, containerd_argv,
                          binary_images, device_plugin_argv, kube_proxy_argv, kubelet_argv,
                          preflight, root_in_use, shared_containerd_root, sweep_stale, unmount_stale,
                          unmount_under, write_node_files)
from .monitoring import MonitoringBinaries
from .nodeconfig import NodeLayout
from .ociarchive import ensure_archives
from .paths import K8S_VERSION
from .podnet import PodNetwork, choose_octet
from .ports import free_port
from .procs import CLUSTER_ID_ENV, Proc, kill_tagged, tagged_processes
from .waiting import wait_for

# Started in this order, stopped in reverse. KEDA's two processes are started
# only on request (keda.py, after the cluster is up); listed so that stop() and
# attach() treat them as the cluster's own.
ORDER = ["podnet", "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
         "containerd", "kubelet", "device-plugin", "kube-proxy", "prometheus-operator",
         "keda-operator", "keda-adapter"]
# CPU, memory and disk are the host's own (the kubelet reads them); the GPUs are the
# device plugin's simulated ones.
DEFAULT_CAPACITY = {"pods": "110", "nvidia.com/gpu": "8"}


# A real kubelet registers its Node tainted not-ready until the node lifecycle
# controller sees it Ready; DaemonSets (kube-proxy's kind) need theirs.
KUBELET_NODE_CONTROLLERS = ("node-lifecycle-controller", "daemonset-controller")


class ClusterError(RuntimeError):
    pass


class LocalCluster:
    def __init__(self, workdir: str | os.PathLike, *, detached: bool = False,
                 node_name: str = "kvpilot-node", capacity: dict[str, str] | None = None,
                 scrape_interval: str = "1s", with_prometheus: bool = True,
                 images: list[tuple[str, Path]] | None = None, log=None):
        self.workdir = Path(workdir).resolve()
        self.detached = detached
        self.node_name = node_name
        self.capacity = {**DEFAULT_CAPACITY, **(capacity or {})}
        self.scrape_interval = scrape_interval
        self.with_prometheus = with_prometheus
        # (image name, OCI archive) to import into containerd; None: kvpilot's own image.
        self.images = images
        self._log = log or (lambda msg: print(f"[localcluster] {msg}", file=sys.stderr, flush=True))
        self.procs: dict[str, Proc] = {}
        self.state: dict[str, Any] = {}

    # --- public properties ---------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def server(self) -> str:
        return self.state["server"]

    @property
    def prometheus_url(self) -> str | None:
        return self.state.get("prometheus_url")

    @property
    def cluster_id(self) -> str:
        return self.state["cluster_id"]

    @property
    def bin_dir(self) -> Path:
        return Path(self.state["bin_dir"])

    @property
    def gateway(self) -> str:
        """The host side of the pod network; pods reach the API server and
        Prometheus here."""
        return self.state["gateway"]

    @property
    def pods_dir(self) -> Path:
        """The kubelet's pod log folder: <namespace>_<pod>_<uid>/<container>/<restarts>.log."""
        return self.workdir / "node" / "pod-logs"

    @property
    def pki(self) -> Pki:
        return Pki(self.workdir / "pki")

    def credentials(self) -> Credentials:
        return Credentials(self.server, self.pki.ca, self.pki.cert("admin"), self.pki.key("admin"))

    # --- start ---------------------------------------------------------------------
    def start(self) -> "LocalCluster":
        t0 = time.monotonic()
        if os.geteuid() != 0:
            raise ClusterError("the local cluster needs root (network and mount namespaces)")
        missing = preflight()
        if missing:
            raise ClusterError("this machine cannot run the local cluster's containers; it lacks:\n  "
                               + "\n  ".join(missing))
        if root_in_use(shared_containerd_root()):
            # The kubelet's device-plugin folder is fixed (/var/lib/kubelet/device-plugins), so two
            # nodes on one machine would take each other's sockets: one at a time.
            raise ClusterError(f"another local cluster's node is running on this machine (it holds "
                               f"{shared_containerd_root()}); stop it first (`make cluster-down`)")
        state_file = self.workdir / "state.json"
        if state_file.exists():
            old = LocalCluster.attach(self.workdir)
            if old.running():
                raise ClusterError(f"a cluster is already running in {self.workdir}; stop it first")
            old.stop()
        for sub in ("pki", "etcd", "run", "node"):
            shutil.rmtree(self.workdir / sub, ignore_errors=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        bin_dir = ensure_binaries()
        mon = (MonitoringBinaries(ensure_prometheus(), ensure_prometheus_operator())
               if self.with_prometheus else None)
        # Built (first run) or checked before anything starts.
        self._node_bins = ensure_node_binaries()
        if self.images is None:
            self.images = ensure_images()
        self.state = {"cluster_id": uuid.uuid4().hex[:12], "bin_dir": str(bin_dir),
                      "version": K8S_VERSION, "workdir": str(self.workdir), "started": time.time()}
        try:
            self._start(bin_dir, mon)
        except BaseException:
            self._log(f"start failed; logs are in {self.workdir / 'logs'}")
            self.stop()
            raise
        self._log(f"cluster up in {time.monotonic() - t0:.1f}s: KUBECONFIG={self.kubeconfig}"
                  + (f" PROMETHEUS_URL={self.prometheus_url}" if self.prometheus_url else ""))
        return self

    def _spawn(self, name: str, argv: list[str], cwd: Path | None = None,
               extra_env: dict[str, str] | None = None) -> Proc:
        env = dict(os.environ, **(extra_env or {}), **{CLUSTER_ID_ENV: self.cluster_id})
        proc = Proc.spawn(name, argv, pidfile=self.workdir / "run" / f"{name}.pid",
                          logfile=self.workdir / "logs" / f"{name}.log", env=env, cwd=cwd,
                          detached=self.detached)
        self.procs[name] = proc
        return proc

    def _save_state(self) -> None:
        (self.workdir / "state.json").write_text(json.dumps(self.state, indent=1))

    def _wait(self, name: str, check, timeout: float = 120.0) -> None:
        proc = self.procs[name]

        def ready():
            if not proc.running():
                raise ClusterError(f"{name} exited; last log lines:\n{self.log_tail(name)}")
            return check()
        t = time.monotonic()
        try:
            wait_for(ready, timeout=timeout, interval=0.1, what=f"{name} to become ready",
                     fatal=(ClusterError,))
        except TimeoutError as e:
            raise ClusterError(f"{e}; last log lines:\n{self.log_tail(name)}") from None
        self._log(f"{name} ready ({time.monotonic() - t:.1f}s)")

    def _start_kubelet_node(self, net: PodNetwork, pki: Pki, kube: Kube,
                            mon: MonitoringBinaries | None) -> None:
        nb = self._node_bins
        bins = NodeBinaries(k8s=self.bin_dir, containerd=nb["containerd"], cni=nb["cni"],
                            pause=nb["pause"], coredns=nb["coredns"],
                            device_plugin=nb["device_plugin"], runc=shutil.which("runc") or "")
        root = shared_containerd_root()
        layout = NodeLayout(net.octet, self.workdir / "node", root)
        stale = sweep_stale()
        if stale:
            self._log(f"stopped {len(stale)} container processes a cluster that died had left")
        for d in unmount_stale():
            self._log(f"unmounted what a cluster that died had left under {d}")
        cgroup_root = f"/{CGROUP_PREFIX}{self.cluster_id}"
        self.state.update(cgroup_root=cgroup_root, dns_ip=layout.dns_ip,
                          containerd_socket=str(layout.containerd_socket),
                          containerd_bin=str(bins.containerd))
        self._save_state()
        files = write_node_files(layout, pki, bins=bins, node_name=self.node_name, server=self.server,
                                 kubelet_port=free_port(), proxy_metrics_port=free_port(),
                                 cgroup_root=cgroup_root, max_pods=int(self.capacity["pods"]))
        path = f"{bins.containerd}:{os.environ.get('PATH', '')}"
        self._spawn("containerd", containerd_argv(bins, files["containerd"], root, net.netns),
                    extra_env={"PATH": path})
        ctr = Ctr(bins.containerd, layout.containerd_socket)
        self._wait("containerd", ctr.ready, timeout=60)
        ctr.remove_workloads()
        archives = ensure_archives(binary_images(bins) + (mon.images() if mon else [])) + self.images
        for ref, archive in archives:
            ctr.import_archive(archive, ref, self._log)
        self.state["images"] = [[ref, str(archive)] for ref, archive in archives]
        self._save_state()
        cgroups.create(cgroup_root)
        self._spawn("kubelet", kubelet_argv(bins, files, layout, self.node_name, net.netns),
                    extra_env={"PATH": path})
        self._spawn("device-plugin", device_plugin_argv(bins, layout, int(self.capacity["nvidia.com/gpu"])))
        self._spawn("kube-proxy", kube_proxy_argv(bins, files, net.netns))

    def _start_monitoring(self, mon: MonitoringBinaries, pki: Pki, kube: Kube, port: int) -> None:
        """The Prometheus Operator's CRDs and process, then what it runs (monitoring.py)."""
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(mon.crds))
        names = [f"{kind}.{monitoring.CRD_GROUP}" for kind in ("prometheuses", "podmonitors",
                                                                "servicemonitors", "prometheusrules")]
        wait_for(lambda: all(_established(kube, n) for n in names), timeout=60,
                 what="the Prometheus Operator's CRDs to be established")
        self._spawn("prometheus-operator", monitoring.operator_argv(
            mon, self.server, pki.ca, pki.cert("admin"), pki.key("admin"), port))
        self.apply(monitoring.manifests(self.state["prometheus_ip"], self.scrape_interval))

    def _start(self, bin_dir: Path, mon: MonitoringBinaries | None) -> None:
        # Pod network first: the API server listens on its gateway.
        octet = choose_octet()
        holder = self._spawn("podnet", ["unshare", "--net", "--", "sleep", "infinity"])
        net = PodNetwork(octet, holder.pid)
        net.setup()
        gw = net.host_ip
        ports = Ports(etcd_client=free_port(), etcd_peer=free_port(), apiserver=free_port(gw),
                      controller_manager=free_port(), scheduler=free_port(), prometheus_operator=free_port())
        self.state.update(gateway=gw, net_octet=octet, ports=ports.__dict__,
                          server=f"https://{gw}:{ports.apiserver}")
        if mon:
            self.state["prometheus_ip"] = net.prometheus_ip
            self.state["prometheus_url"] = f"http://{net.prometheus_ip}:{monitoring.PORT}"
        self._save_state()

        pki = make_pki(self.workdir / "pki", [gw, f"10.{octet}.254.1"])
        creds = self.credentials()
        write_kubeconfig(self.kubeconfig, self.server, pki.ca, pki.cert("admin"), pki.key("admin"),
                         "kvpilot-admin")
        kcm_kc = write_kubeconfig(self.workdir / "pki" / "controller-manager.kubeconfig", self.server,
                                  pki.ca, pki.cert("controller-manager"), pki.key("controller-manager"),
                                  "system:kube-controller-manager")
        sched_kc = write_kubeconfig(self.workdir / "pki" / "scheduler.kubeconfig", self.server, pki.ca,
                                    pki.cert("scheduler"), pki.key("scheduler"), "system:kube-scheduler")

        self._spawn("etcd", etcd_argv(bin_dir, self.workdir / "etcd", ports))
        self._wait("etcd", lambda: httpx.get(f"http://127.0.0.1:{ports.etcd_client}/health",
                                             timeout=2).status_code == 200)
        self._spawn("kube-apiserver", apiserver_argv(bin_dir, pki, ports, gw, net.service_cidr))
        kube = Kube(creds, timeout=10)
        self._wait("kube-apiserver", lambda: kube.http.get("/readyz").status_code == 200, timeout=180)

        self._spawn("kube-controller-manager",
                    controller_manager_argv(bin_dir, pki, ports, kcm_kc, net.service_cidr,
                                            KUBELET_NODE_CONTROLLERS))
        self._spawn("kube-scheduler", scheduler_argv(bin_dir, ports, sched_kc))
        self._start_kubelet_node(net, pki, kube, mon)
        if mon:
            self._start_monitoring(mon, pki, kube, ports.prometheus_operator)

        insecure = lambda port: httpx.get(f"https://127.0.0.1:{port}/healthz", verify=False,  # noqa: E731
                                          timeout=2).status_code == 200
        self._wait("kube-controller-manager", lambda: insecure(ports.controller_manager))
        self._wait("kube-scheduler", lambda: insecure(ports.scheduler))
        self._wait("kubelet", lambda: _node_ready(kube, self.node_name))
        gpus = self.capacity["nvidia.com/gpu"]
        self._wait("device-plugin", lambda: _node_allocatable(kube, self.node_name,
                                                              "nvidia.com/gpu") == gpus)
        t = time.monotonic()
        self.apply(build_coredns(f"{COREDNS_IMAGE_REPO}:{version_of('coredns')}", self.state["dns_ip"]))
        wait_for(lambda: _deployment_available(kube, "kube-system", "coredns"), timeout=60,
                 what="CoreDNS to become ready")
        self._log(f"CoreDNS ready ({time.monotonic() - t:.1f}s)")
        if mon:
            self._wait("prometheus-operator",
                       lambda: _answers(f"http://127.0.0.1:{ports.prometheus_operator}/healthz"))
            # Its pod: the operator's StatefulSet, the node's image, the Service's kube-proxy rules.
            t = time.monotonic()
            try:
                wait_for(lambda: _answers(f"{self.prometheus_url}/-/ready"), timeout=180,
                         what="Prometheus (the operator's pod) to answer")
            except TimeoutError as e:
                pods = self.kubectl("get", "pods,statefulsets,events", "-n", monitoring.NAMESPACE, check=False)
                raise ClusterError(f"{e}:\n{pods.stdout}{pods.stderr}\nthe operator's log:\n"
                                   f"{self.log_tail('prometheus-operator')}") from None
            self._log(f"Prometheus ready ({time.monotonic() - t:.1f}s)")
        # Pods need their namespace's default ServiceAccount and root CA ConfigMap.
        wait_for(lambda: kube.get("/api/v1/namespaces/default/serviceaccounts/default", ok404=True)
                 and kube.get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt", ok404=True),
                 timeout=60, what="the default ServiceAccount")
        kube.close()
        self.state["running"] = True
        self._save_state()
        (self.workdir / "env").write_text(f"KUBECONFIG={self.kubeconfig}\n"
                                          + (f"PROMETHEUS_URL={self.prometheus_url}\n"
                                             if self.prometheus_url else ""))

    # --- stop --------------------------------------------------------------------
    @classmethod
    def attach(cls, workdir: str | os.PathLike) -> "LocalCluster":
        """A handle on a cluster started earlier (e.g. by `make cluster-up`)."""
        c = cls(workdir)
        c.state = json.loads((c.workdir / "state.json").read_text())
        for name in ORDER:
            p = Proc.load(c.workdir / "run" / f"{name}.pid")
            if p is not None:
                c.procs[name] = p
        return c

    def running(self) -> bool:
        return any(p.running() for p in self.procs.values())

    def stop(self) -> list[int]:
        """Stops every process of this cluster (pods included) and returns the
        pids of any that had to be swept up afterwards (normally none)."""
        for name in reversed(ORDER):
            if name == "containerd" and "cgroup_root" in self.state:
                self._sweep_kubelet_node()
            p = self.procs.get(name)
            if p is not None:
                p.stop(grace=10)
        if "cgroup_root" in self.state:
            unmount_under(self.workdir / "node")
        if "net_octet" in self.state:
            PodNetwork.remove_leftover(self.state["net_octet"])
        leftovers: list[int] = []
        if self.state.get("cluster_id"):
            leftovers = kill_tagged(self.cluster_id)
            if leftovers:
                self._log(f"swept up leftover processes {leftovers}")
        if self.state:
            self.state["running"] = False
            if self.workdir.exists():
                self._save_state()
        return leftovers

    def _sweep_kubelet_node(self) -> None:
        """Once the kubelet is gone, no pod may outlive the cluster: kill what is left in the
        node's cgroups and drop the containers from containerd's store."""
        killed = cgroups.kill_and_remove(self.state["cgroup_root"])
        if killed:
            self._log(f"stopped {len(killed)} container processes")
        proc = self.procs.get("containerd")
        if proc is not None and proc.running():
            Ctr(Path(self.state["containerd_bin"]), Path(self.state["containerd_socket"])
                ).remove_workloads()

    def _kubelet_pod_processes(self, namespace: str | None, pod: str | None) -> list[int]:
        # A pod's cgroup is <root>/kubepods[/<qos>]/pod<uid>/<container id>.
        kube = self.kube()
        try:
            uids = _pod_uids(kube, namespace, pod)
        finally:
            kube.close()
        pids = []
        for pid, path in cgroups.processes_under(self.state["cgroup_root"], "pids"):
            if any(f"/pod{uid}/" in path for uid in uids) and not _is_pause(pid):
                pids.append(pid)
        return sorted(pids)

    def leftover_processes(self) -> list[int]:
        """Live processes of this cluster (control plane, node, pods)."""
        return tagged_processes(self.cluster_id)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- clients -------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """Environment for subprocesses that use this cluster: KUBECONFIG,
        PROMETHEUS_URL, the built kubectl first on PATH. Processes started with it
        carry the cluster's tag, so `stop` also stops any that are left."""
        env = dict(os.environ)
        env.update(KUBECONFIG=str(self.kubeconfig), PATH=f"{self.bin_dir}:{env.get('PATH', '')}",
                   **{CLUSTER_ID_ENV: self.cluster_id})
        if self.prometheus_url:
            env["PROMETHEUS_URL"] = self.prometheus_url
        return env

    def helm_args(self) -> list[str]:
        """`helm template` arguments for kvpilot's chart on this cluster: its Prometheus
        Operator's API (which `helm install` finds by itself) and the monitoring values
        (monitoring.chart_values)."""
        if not self.prometheus_url:
            return []
        values = monitoring.chart_values(self.scrape_interval)
        return ["--api-versions", f"{monitoring.CRD_GROUP}/v1",
                *(a for k, v in values.items() for a in ("--set", f"{k}={v}"))]

    def api_client(self):
        """A `kubernetes` python client ApiClient for this cluster."""
        from kubernetes import config
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def kube(self) -> Kube:
        """The small raw-JSON client (e2e/localcluster/kube.py)."""
        return Kube(self.credentials())

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        r = subprocess.run([str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                           input=input, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {r.stderr.strip()}")
        return r

    def create_namespace(self, name: str, pod_security: str = "restricted") -> None:
        """A namespace whose pods must pass the Pod Security level `pod_security`
        (admission enforces it); re-creating an existing one just relabels it."""
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {
            "pod-security.kubernetes.io/enforce": pod_security,
            "pod-security.kubernetes.io/enforce-version": "latest"}}})

    def apply(self, manifest: str | Path | dict | Iterable[dict], namespace: str | None = None) -> str:
        """`kubectl apply` of YAML text, a file, or objects; returns kubectl's output."""
        if isinstance(manifest, Path):
            text = manifest.read_text()
        elif isinstance(manifest, str):
            text = manifest
        elif isinstance(manifest, dict):
            text = yaml.safe_dump(manifest)
        else:
            text = yaml.safe_dump_all(list(manifest))
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        return self.kubectl(*args, input=text).stdout

    def log_tail(self, name: str, lines: int = 30) -> str:
        p = self.workdir / "logs" / f"{name}.log"
        if not p.exists():
            return "(no log)"
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:])

    def import_images(self, images: list[tuple[str, Path]]) -> None:
        """Imports (name, OCI archive) pairs into the running node's containerd, skipping
        archives it already holds; pods started afterwards run the new image."""
        ctr = Ctr(Path(self.state["containerd_bin"]), Path(self.state["containerd_socket"]))
        for ref, archive in images:
            ctr.import_archive(archive, ref, self._log)

    def restore_images(self) -> list[str]:
        """Re-imports every image the node started with that containerd no longer holds and
        returns their names. The kubelet deletes unused images when the disk runs short
        (eviction's node-level reclaim; see nodeconfig.kubelet_config); a shared test disk
        can, and a later pod would then try to pull kvpilot's image from a registry."""
        ctr = Ctr(Path(self.state["containerd_bin"]), Path(self.state["containerd_socket"]))
        held = ctr.image_digests()
        lost = [(ref, Path(a)) for ref, a in self.state.get("images", []) if ref not in held]
        if lost:
            free = shutil.disk_usage(shared_containerd_root()).free / 2**30
            self._log(f"containerd no longer holds {', '.join(ref for ref, _ in lost)} "
                      f"({free:.1f} GiB free on its disk): importing again")
            self.import_images(lost)
        return [ref for ref, _ in lost]

    def pod_log(self, namespace: str, pod: str, container: str) -> Path | None:
        """The output file of a pod's container (newest pod of that name)."""
        found = sorted(self.pods_dir.glob(f"{namespace}_{pod}_*/{container}/*.log"),
                       key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None

    def pod_processes(self, namespace: str | None = None, pod: str | None = None) -> list[int]:
        """Pids of live container processes (sandboxes' pause processes left out), found
        by their pods' cgroups."""
        return self._kubelet_pod_processes(namespace, pod)


def _is_pause(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == b"/pause"
    except OSError:
        return True  # gone


def _pod_uids(kube: Kube, namespace: str | None, pod: str | None) -> set[str]:
    if namespace is None:
        return {p["metadata"]["uid"] for p in kube.get("/api/v1/pods")["items"]}
    if pod is None:
        return {p["metadata"]["uid"] for p in kube.get(f"/api/v1/namespaces/{namespace}/pods")["items"]}
    p = kube.get(f"/api/v1/namespaces/{namespace}/pods/{pod}", ok404=True)
    return {p["metadata"]["uid"]} if p else set()


def _deployment_available(kube: Kube, namespace: str, name: str) -> bool:
    d = kube.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}", ok404=True)
    return bool(d) and (d.get("status", {}).get("availableReplicas") or 0) >= 1


def _node_allocatable(kube: Kube, name: str, resource: str) -> str | None:
    node = kube.get(f"/api/v1/nodes/{name}", ok404=True) or {}
    return node.get("status", {}).get("allocatable", {}).get(resource)


def _node_ready(kube: Kube, name: str) -> bool:
    node = kube.get(f"/api/v1/nodes/{name}", ok404=True)
    if not node:
        return False
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in node.get("status", {}).get("conditions", []))


def _established(kube: Kube, crd: str) -> bool:
    got = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}", ok404=True) or {}
    return any(c["type"] == "Established" and c["status"] == "True"
               for c in got.get("status", {}).get("conditions") or [])


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
