"""JSON schemas kubeconform reads, written locally (no download): from the Kubernetes
OpenAPI spec inside the k8s.io/kubernetes module source the e2e build caches, converted as
openapi2jsonschema --strict does (every object with properties closed with
additionalProperties: false; int-or-string and quantities as either type), and from
kvpilot's own CRD. One file per kind, named as kubeconform's -schema-location template
`{{ .ResourceKind }}{{ .KindSuffix }}.json` expects (deployment-apps-v1.json)."""
from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

from kvpilot.operator.api.crd import build_crd

ROOT = Path(__file__).resolve().parents[1]
INT_OR_STRING = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
QUANTITY = {"oneOf": [{"type": "string"}, {"type": "number"}]}


def swagger_path() -> Path | None:
    """The cached module's api/openapi-spec/swagger.json for e2e/k8s/VERSION, if there."""
    version = (ROOT / "e2e" / "k8s" / "VERSION").read_text().strip()
    try:
        cache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(cache) / "k8s.io" / f"kubernetes@{version}" / "api" / "openapi-spec" / "swagger.json"
    return path if path.is_file() else None


def strict(node):
    """openapi2jsonschema --strict: closed objects; the special string types opened up."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("format") == "int-or-string":
        return {**INT_OR_STRING, "description": node.get("description", "")}
    out = {k: strict(v) for k, v in node.items()}
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def kind_file(group: str, version: str, kind: str) -> str:
    suffix = f"-{group.split('.')[0]}-{version}" if group else f"-{version}"
    return f"{kind.lower()}{suffix}.json"


def write_k8s_schemas(swagger: Path, out: Path, kinds: set[str]) -> None:
    defs = json.loads(swagger.read_text())["definitions"]
    defs["io.k8s.apimachinery.pkg.api.resource.Quantity"] = QUANTITY
    defs = {name: strict(d) for name, d in defs.items()}
    for name, d in defs.items():
        for gvk in d.get("x-kubernetes-group-version-kind", []):
            if gvk["kind"] not in kinds:
                continue
            schema = {"$schema": "http://json-schema.org/draft-04/schema#", "definitions": defs,
                      "allOf": [{"$ref": f"#/definitions/{name}"}]}
            (out / kind_file(gvk["group"], gvk["version"], gvk["kind"])).write_text(json.dumps(schema))


def crd_to_jsonschema(node):
    """A CRD's structural schema as JSON schema, closed where it is not preserve-unknown."""
    if isinstance(node, list):
        return [crd_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: crd_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if "exclusiveMinimum" in out and out["exclusiveMinimum"] is True:  # draft-04 form, kept
        pass
    return out


def write_crd_schema(out: Path) -> None:
    crd = build_crd()
    (version,) = crd["spec"]["versions"]
    schema = crd_to_jsonschema(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    schema["$schema"] = "http://json-schema.org/draft-04/schema#"
    (out / kind_file(crd["spec"]["group"], version["name"], crd["spec"]["names"]["kind"])).write_text(
        json.dumps(schema))
