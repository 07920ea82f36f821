"""A pod's volumes as folders under the pod's directory: configMap, secret,
downwardAPI and projected volumes (kept in sync on every `sync` call),
emptyDir folders, and hostPath volumes used in place. Images have no
filesystem here, so that is all a container sees of its volumes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from .atomic import write_atomic
from .env import Lookup, _data, _field

# (namespace, serviceaccount, audience, expirationSeconds) -> token
TokenSource = Callable[[str, str, str | None, int], str]


class VolumeError(Exception):
    pass


def _items(kind: str, ns: str, src: dict, lookup: Lookup) -> dict[str, bytes]:
    obj = lookup(kind, ns, src.get("name") or src.get("secretName", ""))
    if obj is None:
        if src.get("optional"):
            return {}
        raise VolumeError(f"{kind[:-1]} {ns}/{src.get('name') or src.get('secretName')} not found")
    data = _data(kind, obj)
    if not src.get("items"):
        return data
    out = {}
    for it in src["items"]:
        if it["key"] not in data:
            if src.get("optional"):
                continue
            raise VolumeError(f"key {it['key']} missing in {kind[:-1]} {ns}/{obj['metadata']['name']}")
        out[it["path"]] = data[it["key"]]
    return out


def _downward(pod: dict, items: list[dict]) -> dict[str, bytes]:
    out = {}
    for it in items:
        if "fieldRef" in it:
            path = it["fieldRef"]["fieldPath"]
            meta = pod["metadata"]
            if path in ("metadata.labels", "metadata.annotations"):
                d = meta.get(path.split(".")[1]) or {}
                out[it["path"]] = "\n".join(f'{k}="{v}"' for k, v in sorted(d.items())).encode()
            else:
                out[it["path"]] = _field(pod, path).encode()
    return out


class Volumes:
    """The volumes of one pod, rooted at `root` (one folder per volume)."""

    def __init__(self, pod: dict, root: Path, lookup: Lookup, tokens: TokenSource):
        self.pod, self.root, self.lookup, self.tokens = pod, root, lookup, tokens
        self.ns = pod["metadata"]["namespace"]
        self.paths: dict[str, Path] = {}
        for v in pod["spec"].get("volumes") or []:
            if "hostPath" in v:
                p = Path(v["hostPath"]["path"])
                if v["hostPath"].get("type") in ("DirectoryOrCreate",):
                    p.mkdir(parents=True, exist_ok=True)
                self.paths[v["name"]] = p
            else:
                self.paths[v["name"]] = root / v["name"]

    def references(self) -> set[tuple[str, str]]:
        """The (kind, name) objects whose changes must be synced in."""
        refs: set[tuple[str, str]] = set()
        for v in self.pod["spec"].get("volumes") or []:
            if "configMap" in v:
                refs.add(("configmaps", v["configMap"]["name"]))
            if "secret" in v:
                refs.add(("secrets", v["secret"]["secretName"]))
            for s in (v.get("projected") or {}).get("sources") or []:
                if "configMap" in s:
                    refs.add(("configmaps", s["configMap"]["name"]))
                if "secret" in s:
                    refs.add(("secrets", s["secret"]["name"]))
        return refs

    def sync(self) -> bool:
        """Writes every volume's current content; returns whether any changed."""
        changed = False
        sa = self.pod["spec"].get("serviceAccountName", "default")
        for v in self.pod["spec"].get("volumes") or []:
            path = self.paths[v["name"]]
            if "emptyDir" in v:
                path.mkdir(parents=True, exist_ok=True)
            elif "configMap" in v:
                changed |= write_atomic(path, _items("configmaps", self.ns, v["configMap"], self.lookup))
            elif "secret" in v:
                changed |= write_atomic(path, _items("secrets", self.ns, v["secret"], self.lookup), 0o600)
            elif "downwardAPI" in v:
                changed |= write_atomic(path, _downward(self.pod, v["downwardAPI"].get("items") or []))
            elif "projected" in v:
                files: dict[str, bytes] = {}
                for s in v["projected"].get("sources") or []:
                    if "configMap" in s:
                        files.update(_items("configmaps", self.ns, s["configMap"], self.lookup))
                    elif "secret" in s:
                        files.update(_items("secrets", self.ns, s["secret"], self.lookup))
                    elif "downwardAPI" in s:
                        files.update(_downward(self.pod, s["downwardAPI"].get("items") or []))
                    elif "serviceAccountToken" in s:
                        t = s["serviceAccountToken"]
                        tok_file = path / t["path"]
                        if not tok_file.exists():  # issued once per pod start
                            files[t["path"]] = self.tokens(self.ns, sa, t.get("audience"),
                                                           t.get("expirationSeconds", 3600)).encode()
                        else:
                            files[t["path"]] = tok_file.read_bytes()
                changed |= write_atomic(path, files)
            elif "hostPath" in v:
                pass
            elif "persistentVolumeClaim" in v or "ephemeral" in v:
                path.mkdir(parents=True, exist_ok=True)  # a plain folder stands in
            else:
                raise VolumeError(f"volume {v['name']}: type not supported by the process node "
                                  f"({json.dumps(sorted(k for k in v if k != 'name'))})")
        return changed

    def mount_source(self, mount: dict) -> Path:
        """The host path behind a volumeMount (subPath included)."""
        src = self.paths[mount["name"]]
        sub = mount.get("subPath")
        if sub:
            src = src / sub
            if not src.exists() and not (src.parent / "..data").exists():
                src.mkdir(parents=True, exist_ok=True)
        return src
