"""A container's environment as the kubelet builds it: env entries in order
(each may use $(VAR) of earlier ones), valueFrom field/resource/ConfigMap/Secret
references, envFrom; then command and args are expanded with the result."""
from __future__ import annotations

import base64
from typing import Any, Callable

from .expand import expand
from .quantity import divide_ceil

# (kind, namespace, name) -> object dict or None; kind is "configmaps" or "secrets".
Lookup = Callable[[str, str, str], "dict | None"]


class EnvError(Exception):
    """A required reference could not be resolved (the kubelet's
    CreateContainerConfigError)."""


def _field(pod: dict, path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    for prefix, src in (("metadata.labels['", meta.get("labels") or {}),
                        ("metadata.annotations['", meta.get("annotations") or {})):
        if path.startswith(prefix):
            return src.get(path[len(prefix):-2], "")
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": status.get("hostIP"), "status.podIP": status.get("podIP"),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs") or []),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs") or []),
    }
    if path not in simple:
        raise EnvError(f"unsupported fieldRef {path}")
    return simple[path] or ""


def _resource(container: dict, ref: dict) -> str:
    resource = ref["resource"]
    kind, _, name = resource.partition(".")
    res = container.get("resources") or {}
    value = (res.get(kind) or {}).get(name)
    if value is None and kind == "requests":
        value = (res.get("limits") or {}).get(name)
    if value is None:
        value = "0" if kind == "requests" else {"cpu": "64", "memory": "64Gi"}.get(name, "0")
    return divide_ceil(value, ref.get("divisor"))


def _key_ref(kind: str, ns: str, ref: dict, lookup: Lookup) -> str | None:
    obj = lookup(kind, ns, ref["name"])
    optional = ref.get("optional", False)
    if obj is None:
        if optional:
            return None
        raise EnvError(f"{kind[:-1]} {ns}/{ref['name']} not found")
    value = _data(kind, obj).get(ref["key"])
    if value is None:
        if optional:
            return None
        raise EnvError(f"key {ref['key']} not in {kind[:-1]} {ns}/{ref['name']}")
    return value.decode(errors="replace")


def _data(kind: str, obj: dict) -> dict[str, bytes]:
    """The key -> bytes content of a ConfigMap or Secret."""
    out: dict[str, bytes] = {}
    if kind == "secrets":
        for k, v in (obj.get("data") or {}).items():
            out[k] = base64.b64decode(v)
        for k, v in (obj.get("stringData") or {}).items():
            out[k] = v.encode()
    else:
        for k, v in (obj.get("binaryData") or {}).items():
            out[k] = base64.b64decode(v)
        for k, v in (obj.get("data") or {}).items():
            out[k] = v.encode()
    return out


def container_env(pod: dict, container: dict, lookup: Lookup,
                  base: dict[str, str] | None = None) -> dict[str, str]:
    """The variables the pod spec defines (envFrom first, then env)."""
    ns = pod["metadata"]["namespace"]
    env: dict[str, str] = dict(base or {})
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        for kind, key in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
            if key not in src:
                continue
            ref = src[key]
            obj = lookup(kind, ns, ref["name"])
            if obj is None:
                if ref.get("optional"):
                    continue
                raise EnvError(f"{kind[:-1]} {ns}/{ref['name']} not found")
            for k, v in _data(kind, obj).items():
                env[prefix + k] = v.decode(errors="replace")
    for e in container.get("env") or []:
        name = e["name"]
        if "valueFrom" not in e:
            env[name] = expand(e.get("value", ""), env)
            continue
        vf: dict[str, Any] = e["valueFrom"]
        if "fieldRef" in vf:
            env[name] = _field(pod, vf["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in vf:
            env[name] = _resource(container, vf["resourceFieldRef"])
        elif "configMapKeyRef" in vf:
            v = _key_ref("configmaps", ns, vf["configMapKeyRef"], lookup)
            if v is not None:
                env[name] = v
        elif "secretKeyRef" in vf:
            v = _key_ref("secrets", ns, vf["secretKeyRef"], lookup)
            if v is not None:
                env[name] = v
    return env


def container_argv(container: dict, env: dict[str, str]) -> list[str]:
    """command + args with $(VAR) expanded; with no command there is no image
    entrypoint to fall back on, so args alone are the command."""
    argv = [expand(a, env) for a in (container.get("command") or [])]
    argv += [expand(a, env) for a in (container.get("args") or [])]
    if not argv:
        raise EnvError(f"container {container['name']}: no command (images are not run)")
    return argv
