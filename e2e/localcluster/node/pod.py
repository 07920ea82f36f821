"""A pod on the process-backed node: one worker thread per pod sets up the
pod's address and volumes, runs init containers then containers as local
processes, probes them, restarts them with back-off, reports the pod status,
and on deletion stops them (SIGTERM, SIGKILL after the grace period) and
removes the pod."""
from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .container import Container, now_iso
from .env import EnvError, container_argv, container_env
from .volumes import VolumeError, Volumes

if TYPE_CHECKING:
    from .agent import Node

log = logging.getLogger("kvpilot.node")



def prestop_sleep_s(spec: dict) -> float:
    """Seconds of a container's `lifecycle.preStop.sleep` hook (0 without one). Other hook
    actions (exec, httpGet) are not run by this node; they are logged and skipped."""
    hook = (spec.get("lifecycle") or {}).get("preStop") or {}
    if not hook:
        return 0.0
    if "sleep" not in hook:
        log.warning("container %s: preStop %s is not supported by this node; skipped", spec.get("name"),
                    sorted(hook))
        return 0.0
    return float(hook["sleep"].get("seconds", 0))

class PodWorker(threading.Thread):
    def __init__(self, node: "Node", pod: dict):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.node, self.pod = node, pod
        self.ns, self.pod_name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.dir = node.workdir / "pods" / f"{self.ns}_{self.pod_name}_{self.uid[:8]}"
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.deleting = False  # the API asked for deletion (deletionTimestamp)
        self.vanished = False  # the pod object is gone: stop now
        self.shutdown = False  # the node is stopping
        self.volumes_dirty = True
        self.volumes_retry_at = 0.0
        self.host_network = bool(pod["spec"].get("hostNetwork"))
        self.ip = node.gateway  # a pod address is allocated when the worker starts
        self.start_time = now_iso()
        self.transitions: dict[str, tuple[str, str]] = {}
        self.last_status: dict | None = None
        self.config_error: str | None = None
        spec = pod["spec"]
        logs = self.dir / "logs"
        self.inits = [Container(c, init=True, log_dir=logs) for c in spec.get("initContainers") or []]
        self.containers = [Container(c, init=False, log_dir=logs) for c in spec.get("containers") or []]
        self.init_done = not self.inits
        self.volumes: Volumes | None = None

    # --- events from the node --------------------------------------------
    def update(self, pod: dict) -> None:
        with self.lock:
            self.pod = pod
            if pod["metadata"].get("deletionTimestamp"):
                self.deleting = True
        self.wake.set()

    def object_changed(self, kind: str, name: str) -> None:
        if self.volumes and (kind, name) in self.volumes.references():
            self.volumes_dirty = True
            self.wake.set()

    def vanish(self) -> None:
        self.vanished = True
        self.wake.set()

    def stop(self) -> None:
        self.shutdown = True
        self.wake.set()

    # --- main loop -------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("pod worker %s/%s failed", self.ns, self.pod_name)
            self._kill_all(grace=0)
        finally:
            self._cleanup()

    def _run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self.host_network:
            self.ip = self.node.ipam.allocate(self.uid)
        log.info("pod %s/%s: ip %s, folder %s", self.ns, self.pod_name, self.ip, self.dir)
        self.volumes = Volumes(self.pod, self.dir / "volumes", self.node.lookup, self.node.token)
        while True:
            if self.vanished or self.shutdown or self.deleting:
                self._terminate()
                return
            if self.volumes_dirty and time.monotonic() >= self.volumes_retry_at:
                self._sync_volumes()
            if self.config_error is None:
                self._step()
            self._push_status()
            self.wake.wait(0.1)
            self.wake.clear()

    def _sync_volumes(self) -> None:
        try:
            self.volumes.sync()
            self.volumes_dirty = False
            if self.config_error and self.config_error.startswith("volume"):
                self.config_error = None
        except (VolumeError, OSError) as e:
            self.config_error = f"volume: {e}"
            self.volumes_retry_at = time.monotonic() + 1.0
            self._set_waiting("CreateContainerConfigError", str(e))

    def _set_waiting(self, reason: str, msg: str) -> None:
        for c in self.inits + self.containers:
            if not c.running and c.terminated is None:
                c.waiting = (reason, msg)

    def _restart_policy(self) -> str:
        return self.pod["spec"].get("restartPolicy", "Always")

    def _step(self) -> None:
        t = time.monotonic()
        if not self.init_done:
            self._step_init(t)
            return
        for c in self.containers:
            if c.reap():
                self._exited(c)
            if c.proc is None and c.terminated is None and t >= c.next_start:
                self._start(c)
            if c.running:
                self._probe(c, t)

    def _exited(self, c: Container) -> None:
        """Applies the restart policy to a container that just ended."""
        log.info("pod %s/%s container %s exited: %s", self.ns, self.pod_name, c.name,
                 c.terminated["exitCode"])
        policy = self._restart_policy()
        if policy == "Always" or (policy == "OnFailure" and c.terminated["exitCode"] != 0):
            c.schedule_restart()

    def _step_init(self, t: float) -> None:
        for c in self.inits:
            if c.terminated is not None and c.terminated["exitCode"] == 0:
                continue
            if c.reap():
                if c.terminated["exitCode"] == 0:
                    continue
                if self._restart_policy() == "Never":
                    return  # the pod has failed
                c.schedule_restart()
            if c.proc is None and c.terminated is None and t >= c.next_start:
                self._start(c)
            return
        self.init_done = True
        self.wake.set()

    def _probe(self, c: Container, t: float) -> None:
        exec_fn = lambda cmd, timeout: self._exec(c, cmd, timeout)  # noqa: E731
        if c.startup.result is not True:
            c.startup.tick(t, self.ip, c.spec, exec_fn)
            if c.startup.result is False:
                self._kill(c, "StartupProbe")
            return
        c.readiness.tick(t, self.ip, c.spec, exec_fn)
        c.liveness.tick(t, self.ip, c.spec, exec_fn)
        if c.liveness.result is False:
            self._kill(c, "LivenessProbe")

    def _kill(self, c: Container, why: str) -> None:
        log.info("pod %s/%s container %s: %s failed, restarting", self.ns, self.pod_name, c.name, why)
        c.kill_reason = "Error"
        grace = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        self._stop_containers([c], grace)
        if c.terminated is not None and not c.init:
            self._exited(c)

    def _exec(self, c: Container, cmd: list[str], timeout: float) -> int:
        env, _ = self._env_argv(c, check_argv=False)
        # In the container's network and mount namespaces and working directory.
        argv = ["nsenter", "-t", str(c.pid), "-n", "-m", "-w", "--", *cmd]
        return subprocess.run(argv, env=env, cwd="/", timeout=timeout,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode

    # --- starting a process -----------------------------------------------
    def _env_argv(self, c: Container, check_argv: bool = True) -> tuple[dict[str, str], list[str]]:
        with self.lock:
            pod = json.loads(json.dumps(self.pod))
        status = pod.setdefault("status", {})
        gw = self.node.gateway
        status.update(podIP=self.ip, podIPs=[{"ip": self.ip}], hostIP=gw, hostIPs=[{"ip": gw}])
        spec_env = container_env(pod, c.spec, self.node.lookup)
        argv = container_argv(c.spec, spec_env) if check_argv else []
        env = self.node.base_env(pod)
        env.update(spec_env)
        return env, argv

    def _mounts(self, c: Container) -> list[dict]:
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            if m["name"] not in self.volumes.paths:
                continue
            mounts.append({"src": str(self.volumes.mount_source(m)), "dst": m["mountPath"],
                           "readOnly": bool(m.get("readOnly"))})
        return mounts

    def _cwd(self, c: Container) -> str:
        wd = c.spec.get("workingDir")
        if wd and (self.node.mount_namespaces or Path(wd).is_dir()):
            return wd
        return str(self.dir)

    def _start(self, c: Container) -> None:
        try:
            env, argv = self._env_argv(c)
        except EnvError as e:
            c.waiting = ("CreateContainerConfigError", str(e))
            c.next_start = time.monotonic() + 1
            return
        mounts = self._mounts(c)
        cwd = self._cwd(c)
        if self.node.mount_namespaces:
            for m in mounts:
                self.node.make_mountpoint(Path(m["src"]), Path(m["dst"]))
        else:
            argv, env, cwd = rewrite_paths(argv, env, cwd, mounts)
            mounts = []
        netns = None if self.host_network else self.node.net.netns
        c.start({"argv": argv, "env": env, "cwd": cwd, "mounts": mounts, "netns": netns},
                self.dir / f"{c.name}.launch.json", self.node.launcher_env())
        log.info("pod %s/%s container %s: pid %d, log %s", self.ns, self.pod_name, c.name, c.pid, c.log)

    # --- stopping ----------------------------------------------------------
    def _grace(self) -> float:
        meta = self.pod["metadata"]
        g = meta.get("deletionGracePeriodSeconds")
        if g is None:
            g = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        if self.shutdown:
            g = min(float(g), self.node.shutdown_grace)
        return float(g)

    def _stop_containers(self, cs: list[Container], grace: float) -> None:
        running = [c for c in cs if c.running]
        deadline = time.monotonic() + grace
        # preStop hooks first, within the grace period, as the kubelet runs them (only the
        # sleep action here: it is what gives endpoints time to drop the pod before SIGTERM).
        hook_end = time.monotonic() + min(grace, max([prestop_sleep_s(c.spec) for c in running] + [0.0]))
        while any(c.running for c in running) and time.monotonic() < hook_end:
            time.sleep(0.05)
        for c in running:
            c.signal(signal.SIGTERM)
        while any(c.running for c in running) and time.monotonic() < deadline:
            time.sleep(0.05)
        for c in running:
            c.signal(signal.SIGKILL)
        for c in running:
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            c.reap()

    def _kill_all(self, grace: float) -> None:
        self._stop_containers(self.inits + self.containers, grace)

    def _terminate(self) -> None:
        grace = 0.0 if self.vanished else self._grace()
        log.info("pod %s/%s: stopping (grace %.0fs)", self.ns, self.pod_name, grace)
        self._kill_all(grace)
        if self.deleting and not self.vanished and not self.shutdown:
            self._push_status()
            self.node.finish_deletion(self.ns, self.pod_name, self.uid)

    def _cleanup(self) -> None:
        self.node.ipam.release(self.uid)
        shutil.rmtree(self.dir / "volumes", ignore_errors=True)
        for f in self.dir.glob("*.pid"):
            f.unlink(missing_ok=True)
        self.node.worker_done(self)

    # --- status ------------------------------------------------------------
    def _cond(self, kind: str, ok: bool) -> dict:
        value = "True" if ok else "False"
        prev = self.transitions.get(kind)
        if prev is None or prev[0] != value:
            self.transitions[kind] = (value, now_iso())
        return {"type": kind, "status": value, "lastTransitionTime": self.transitions[kind][1]}

    def _phase(self) -> str:
        if any(c.terminated and c.terminated["exitCode"] != 0 for c in self.inits) \
                and self._restart_policy() == "Never":
            return "Failed"
        if not self.init_done or any(c.started_at is None for c in self.containers):
            return "Pending"
        if all(c.terminated is not None for c in self.containers):
            return "Failed" if any(c.terminated["exitCode"] != 0 for c in self.containers) else "Succeeded"
        return "Running"

    def status(self) -> dict:
        ready = self.init_done and all(c.ready for c in self.containers)
        conds = [self._cond("PodReadyToStartContainers", self.volumes is not None),
                 self._cond("Initialized", self.init_done),
                 self._cond("Ready", ready), self._cond("ContainersReady", ready),
                 self._cond("PodScheduled", True)]
        gw = self.node.gateway
        st = {"phase": self._phase(), "conditions": conds, "hostIP": gw, "hostIPs": [{"ip": gw}], "podIP": self.ip, "podIPs": [{"ip": self.ip}],
              "startTime": self.start_time,
              "containerStatuses": [c.status() for c in self.containers]}
        if self.inits:
            st["initContainerStatuses"] = [c.status() for c in self.inits]
        return st

    def _push_status(self) -> None:
        st = self.status()
        if st == self.last_status:
            return
        if self.node.patch_status(self.ns, self.pod_name, st):
            self.last_status = st


def rewrite_paths(argv: list[str], env: dict[str, str], cwd: str,
                  mounts: list[dict]) -> tuple[list[str], dict[str, str], str]:
    """Without mount namespaces: mount paths named in the command line, env
    values or working directory are replaced by the volume's host folder."""
    pairs = sorted(((m["dst"].rstrip("/"), m["src"]) for m in mounts), key=lambda p: -len(p[0]))

    def fix(s: str) -> str:
        for dst, src in pairs:
            if dst and dst in s:
                s = s.replace(dst, src)
        return s
    return [fix(a) for a in argv], {k: fix(v) for k, v in env.items()}, fix(cwd)
