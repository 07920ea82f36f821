"""The process-backed node: registers a Ready Node, watches the pods bound to
it (the scheduler binds them) and runs each through a PodWorker; watches
ConfigMaps and Secrets to keep mounted volumes in sync; serves container logs
to the API server (`kubectl logs`). Run as `python -m localcluster.node
--config node.json` (cwd e2e/); the cluster writes that file."""
from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..kube import ApiError, Credentials, Kube, pod_path
from .container import LAUNCHER, now_iso
from ..podnet import PodNetwork
from .ipam import Ipam
from .logserver import LogServer
from .pod import PodWorker

log = logging.getLogger("kvpilot.node")


@dataclass
class NodeConfig:
    name: str
    workdir: Path
    creds: Credentials
    net_octet: int
    net_holder_pid: int
    cluster_id: str
    apiserver_port: int
    log_port: int
    serving_cert: Path
    serving_key: Path
    venv_bin: Path
    version: str
    capacity: dict[str, str] = field(default_factory=dict)
    shutdown_grace: float = 5.0
    mounts: str = "auto"  # auto | namespace | rewrite

    def to_json(self) -> str:
        d = {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}
        d["creds"] = self.creds.to_json()
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "NodeConfig":
        d = json.loads(text)
        d["creds"] = Credentials.from_json(d["creds"])
        for k in ("workdir", "serving_cert", "serving_key", "venv_bin"):
            d[k] = Path(d[k])
        return cls(**d)


def mount_namespaces_work(workdir: Path) -> bool:
    """Whether this machine lets us give a process a private mount namespace
    with bind mounts (root, and a kernel/sandbox that allows unshare)."""
    with tempfile.TemporaryDirectory(dir=workdir) as d:
        src, dst = Path(d, "src"), Path(d, "dst")
        src.mkdir()
        dst.mkdir()
        (src / "probe").write_text("ok")
        spec = Path(d, "spec.json")
        spec.write_text(json.dumps({"argv": ["test", "-f", str(dst / "probe")], "env": {"PATH": "/usr/bin:/bin"},
                                    "cwd": "/", "mounts": [{"src": str(src), "dst": str(dst)}]}))
        r = subprocess.run([sys.executable, "-I", "-S", str(LAUNCHER), str(spec)],
                           capture_output=True, timeout=30)
        return r.returncode == 0 and not (dst / "probe").exists()


