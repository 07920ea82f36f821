"""The node's configuration builders and image archives, without a cluster."""
from __future__ import annotations

import hashlib
import ipaddress
import json
import shutil
import subprocess
import tarfile
import tomllib
from pathlib import Path

import pytest

from localcluster.addons import DNS_PORT, build_coredns
from localcluster.kubeletnode import node_dirs_with_mounts
from localcluster.nodeconfig import NodeLayout, cni_conflist, containerd_config, kube_proxy_config, kubelet_config
from localcluster.ociarchive import BinaryImage, write_archive
from localcluster.podnet import PodNetwork

LAYOUT = NodeLayout(42, Path("/w/node"), Path("/c/containerd"))
E2E = Path(__file__).resolve().parent


def test_layout_addresses_do_not_overlap():
    assert LAYOUT.node_ip == "10.42.255.253" and LAYOUT.dns_ip == "10.42.254.10"
    assert LAYOUT.pod_subnet == "10.42.0.0/17" and LAYOUT.service_cidr == "10.42.254.0/24"
    cluster = ipaddress.ip_network(LAYOUT.cluster_cidr)
    pods, services = ipaddress.ip_network(LAYOUT.pod_subnet), ipaddress.ip_network(LAYOUT.service_cidr)
    assert pods.subnet_of(cluster) and services.subnet_of(cluster) and not pods.overlaps(services)
    for ip in (LAYOUT.node_ip, LAYOUT.host_ip, LAYOUT.dns_ip, LAYOUT.pod_gateway):
        assert ipaddress.ip_address(ip) in cluster
    assert ipaddress.ip_address(LAYOUT.dns_ip) in services
    assert not {LAYOUT.node_ip, LAYOUT.host_ip} & {str(a) for a in (*pods, *services)}


def test_the_pod_network_and_the_node_share_one_set_of_addresses():
    net = PodNetwork(42, holder_pid=1)
    assert (net.node_ip, net.host_ip, net.cluster_cidr) == (LAYOUT.node_ip, LAYOUT.host_ip,
                                                             LAYOUT.cluster_cidr)


def test_stale_node_mounts_are_found_by_their_node_folder():
    points = ["/tmp/p/localcluster0/node/kubelet",
              "/tmp/p/localcluster0/node/kubelet/pods/u/volumes/kubernetes.io~projected/x",
              "/tmp/q/node/containerd/state/io.containerd.grpc.v1.cri/sandboxes/abc/shm",
              "/var/lib/kubelet/pods/u/volumes/x", "/proc", "/tmp/r/node/other"]
    assert node_dirs_with_mounts(points) == ["/tmp/p/localcluster0/node", "/tmp/q/node"]


def test_containerd_config_is_valid_toml_for_the_cri():
    cfg = tomllib.loads(containerd_config(LAYOUT, cni_bin=Path("/cni"), runc="/usr/sbin/runc",
                                          sandbox_image="docker.io/kvpilot/pause:v0.1.0"))
    assert cfg["version"] == 3 and cfg["root"] == "/c/containerd"
    assert cfg["grpc"]["address"] == "/w/node/containerd/containerd.sock"
    runtime = cfg["plugins"]["io.containerd.cri.v1.runtime"]
    runc = runtime["containerd"]["runtimes"]["runc"]
    assert runc["options"]["BinaryName"] == "/usr/sbin/runc" and runc["options"]["SystemdCgroup"] is False
    assert runtime["cni"]["bin_dirs"] == ["/cni"] and runtime["restrict_oom_score_adj"] is True
    images = cfg["plugins"]["io.containerd.cri.v1.images"]
    assert images["pinned_images"]["sandbox"] == "docker.io/kvpilot/pause:v0.1.0"


def test_kubelet_config_accepts_cgroup_v1_and_points_at_containerd():
    cfg = kubelet_config(LAYOUT, ca=Path("/ca"), serving_cert=Path("/c"), serving_key=Path("/k"),
                         port=10250, cgroup_root="/kvpilot-x", resolv_conf=Path("/r"), max_pods=110)
    assert cfg["failCgroupV1"] is False and cfg["cgroupDriver"] == "cgroupfs"
    assert cfg["containerRuntimeEndpoint"] == "unix:///w/node/containerd/containerd.sock"
    assert cfg["clusterDNS"] == ["10.42.254.10"] and cfg["cgroupRoot"] == "/kvpilot-x"
    assert cfg["authentication"]["anonymous"]["enabled"] is False
    # Disk signals off ("0%" disables a threshold): met, they delete every unused image.
    assert {cfg["evictionHard"][s] for s in ("nodefs.available", "imagefs.available",
                                              "nodefs.inodesFree")} == {"0%"}


def test_cni_and_kube_proxy_share_the_cluster_cidr():
    net = cni_conflist(LAYOUT)
    assert [p["type"] for p in net["plugins"]] == ["bridge", "portmap"]
    assert net["plugins"][0]["ipam"]["ranges"][0][0]["subnet"] == LAYOUT.pod_subnet
    proxy = kube_proxy_config(LAYOUT, kubeconfig=Path("/kc"), node_name="n", metrics_port=1)
    assert proxy["mode"] == "iptables" and proxy["clusterCIDR"] == "10.42.0.0/16"


