"""kvpilot's two images run as the operator runs them: uid 65532, read-only root filesystem,
no capabilities, writable only at /tmp (a tmpfs) and /var/cache/kvpilot. kvpilot/operator
(the operator, the gateway, simulated engine pods) holds no torch and stays under 300 MB;
kvpilot/engine runs the real engine (and simulated pods too), without the operator's code.

The images are built by e2e/image/build.sh (what `make image` runs; minutes the first time,
instant when nothing changed), unpacked from their OCI archives with umoci, and run with runc
directly, with a config.json written here so each setting is deliberate. The container
shares the host's network namespace (the test then reaches the engine at 127.0.0.1 with no
network plugin); everything else is isolated.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tarfile
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from localcluster.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "e2e" / "image" / "build.sh"
UID = 65532  # the operator's runAsUser / runAsGroup
CACHE = "/var/cache/kvpilot"
PYTHON = "/opt/kvpilot/bin/python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3600),  # the first build (in the first test's set-up) takes minutes
    pytest.mark.skipif(os.geteuid() != 0, reason="building (buildah, mmdebstrap) and running "
                       "(runc) the image need root on this machine"),
]
ENGINE_IMAGE = "engine" in os.environ.get("KVPILOT_TEST_IMAGES", "operator")


def _version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@dataclass
class Container:
    """Runs commands from one unpacked image with runc, hardened as the operator's pods are.
    `image_config` is what umoci derived from the image (entrypoint, env, user, cwd)."""

    target: str  # operator | engine
    rootfs: Path
    image_config: dict
    work: Path  # per-run bundles, runc's state, the cache volume
    runs: list[str] = field(default_factory=list)

    @property
    def cache_volume(self) -> Path:
        return self.work / "cache-volume"

    def config(self, args: list[str]) -> dict:
        """The image's own process settings (env, cwd) with the pod's security context."""
        cfg = json.loads(json.dumps(self.image_config))
        cfg["root"] = {"path": str(self.rootfs), "readonly": True}
        proc = cfg["process"]
        proc.update(args=args, terminal=False, noNewPrivileges=True,
                    user={"uid": UID, "gid": UID, "additionalGids": [UID]})
        proc["capabilities"] = {k: [] for k in ("bounding", "effective", "inheritable",
                                                "permitted", "ambient")}
        # What the kubelet would mount: an emptyDir for the cache, a tmpfs for /tmp.
        cfg["mounts"] = [m for m in cfg["mounts"] if m["destination"] not in ("/tmp", CACHE)] + [
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777", "size=256m"]},
            {"destination": CACHE, "type": "bind", "source": str(self.cache_volume),
             "options": ["rbind", "rw", "nosuid", "nodev"]},
        ]
        linux = cfg["linux"]
        linux["namespaces"] = [n for n in linux["namespaces"] if n["type"] != "network"]
        linux.pop("uidMappings", None)
        linux.pop("gidMappings", None)
        return cfg

    def _bundle(self, args: list[str]) -> tuple[str, Path]:
        name = f"kvpilot-image-test-{uuid.uuid4().hex[:8]}"
        bundle = self.work / "bundles" / name
        bundle.mkdir(parents=True)
        (bundle / "config.json").write_text(json.dumps(self.config(args), indent=1))
        self.runs.append(name)
        return name, bundle

    def _runc(self, *args: str) -> list[str]:
        return ["runc", "--root", str(self.work / "runc-state"), *args]

    def run(self, *args: str, entrypoint: list[str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        """The image's entrypoint (or `entrypoint`) with `args`, to completion."""
        name, bundle = self._bundle([*(entrypoint or self.entrypoint), *args])
        try:
            return subprocess.run(self._runc("run", "--bundle", str(bundle), name),
                                  capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        finally:
            subprocess.run(self._runc("delete", "--force", name), capture_output=True)

    @contextmanager
    def serving(self, *args: str) -> Iterator[subprocess.Popen]:
        """The entrypoint with `args` in the background; stopped with SIGTERM (as the kubelet
        does), then SIGKILL."""
        name, bundle = self._bundle([*self.entrypoint, *args])
        log = open(bundle / "output.log", "w+")
        proc = subprocess.Popen(self._runc("run", "--bundle", str(bundle), name),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        except BaseException:
            log.seek(0)
            print(f"--- container output ({name}) ---\n{log.read()[-8000:]}")
            raise
        finally:
            subprocess.run(self._runc("kill", name, "TERM"), capture_output=True)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                subprocess.run(self._runc("kill", name, "KILL"), capture_output=True)
                proc.wait(timeout=30)
            subprocess.run(self._runc("delete", "--force", name), capture_output=True)
            log.close()

    @property
    def entrypoint(self) -> list[str]:
        return self.image_config["process"]["args"][:1]


# The engine image's variants unpack 6 GB (about two minutes on 2 cores) to show what the
# cluster tests show too: test_operator runs it as the operator does, uid 65532 on a read-only
# root, serving builtin:tiny. `make test` runs the operator image's here; the engine's with
# KVPILOT_TEST_IMAGES=operator,engine pytest e2e/test_image.py (its docs: docs/image.md).
TARGETS = tuple(t for t in os.environ.get("KVPILOT_TEST_IMAGES", "operator").split(",") if t)
MAX_OPERATOR_IMAGE_MB = 300


@pytest.fixture(scope="session")
def image_archives(request) -> dict[str, Path]:
    """The OCI archives of the current tree (built or reused by build.sh); its progress is
    shown live since the first build takes minutes."""
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        print(f"\n{BUILD.relative_to(ROOT)}: building or reusing the images", flush=True)
        out = subprocess.run([str(BUILD), *TARGETS], stdout=subprocess.PIPE, text=True, check=True)
    return dict(zip(TARGETS, (Path(line) for line in out.stdout.strip().splitlines()[-len(TARGETS):])))


@pytest.fixture(scope="session", params=TARGETS)
def container(request, image_archives: dict[str, Path], tmp_path_factory) -> Iterator[Container]:
    """Unpacks one image's archive (the OCI layout, then umoci's runtime bundle) once per session."""
    target = request.param
    work = tmp_path_factory.mktemp(f"image-{target}")
    layout = work / "layout"
    with tarfile.open(image_archives[target]) as tar:
        tar.extractall(layout, filter="fully_trusted")
    index = json.loads((layout / "index.json").read_text())
    ref = index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"]
    assert ref == f"docker.io/kvpilot/{target}:{_version()}", "the name containerd will import"
    # umoci names images by tag within a layout; a full reference is not a valid tag for it.
    (layout / "index.json").write_text(json.dumps({**index, "manifests": [
        {**index["manifests"][0], "annotations": {"org.opencontainers.image.ref.name": "test"}}]}))
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:test", str(work / "bundle")],
                   check=True, capture_output=True)
    shutil.rmtree(layout)  # the rootfs holds the same bytes again: free them at once
    image_config = json.loads((work / "bundle" / "config.json").read_text())
    c = Container(target=target, rootfs=work / "bundle" / "rootfs", image_config=image_config, work=work)
    c.cache_volume.mkdir()
    os.chown(c.cache_volume, UID, UID)  # fsGroup gives the pod's user the emptyDir
    yield c
    shutil.rmtree(work, ignore_errors=True)  # GBs: not left for pytest's last-three-runs


def test_the_image_runs_as_65532_from_its_own_settings(container: Container):
    proc = container.image_config["process"]
    assert proc["user"]["uid"] == UID and proc["user"]["gid"] == UID  # USER in the image
    assert proc["args"][0] == "/opt/kvpilot/bin/kvpilot"
    env = dict(e.split("=", 1) for e in proc["env"])
    assert env["KVPILOT_CACHE_DIR"] == CACHE and env["HOME"] == CACHE and env["TMPDIR"] == "/tmp"
    out = container.run("-c", "import os; print(os.getuid(), os.getgid())", entrypoint=[PYTHON])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(UID), str(UID)]