class Node:
    def __init__(self, cfg: NodeConfig):
        self.cfg, self.name, self.workdir = cfg, cfg.name, cfg.workdir
        self.kube = Kube(cfg.creds)
        self.net = PodNetwork(cfg.net_octet, cfg.net_holder_pid)
        self.gateway = self.net.gateway
        self.ipam = Ipam(self.net)
        self.shutdown_grace = cfg.shutdown_grace
        self.workers: dict[str, PodWorker] = {}
        self.finished: set[str] = set()
        self.lock = threading.Lock()
        self.cache: dict[tuple[str, str, str], dict] = {}
        self.stopping = threading.Event()
        self.mountpoints: set[Path] = set()
        if cfg.mounts == "auto":
            self.mount_namespaces = mount_namespaces_work(cfg.workdir)
        else:
            self.mount_namespaces = cfg.mounts == "namespace"
        log.info("volume mounts: %s", "private mount namespaces with bind mounts"
                 if self.mount_namespaces else "paths rewritten to pod folders")

    # --- helpers used by pod workers ----------------------------------------
    def lookup(self, kind: str, ns: str, name: str) -> dict | None:
        obj = self.cache.get((kind, ns, name))
        if obj is None:
            obj = self.kube.get(f"/api/v1/namespaces/{ns}/{kind}/{name}", ok404=True)
        return obj

    def token(self, ns: str, sa: str, audience: str | None, expiration: int) -> str:
        spec: dict = {"expirationSeconds": max(600, int(expiration))}
        if audience:
            spec["audiences"] = [audience]
        r = self.kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
                           {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
        return r["status"]["token"]

    def base_env(self, pod: dict) -> dict[str, str]:
        """What every container starts from: this machine's environment with the
        repository's venv first on PATH, plus what the kubelet adds."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPILOT_NODE_")}
        env["PATH"] = f"{self.cfg.venv_bin}:{env.get('PATH', '/usr/local/bin:/usr/bin:/bin')}"
        env.pop("VIRTUAL_ENV", None)
        env.update(HOSTNAME=pod["metadata"]["name"], PYTHONUNBUFFERED="1",
                   KUBERNETES_SERVICE_HOST=self.gateway,
                   KUBERNETES_SERVICE_PORT=str(self.cfg.apiserver_port),
                   KVPILOT_CLUSTER_ID=self.cfg.cluster_id,
                   KVPILOT_POD=f"{pod['metadata']['namespace']}/{pod['metadata']['name']}")
        return env

    def launcher_env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "KVPILOT_CLUSTER_ID": self.cfg.cluster_id}

    def patch_status(self, ns: str, name: str, status: dict) -> bool:
        try:
            self.kube.merge_patch(pod_path(ns, name, "status"), {"status": status})
            return True
        except ApiError as e:
            if e.status != 404:
                log.warning("status of %s/%s: %s", ns, name, e)
            return False
        except Exception as e:  # connection trouble: try again next round
            log.warning("status of %s/%s: %s", ns, name, e)
            return False

    def finish_deletion(self, ns: str, name: str, uid: str) -> None:
        try:
            self.kube.delete(pod_path(ns, name), {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})
        except ApiError as e:
            if e.status not in (404, 409):
                log.warning("delete %s/%s: %s", ns, name, e)

    def make_mountpoint(self, src: Path, dst: Path) -> None:
        """Creates a missing mount point on the host, remembering the topmost
        folder made so that it is removed once no pod mounts there."""
        if dst.exists():
            return
        top = dst
        while not top.parent.exists():
            top = top.parent
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.touch()
        with self.lock:
            self.mountpoints.add(top)

    def worker_done(self, w: PodWorker) -> None:
        with self.lock:
            if self.workers.get(w.uid) is w:
                del self.workers[w.uid]
            self.finished.add(w.uid)
            in_use = [Path(m["mountPath"]) for x in self.workers.values()
                      for c in x.pod["spec"].get("containers", []) + x.pod["spec"].get("initContainers", [])
                      for m in c.get("volumeMounts") or []]
            for top in list(self.mountpoints):
                if not any(p == top or top in p.parents for p in in_use):
                    self.mountpoints.discard(top)
                    shutil.rmtree(top, ignore_errors=True) if top.is_dir() else top.unlink(missing_ok=True)

    def log_file(self, ns: str, pod: str, container: str) -> Path | None:
        with self.lock:
            for w in self.workers.values():
                if w.ns == ns and w.pod_name == pod:
                    return w.dir / "logs" / f"{container}.log"
        found = sorted((self.workdir / "pods").glob(f"{ns}_{pod}_*/logs/{container}.log"),
                       key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None

    # --- node object -----------------------------------------------------------
    def node_status(self) -> dict:
        t = now_iso()
        cond = lambda kind, status, reason, msg: {  # noqa: E731
            "type": kind, "status": status, "reason": reason, "message": msg,
            "lastHeartbeatTime": t, "lastTransitionTime": self.started_at}
        return {
            "capacity": self.cfg.capacity, "allocatable": self.cfg.capacity,
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "process node"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "process node"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "process node"),
                cond("Ready", "True", "KubeletReady", "kvpilot process-backed node is posting ready status"),
            ],
            "addresses": [{"type": "InternalIP", "address": self.gateway},
                          {"type": "Hostname", "address": self.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.cfg.log_port}},
            "nodeInfo": {"kubeletVersion": self.cfg.version, "kubeProxyVersion": "",
                         "containerRuntimeVersion": "process://kvpilot-node",
                         "operatingSystem": "linux", "architecture": "amd64",
                         "osImage": platform.platform(), "kernelVersion": platform.release(),
                         "machineID": self.cfg.cluster_id, "systemUUID": self.cfg.cluster_id,
                         "bootID": self.cfg.cluster_id},
        }

    def register(self) -> None:
        self.started_at = now_iso()
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.name, "labels": {
            "kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64", "kvpilot.dev/process-node": "true"}}}
        try:
            self.kube.post("/api/v1/nodes", body)
        except ApiError as e:
            if e.status != 409:
                raise
        self.kube.merge_patch(f"/api/v1/nodes/{self.name}/status", {"status": self.node_status()})
        # The API server taints new nodes not-ready; node-lifecycle-controller (not
        # run here) would lift that once the node is Ready, so the node does it.
        node = self.kube.get(f"/api/v1/nodes/{self.name}")
        taints = [t for t in node["spec"].get("taints") or []
                  if not t["key"].startswith("node.kubernetes.io/")]
        self.kube.merge_patch(f"/api/v1/nodes/{self.name}", {"spec": {"taints": taints or None}})

    def heartbeat(self) -> None:
        while not self.stopping.wait(10):
            try:
                self.kube.merge_patch(f"/api/v1/nodes/{self.name}/status", {"status": self.node_status()})
            except Exception as e:
                log.warning("node heartbeat: %s", e)

    # --- watches -----------------------------------------------------------------
    def _watch_forever(self, path: str, params: dict, on_list, on_event) -> None:
        kube = Kube(self.cfg.creds)
        while not self.stopping.is_set():
            try:
                lst = kube.get(path, params=params)
                on_list(lst["items"])
                rv = lst["metadata"]["resourceVersion"]
                while not self.stopping.is_set():
                    for ev in kube.watch(path, dict(params, resourceVersion=rv), timeout_s=60):
                        if ev["type"] == "ERROR":
                            raise ApiError(ev["object"].get("code", 500), json.dumps(ev["object"]))
                        rv = ev["object"]["metadata"].get("resourceVersion", rv)
                        if ev["type"] != "BOOKMARK":
                            on_event(ev["type"], ev["object"])
            except Exception as e:
                if self.stopping.is_set():
                    break
                log.info("watch %s restarts: %s", path, str(e)[:200])
                self.stopping.wait(0.5)

    def _pods_listed(self, pods: list[dict]) -> None:
        uids = set()
        for p in pods:
            uids.add(p["metadata"]["uid"])
            self._pod_event("MODIFIED", p)
        with self.lock:
            gone = [w for uid, w in self.workers.items() if uid not in uids]
        for w in gone:
            w.vanish()

    def _pod_event(self, kind: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        with self.lock:
            w = self.workers.get(uid)
            if kind == "DELETED":
                if w:
                    w.vanish()
                return
            if w is not None:
                w.update(pod)
                return
            if uid in self.finished or self.stopping.is_set():
                return
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                self.finished.add(uid)
                threading.Thread(target=self.finish_deletion,
                                 args=(meta["namespace"], meta["name"], uid), daemon=True).start()
                return
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                return
            w = PodWorker(self, pod)
            self.workers[uid] = w
        w.update(pod)
        w.start()

    def _objects_listed(self, kind: str, items: list[dict]) -> None:
        for o in items:
            self._object_event(kind, "MODIFIED", o)

    def _object_event(self, kind: str, ev: str, obj: dict) -> None:
        key = (kind, obj["metadata"]["namespace"], obj["metadata"]["name"])
        if ev == "DELETED":
            self.cache.pop(key, None)
        else:
            old = self.cache.get(key)
            self.cache[key] = obj
            if old is not None and old.get("metadata", {}).get("resourceVersion") == obj["metadata"]["resourceVersion"]:
                return
        with self.lock:
            workers = [w for w in self.workers.values() if w.ns == key[1]]
        for w in workers:
            w.object_changed(kind, key[2])

    # --- run -----------------------------------------------------------------------
    def run(self) -> None:
        self.register()
        log.info("node %s registered; pods live under %s", self.name, self.workdir / "pods")
        self.logs = LogServer(self, self.gateway, self.cfg.log_port, self.cfg.serving_cert, self.cfg.serving_key)
        self.logs.start()
        threads = [threading.Thread(target=self.heartbeat, daemon=True, name="heartbeat")]
        for kind in ("configmaps", "secrets"):
            threads.append(threading.Thread(
                target=self._watch_forever, daemon=True, name=f"watch-{kind}",
                args=(f"/api/v1/{kind}", {},
                      lambda items, k=kind: self._objects_listed(k, items),
                      lambda ev, o, k=kind: self._object_event(k, ev, o))))
        threads.append(threading.Thread(
            target=self._watch_forever, daemon=True, name="watch-pods",
            args=("/api/v1/pods", {"fieldSelector": f"spec.nodeName={self.name}"},
                  self._pods_listed, self._pod_event)))
        for t in threads:
            t.start()
        self.stopping.wait()

    def stop(self) -> None:
        """Stops every pod's processes (a short grace), leaving the API objects."""
        self.stopping.set()
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.stop()
        deadline = time.monotonic() + self.shutdown_grace + 10
        for w in workers:
            w.join(max(0.1, deadline - time.monotonic()))
        if hasattr(self, "logs"):
            self.logs.stop()
