"""Single-binary container images (the Pod sandbox's pause, CoreDNS, the
device plugin) written straight to an OCI image archive: one uncompressed
layer holding one static executable, a config and a manifest. No builder is
needed for these, and the same inputs give the same bytes (so the same
digest), which keeps containerd from storing a new copy on every start.

`ctr images import` names an image from the index's
`io.containerd.image.name` annotation."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass(frozen=True)
class BinaryImage:
    ref: str              # docker.io/kvpilot/pause:3.10
    binary: Path          # the static executable
    path_in_image: str    # /pause
    user: str = "65532:65532"
    args: tuple[str, ...] = ()

    def entrypoint(self) -> list[str]:
        return [self.path_in_image, *self.args]


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _layer(image: BinaryImage) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        data = image.binary.read_bytes()
        parts = image.path_in_image.strip("/").split("/")
        for i in range(1, len(parts)):  # /bin of /bin/prometheus
            folder = tarfile.TarInfo("/".join(parts[:i]))
            folder.type, folder.mode, folder.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(folder)
        info = tarfile.TarInfo(image.path_in_image.lstrip("/"))
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        tar.addfile(info, io.BytesIO(data))
        # An empty /tmp is what most programs expect; the pod mounts over it if it wants.
        tmp = tarfile.TarInfo("tmp")
        tmp.type, tmp.mode, tmp.mtime = tarfile.DIRTYPE, 0o1777, 0
        tar.addfile(tmp)
    return buf.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = _digest(data)
    info = tarfile.TarInfo("blobs/sha256/" + digest.split(":", 1)[1])
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))
    return digest


def write_archive(image: BinaryImage, out: Path) -> Path:
    """Writes `image` as an OCI image archive (a tar of an OCI image layout) at `out`."""
    layer = _layer(image)
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": image.entrypoint(), "User": image.user, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
    }, sort_keys=True).encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        layer_digest, config_digest = _blob(tar, layer), _blob(tar, config)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config)},
            "layers": [{"mediaType": OCI_LAYER, "digest": layer_digest, "size": len(layer)}],
        }, sort_keys=True).encode()
        manifest_digest = _blob(tar, manifest)
        index = json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": OCI_MANIFEST, "digest": manifest_digest, "size": len(manifest),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": image.ref,
                            "org.opencontainers.image.ref.name": image.ref.rsplit(":", 1)[-1]}}]},
            sort_keys=True).encode()
        for name, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(out)
    return out


def ensure_archives(images: list[tuple[BinaryImage, Path]]) -> list[tuple[str, Path]]:
    """(name, archive) of each image, its archive written again only when its binary changed."""
    done = []
    for image, path in images:
        stamp = path.with_suffix(".source")
        source = f"{image.binary}:{image.binary.stat().st_mtime_ns}:{image.binary.stat().st_size}"
        if not path.exists() or not stamp.exists() or stamp.read_text() != source:
            write_archive(image, path)
            stamp.write_text(source)
        done.append((image.ref, path))
    return done