def test_binary_image_archive_is_an_oci_layout_named_for_containerd(tmp_path):
    exe = tmp_path / "pause"
    exe.write_bytes(b"\x7fELF not really")
    out = write_archive(BinaryImage("docker.io/kvpilot/pause:v1", exe, "/pause"), tmp_path / "a.tar")
    again = write_archive(BinaryImage("docker.io/kvpilot/pause:v1", exe, "/pause"), tmp_path / "b.tar")
    assert out.read_bytes() == again.read_bytes(), "same inputs, same bytes (same digest)"
    with tarfile.open(out) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    index = json.loads(files["index.json"])
    (desc,) = index["manifests"]
    assert desc["annotations"]["io.containerd.image.name"] == "docker.io/kvpilot/pause:v1"
    blob = lambda d: files["blobs/sha256/" + d.split(":")[1]]  # noqa: E731
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    manifest = json.loads(blob(desc["digest"]))
    config = json.loads(blob(manifest["config"]["digest"]))
    assert config["config"]["Entrypoint"] == ["/pause"] and config["config"]["User"] == "65532:65532"
    layer = blob(manifest["layers"][0]["digest"])
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]


def test_coredns_serves_the_kubelets_dns_address_unprivileged():
    docs = {d["kind"]: d for d in build_coredns("docker.io/kvpilot/coredns:v1.15.0", "10.42.254.10")}
    assert docs["Service"]["spec"]["clusterIP"] == "10.42.254.10"
    assert {p["targetPort"] for p in docs["Service"]["spec"]["ports"] if p["port"] == 53} == {DNS_PORT}
    c = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "kubernetes cluster.local" in docs["ConfigMap"]["data"]["Corefile"]


def test_preflight_names_what_is_missing(monkeypatch):
    from localcluster import kubeletnode
    real = shutil.which
    monkeypatch.setattr(kubeletnode.shutil, "which", lambda c: None if c == "runc" else real(c))
    problems = kubeletnode.preflight()
    assert any("`runc`" in p for p in problems)
    assert not any("`iptables`" in p for p in problems)


@pytest.mark.parametrize("module", ["deviceplugin", "pause"])
def test_the_go_parts_pass_their_own_tests(module):
    """The device plugin (registration, ListAndWatch, Allocate, re-registration) and pause
    (exits 0 on SIGTERM, reaps zombies as PID 1) have Go tests; run them here so CI does."""
    if shutil.which("go") is None:
        pytest.skip("Go is not installed")
    r = subprocess.run(["go", "test", "-count=1", "./..."], cwd=E2E / module, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_cgroup_vanishing_during_the_sweep_is_skipped(tmp_path, monkeypatch):
    """The kubelet removes a pod's cgroup as its last task exits, which can be while stop()
    walks the tree: that branch is skipped, the rest still listed."""
    from localcluster import cgroups
    (tmp_path / "kubepods" / "pod-a" / "c1").mkdir(parents=True)
    (tmp_path / "kubepods" / "pod-b").mkdir()
    gone = tmp_path / "kubepods" / "pod-a"
    real = Path.iterdir

    def iterdir(self):
        if self == gone:
            raise FileNotFoundError(self)
        return real(self)
    monkeypatch.setattr(Path, "iterdir", iterdir)
    found = sorted(str(p.relative_to(tmp_path)) for p in cgroups._subdirs(tmp_path))
    assert found == ["kubepods", "kubepods/pod-a", "kubepods/pod-b"]


def test_prefetch_downloads_the_modules_of_programs_not_built_yet(tmp_path, monkeypatch):
    """A cold start downloads the later Go programs' modules while Kubernetes compiles; a
    program already built is skipped, and a missing `go` stops the prefetch quietly."""
    from localcluster import build
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path))
    built = tmp_path / "pause" / build.version_of("pause") / "bin"
    built.mkdir(parents=True)
    (built / ".complete").touch()
    calls = []
    monkeypatch.setattr(build.subprocess, "run", lambda argv, cwd, **kw: calls.append((argv, Path(cwd).name)))
    build.prefetch_modules(("pause", "cni", "coredns"))
    assert calls == [(["go", "mod", "download"], "cni"), (["go", "mod", "download"], "coredns")]

    def no_go(argv, **kw):
        calls.append(argv)
        raise FileNotFoundError("go")
    calls.clear()
    monkeypatch.setattr(build.subprocess, "run", no_go)
    build.prefetch_modules(("cni", "coredns"))
    assert calls == [["go", "mod", "download"]]


def test_a_failed_image_build_is_a_build_error_with_the_free_disk(tmp_path, monkeypatch):
    """conftest turns a BuildError into one line that ends the session (no INTERNALERROR
    traceback); the message names the images and the free disk, the usual cause."""
    from localcluster import build
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build.subprocess, "run",
                        lambda argv, **kw: subprocess.CompletedProcess(argv, 1, stdout="", stderr=None))
    with pytest.raises(build.BuildError, match=r"images operator, engine failed .* GiB free now under"):
        build.ensure_images(("operator", "engine"))