def test_help_and_version(container: Container):
    # The engine image holds the engine only: the operator's commands are the operator image's.
    ours = ("serve", "operator", "gateway") if container.target == "operator" else ("serve", "fetch-model")
    for sub in ours:
        out = container.run(sub, "--help")
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"usage: kvpilot {sub}"), out.stdout
    if container.target == "engine":
        out = container.run("operator", "--help")
        assert out.returncode == 2 and "invalid choice: 'operator'" in out.stderr, (out.stdout, out.stderr)
    out = container.run("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"kvpilot {_version()}"


PROBE = """
import json, os, sys
def attempt(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        os.unlink(path)
        return "ok"
    except OSError as e:
        return e.strerror
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"writes": {p: attempt(p) for p in sys.argv[1:]},
                  "caps": {k: int(status[k], 16) for k in ("CapEff", "CapPrm", "CapBnd")},
                  "no_new_privs": int(status["NoNewPrivs"])}))
"""


def test_only_the_volumes_are_writable_and_no_capabilities(container: Container):
    readonly = ["/probe", "/etc/probe", "/opt/kvpilot/probe", "/opt/kvpilot/bin/probe",
                "/usr/lib/probe", "/var/probe"]
    writable = ["/tmp/probe", f"{CACHE}/probe"]
    out = container.run("-c", PROBE, *readonly, *writable, entrypoint=[PYTHON])
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["writes"] == {**{p: "Read-only file system" for p in readonly},
                                **{p: "ok" for p in writable}}
    assert result["caps"] == {"CapEff": 0, "CapPrm": 0, "CapBnd": 0}
    assert result["no_new_privs"] == 1


class ContainerExited(Exception):
    """The engine's container stopped while the test waited for it to serve."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
        return r.status == 200


def _complete(port: int, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


@pytest.mark.parametrize("engine", ["simulated", "tiny-cpu"])
def test_the_engine_serves_from_the_read_only_image(container: Container, engine: str):
    """The simulated H100 (what simulated pods run, from either image) and, from the engine
    image, the real engine on the CPU with the built-in tiny model, which it writes under
    KVPILOT_CACHE_DIR (the only place it can)."""
    if engine == "tiny-cpu" and container.target == "operator":
        pytest.skip("the operator image has no torch: the real engine runs from kvpilot/engine")
    port = _free_port()
    if engine == "simulated":
        model, args = "llama-3.1-8b", ["--simulate", "h100-80gb", "--simulate-model", "llama-3.1-8b",
                                       "--served-model-name", "llama-3.1-8b"]
    else:
        model, args = "tiny", ["--model", "builtin:tiny", "--device", "cpu",
                               "--served-model-name", "tiny", "--cpu-threads", "1"]
    with container.serving("serve", *args, "--host", "127.0.0.1", "--port", str(port)) as proc:
        def healthy() -> bool:
            if proc.poll() is not None:
                raise ContainerExited(f"the container exited with status {proc.returncode}")
            return _health(port)

        wait_for(healthy, timeout=180, interval=0.5, fatal=(ContainerExited,),
                 what=f"/health of the {engine} engine in the container")
        out = _complete(port, model)
        assert out["choices"][0]["text"] is not None
    if engine == "tiny-cpu":
        assert (container.cache_volume / "models" / "builtin-tiny-v1" / "config.json").is_file()


def test_the_operator_image_is_small_and_holds_no_torch(container: Container):
    if container.target != "operator":
        pytest.skip("the engine image carries torch by design")
    # The files' own sizes (what an image's size counts), not the blocks they take on this disk.
    out = subprocess.run(["du", "-s", "--apparent-size", "--block-size=1", str(container.rootfs)],
                         capture_output=True, text=True, check=True)
    size_mb = int(out.stdout.split()[0]) / 1e6
    print(f"kvpilot/operator unpacked: {size_mb:.1f} MB")
    assert size_mb <= MAX_OPERATOR_IMAGE_MB, f"kvpilot/operator is {size_mb:.1f} MB unpacked"
    out = container.run("-c", "import importlib.util as u; print([m for m in ('torch', 'triton') if u.find_spec(m)])",
                        entrypoint=[PYTHON])
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)
