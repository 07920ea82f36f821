"""LocalCluster: starts, health-waits and stops a whole local Kubernetes
(etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the
process-backed node, Prometheus) in one work folder:

    workdir/kubeconfig      admin kubeconfig (client certificate in system:masters)
    workdir/env             KUBECONFIG=... and PROMETHEUS_URL=... lines
    workdir/state.json      what `LocalCluster.attach(workdir)` reads back
    workdir/logs/*.log      one log per process
    workdir/node/pods/<ns>_<pod>_<uid>/logs/<container>.log   pod output
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

from . import prometheus
from .build import ensure_binaries, ensure_prometheus
from .certs import Pki, make_pki
from .controlplane import Ports, apiserver_argv, controller_manager_argv, etcd_argv, scheduler_argv
from .kube import Credentials, Kube
from .kubeconfig import write_kubeconfig
from .node.agent import NodeConfig
from .paths import E2E_DIR, K8S_VERSION, VENV_BIN
from .podnet import PodNetwork, choose_octet
from .ports import free_port
from .procs import CLUSTER_ID_ENV, Proc, kill_tagged, tagged_processes
from .waiting import wait_for

# Started in this order, stopped in reverse. KEDA's two processes are started
# only on request (keda.py, after the cluster is up); listed so that stop() and
# attach() treat them as the cluster's own.
ORDER = ["podnet", "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
         "node", "prometheus", "keda-operator", "keda-adapter"]
DEFAULT_CAPACITY = {"cpu": "32", "memory": "128Gi", "pods": "110", "nvidia.com/gpu": "8",
                    "ephemeral-storage": "100Gi"}


class ClusterError(RuntimeError):
    pass


class LocalCluster:
    def __init__(self, workdir: str | os.PathLike, *, detached: bool = False,
                 node_name: str = "kvpilot-node", capacity: dict[str, str] | None = None,
                 scrape_interval: str = "1s", with_prometheus: bool = True,
                 mounts: str = "auto", log=None):
        self.workdir = Path(workdir).resolve()
        self.detached = detached
        self.node_name = node_name
        self.capacity = {**DEFAULT_CAPACITY, **(capacity or {})}
        self.scrape_interval = scrape_interval
        self.with_prometheus = with_prometheus
        self.mounts = mounts
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
        return self.workdir / "node" / "pods"

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
        state_file = self.workdir / "state.json"
        if state_file.exists():
            old = LocalCluster.attach(self.workdir)
            if old.running():
                raise ClusterError(f"a cluster is already running in {self.workdir}; stop it first")
            old.stop()
        for sub in ("pki", "etcd", "run", "node", "prometheus"):
            shutil.rmtree(self.workdir / sub, ignore_errors=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        bin_dir = ensure_binaries()
        prom_exe = ensure_prometheus() if self.with_prometheus else None
        self.state = {"cluster_id": uuid.uuid4().hex[:12], "bin_dir": str(bin_dir),
                      "version": K8S_VERSION, "workdir": str(self.workdir), "started": time.time()}
        try:
            self._start(bin_dir, prom_exe)
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

    def _start(self, bin_dir: Path, prom_exe: Path | None) -> None:
        # Pod network first: the API server listens on its gateway.
        octet = choose_octet()
        holder = self._spawn("podnet", ["unshare", "--net", "--", "sleep", "infinity"])
        net = PodNetwork(octet, holder.pid)
        net.setup()
        gw = net.gateway
        service_cidr = f"10.{octet}.254.0/24"
        ports = Ports(etcd_client=free_port(), etcd_peer=free_port(), apiserver=free_port(gw),
                      controller_manager=free_port(), scheduler=free_port(), node_logs=free_port(gw),
                      prometheus=free_port(gw))
        self.state.update(gateway=gw, net_octet=octet, ports=ports.__dict__,
                          server=f"https://{gw}:{ports.apiserver}")
        if prom_exe:
            self.state["prometheus_url"] = f"http://{gw}:{ports.prometheus}"
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
        self._spawn("kube-apiserver", apiserver_argv(bin_dir, pki, ports, gw, service_cidr))
        kube = Kube(creds, timeout=10)
        self._wait("kube-apiserver", lambda: kube.http.get("/readyz").status_code == 200, timeout=180)

        self._spawn("kube-controller-manager",
                    controller_manager_argv(bin_dir, pki, ports, kcm_kc, service_cidr))
        self._spawn("kube-scheduler", scheduler_argv(bin_dir, ports, sched_kc))
        node_cfg = NodeConfig(
            name=self.node_name, workdir=self.workdir / "node", creds=creds, net_octet=octet,
            net_holder_pid=holder.pid, cluster_id=self.cluster_id, apiserver_port=ports.apiserver,
            log_port=ports.node_logs, serving_cert=pki.cert("node-serving"),
            serving_key=pki.key("node-serving"), venv_bin=VENV_BIN, version=K8S_VERSION,
            capacity=self.capacity, mounts=self.mounts)
        (self.workdir / "node").mkdir(parents=True, exist_ok=True)
        cfg_file = self.workdir / "node" / "node.json"
        cfg_file.write_text(node_cfg.to_json())
        self._spawn("node", [sys.executable, "-m", "localcluster.node", "--config", str(cfg_file)],
                    cwd=E2E_DIR)
        if prom_exe:
            cfg = prometheus.write_config(self.workdir / "prometheus.yml", self.server, pki,
                                          self.scrape_interval)
            self._spawn("prometheus", prometheus.argv(prom_exe, cfg, self.workdir / "prometheus",
                                                      gw, ports.prometheus))

        insecure = lambda port: httpx.get(f"https://127.0.0.1:{port}/healthz", verify=False,  # noqa: E731
                                          timeout=2).status_code == 200
        self._wait("kube-controller-manager", lambda: insecure(ports.controller_manager))
        self._wait("kube-scheduler", lambda: insecure(ports.scheduler))
        self._wait("node", lambda: _node_ready(kube, self.node_name))
        if prom_exe:
            self._wait("prometheus", lambda: httpx.get(f"{self.prometheus_url}/-/ready",
                                                       timeout=2).status_code == 200)
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
            p = self.procs.get(name)
            if p is not None:
                p.stop(grace=30 if name == "node" else 10)
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

    def pod_log(self, namespace: str, pod: str, container: str) -> Path | None:
        """The output file of a pod's container (newest pod of that name)."""
        found = sorted(self.pods_dir.glob(f"{namespace}_{pod}_*/logs/{container}.log"),
                       key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None

    def pod_processes(self, namespace: str | None = None, pod: str | None = None) -> list[int]:
        """Pids of live pod processes (found by their KVPILOT_POD tag)."""
        pids = []
        want = None if namespace is None else f"{namespace}/{pod}" if pod else f"{namespace}/"
        for pid in tagged_processes(self.cluster_id):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            tags = [e[len(b"KVPILOT_POD="):].decode() for e in env if e.startswith(b"KVPILOT_POD=")]
            if tags and (want is None or (tags[0] == want if pod else tags[0].startswith(want))):
                pids.append(pid)
        return pids


def _node_ready(kube: Kube, name: str) -> bool:
    node = kube.get(f"/api/v1/nodes/{name}", ok404=True)
    if not node:
        return False
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in node.get("status", {}).get("conditions", []))
