"""The local cluster's node: containerd 2.x with runc and the CNI reference
plugins, the real kubelet, kube-proxy and a device plugin advertising
simulated GPUs, all inside the cluster's network namespace (podnet.py).

Images come from OCI archives (no registry): the pause and CoreDNS images
are written here from their static binaries (ociarchive.py), kvpilot's own by
`make image`. containerd keeps images in a root folder that successive
clusters share (importing a multi-GB image takes over a minute), guarded by a
lock that containerd holds while it runs: one node per machine at a time,
which the kubelet's fixed device-plugin folder requires anyway."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from .build import version_of
from .cgroups import CGROUP_FS, hierarchies, kill_and_remove
from .certs import Pki, issue
from .kubeconfig import write_kubeconfig
from .nodeconfig import NodeLayout, containerd_config, cni_conflist, kube_proxy_config, kubelet_config, resolv_conf
from .ociarchive import BinaryImage
from .paths import cache_dir

K8S_NAMESPACE = "k8s.io"  # containerd's namespace for the CRI
PAUSE_IMAGE_REPO = "docker.io/kvpilot/pause"  # the Pod sandbox (e2e/pause)
COREDNS_IMAGE_REPO = "docker.io/kvpilot/coredns"


@dataclass(frozen=True)
class NodeBinaries:
    k8s: Path          # kubelet, kube-proxy
    containerd: Path   # containerd, containerd-shim-runc-v2, ctr
    cni: Path          # bridge, host-local, loopback, portmap
    pause: Path
    coredns: Path
    device_plugin: Path
    runc: str


REQUIRED_COMMANDS = ("runc", "iptables", "nsenter", "unshare", "flock", "mount", "umount")
REQUIRED_CGROUPS = ("cpu", "cpuacct", "cpuset", "memory", "pids", "devices", "freezer")


def preflight() -> list[str]:
    """What this machine lacks to run containers (empty when nothing): the node refuses to
    start rather than run pods some other way."""
    problems = [f"the command `{c}` (Debian: e2e/node-deps.sh installs the packages)"
                for c in REQUIRED_COMMANDS if shutil.which(c) is None]
    mounted = {h.name for h in hierarchies()} if Path("/sys/fs/cgroup").is_dir() else set()
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        # Stopping a cluster kills its containers through the v1 hierarchies (cgroups.py).
        problems.append("cgroup v1 hierarchies (this host is cgroup v2 only, which the local "
                        "node does not support yet)")
    else:
        problems += [f"the cgroup v1 `{c}` controller mounted at /sys/fs/cgroup/{c}"
                     for c in REQUIRED_CGROUPS if c not in mounted]
    if "overlay" not in Path("/proc/filesystems").read_text():
        problems.append("the overlay filesystem (containerd's overlayfs snapshotter)")
    return problems


def shared_containerd_root() -> Path:
    return cache_dir() / "node" / "containerd"


def _root_lock(root: Path) -> Path:
    """The flock a running containerd holds on its root: one node per root, and so per machine."""
    root.parent.mkdir(parents=True, exist_ok=True)
    return root.parent / (root.name + ".lock")


def root_in_use(root: Path) -> bool:
    return subprocess.run(["flock", "-n", str(_root_lock(root)), "true"]).returncode != 0


def containerd_argv(bins: NodeBinaries, config: Path, root: Path, netns: str) -> list[str]:
    """containerd in the pod network's namespace, holding the root's lock while it runs."""
    # --no-fork: flock execs, so containerd itself holds the lock and gets our signals.
    return ["flock", "--no-fork", "-n", str(_root_lock(root)), "nsenter", f"--net={netns}", "--",
            str(bins.containerd / "containerd"), "--config", str(config)]


def write_node_files(n: NodeLayout, pki: Pki, *, bins: NodeBinaries, node_name: str, server: str,
                     kubelet_port: int, proxy_metrics_port: int, cgroup_root: str,
                     max_pods: int) -> dict[str, Path]:
    """Certificates, kubeconfigs and config files; returns the paths the argv builders need."""
    for d in (n.containerd_state, n.kubelet_root, n.pod_logs, n.cni_conf_dir, n.cni_state):
        d.mkdir(parents=True, exist_ok=True)
    kubelet_cert, kubelet_key = issue(pki, "kubelet", f"/O=system:nodes/CN=system:node:{node_name}",
                                      [], "clientAuth")
    serving_cert, serving_key = issue(pki, "kubelet-serving", f"/CN={node_name}",
                                      [f"IP:{n.node_ip}", f"DNS:{node_name}"], "serverAuth")
    proxy_cert, proxy_key = issue(pki, "kube-proxy", "/CN=system:kube-proxy", [], "clientAuth")
    files = {
        "containerd": n.workdir / "containerd.toml",
        "kubelet": n.workdir / "kubelet.yaml",
        "kube-proxy": n.workdir / "kube-proxy.yaml",
        "resolv": n.workdir / "resolv.conf",
        "kubelet-kubeconfig": write_kubeconfig(n.workdir / "kubelet.kubeconfig", server, pki.ca,
                                               kubelet_cert, kubelet_key, f"system:node:{node_name}"),
        "proxy-kubeconfig": write_kubeconfig(n.workdir / "kube-proxy.kubeconfig", server, pki.ca,
                                             proxy_cert, proxy_key, "system:kube-proxy"),
    }
    files["containerd"].write_text(containerd_config(
        n, cni_bin=bins.cni, runc=bins.runc, sandbox_image=f"{PAUSE_IMAGE_REPO}:{version_of('pause')}"))
    (n.cni_conf_dir / "10-kvpilot.conflist").write_text(json.dumps(cni_conflist(n), indent=1))
    files["resolv"].write_text(resolv_conf())
    files["kubelet"].write_text(yaml.safe_dump(kubelet_config(
        n, ca=pki.ca, serving_cert=serving_cert, serving_key=serving_key, port=kubelet_port,
        cgroup_root=cgroup_root, resolv_conf=files["resolv"], max_pods=max_pods)))
    files["kube-proxy"].write_text(yaml.safe_dump(kube_proxy_config(
        n, kubeconfig=files["proxy-kubeconfig"], node_name=node_name, metrics_port=proxy_metrics_port)))
    return files


def kubelet_argv(bins: NodeBinaries, files: dict[str, Path], n: NodeLayout, node_name: str,
                 netns: str) -> list[str]:
    return ["nsenter", f"--net={netns}", "--", str(bins.k8s / "kubelet"),
            f"--config={files['kubelet']}", f"--kubeconfig={files['kubelet-kubeconfig']}",
            f"--root-dir={n.kubelet_root}", f"--hostname-override={node_name}",
            f"--node-ip={n.node_ip}", "--v=1"]


def kube_proxy_argv(bins: NodeBinaries, files: dict[str, Path], netns: str) -> list[str]:
    return ["nsenter", f"--net={netns}", "--", str(bins.k8s / "kube-proxy"),
            f"--config={files['kube-proxy']}", "--v=1"]


def device_plugin_argv(bins: NodeBinaries, n: NodeLayout, gpus: int) -> list[str]:
    return [str(bins.device_plugin), "--resource=nvidia.com/gpu", f"--count={gpus}",
            f"--plugin-dir={n.device_plugin_dir}"]


class Ctr:
    """containerd's own CLI against one containerd socket, in the CRI's namespace."""

    def __init__(self, containerd_bin: Path, socket: Path):
        self.argv = [str(containerd_bin / "ctr"), "--address", str(socket), "-n", K8S_NAMESPACE]

    def run(self, *args: str, check: bool = True, timeout: float = 600) -> str:
        r = subprocess.run([*self.argv, *args], capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed: {r.stderr.strip()}")
        return r.stdout

    def ready(self) -> bool:
        try:
            return subprocess.run([*self.argv, "version"], capture_output=True,
                                  timeout=5).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def image_digests(self) -> dict[str, str]:
        """name -> the digest its name points at (a manifest or index)."""
        out = {}
        for line in self.run("images", "ls").splitlines()[1:]:
            cols = line.split()
            if len(cols) >= 3:
                out[cols[0]] = cols[2]
        return out

    def import_archive(self, archive: Path, ref: str, log) -> None:
        """Imports `archive` unless `ref` already names the image it holds."""
        want = archive_digest(archive)
        if self.image_digests().get(ref) == want:
            return
        t = time.monotonic()
        log(f"importing {ref} from {archive} ({archive.stat().st_size / 2**20:.0f} MiB)")
        # The unpacked snapshots are what containers run from; dropping the compressed layers
        # from the content store afterwards saves the archive's size again on disk.
        self.run("images", "import", "--local", "--platform", "linux/amd64", "--discard-unpacked-layers",
                 str(archive))
        got = self.image_digests().get(ref)
        if got != want:
            raise RuntimeError(f"{archive} should have named {want} {ref}, containerd has {got}")
        log(f"imported {ref} ({time.monotonic() - t:.1f}s)")

    def remove_workloads(self) -> None:
        """Removes containers and sandboxes a previous cluster left in this root."""
        for cid in self.run("containers", "ls", "-q", check=False).split():
            self.run("tasks", "kill", "-s", "SIGKILL", cid, check=False, timeout=30)
            self.run("tasks", "delete", "-f", cid, check=False, timeout=30)
            self.run("containers", "delete", cid, check=False, timeout=30)
        for sid in self.run("sandboxes", "ls", "-q", check=False).split():
            self.run("sandboxes", "rm", "-f", sid, check=False, timeout=30)


def archive_digest(archive: Path) -> str:
    """The digest an OCI image archive's index names (its image's manifest)."""
    with tarfile.open(archive) as tar:  # a seekable file: headers are read, layers skipped
        member = tar.getmember("index.json")
        index = json.load(tar.extractfile(member))
    return index["manifests"][0]["digest"]


def binary_images(bins: NodeBinaries) -> list[tuple[BinaryImage, Path]]:
    """The node's own single-binary images and where their archives go."""
    out = cache_dir() / "images"
    pause, coredns = version_of("pause"), version_of("coredns")
    return [
        (BinaryImage(f"{PAUSE_IMAGE_REPO}:{pause}", bins.pause, "/pause"), out / f"pause-{pause}.tar"),
        (BinaryImage(f"{COREDNS_IMAGE_REPO}:{coredns}", bins.coredns, "/coredns"),
         out / f"coredns-{coredns}.tar"),
    ]


CGROUP_PREFIX = "kvpilot-"  # + the cluster id: the kubelet's cgroupRoot


def sweep_stale() -> list[int]:
    """Kills the containers of clusters that died without stopping (one node per machine,
    so any node cgroup found before this node starts is stale)."""
    killed: list[int] = []
    for d in sorted((CGROUP_FS / "pids").glob(CGROUP_PREFIX + "*")):
        killed += kill_and_remove("/" + d.name)
    return killed


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` (pod volumes, container root filesystems, netns files)."""
    prefix = str(path.resolve()).rstrip("/") + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if (point + "/").startswith(prefix):
            found.append(point)
    return found


# What a local node mounts under its workdir's node/ folder: the kubelet's root (bind-mounted
# onto itself to make it rshared), pod volumes, and containerd's sandbox files and rootfs.
_NODE_MOUNT = re.compile(r"(.+/node)/(kubelet(/pods/.*)?|containerd/state/.*)")


def node_dirs_with_mounts(points: list[str]) -> list[str]:
    """The local nodes' folders that hold any of these mount points."""
    return sorted({m[1] for m in map(_NODE_MOUNT.fullmatch, points) if m})


def unmount_stale() -> list[str]:
    """Unmounts what the nodes of dead clusters left (a run killed before its teardown):
    one node per machine, so before this one starts, any such mount is stale.
    Returns the node folders it cleared."""
    stale = node_dirs_with_mounts(mounts_under(Path("/")))
    for d in stale:
        unmount_under(Path(d))
    return stale


def unmount_under(path: Path) -> None:
    """Lazily unmounts what the kubelet and containerd left mounted, deepest first."""
    for point in sorted(set(mounts_under(path)), key=lambda p: -p.count("/")):
        subprocess.run(["umount", "-l", point], capture_output=True)
