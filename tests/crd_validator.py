"""The API server's validation of an LLMDeployment, done here: the generated CRD's
openAPIV3Schema (defaults applied, then JSON-schema checks) and its CEL rules
(x-kubernetes-validations, evaluated with the `cel` package). What the tests compare
pydantic's answers against, without a cluster."""
from __future__ import annotations

import copy

import cel
import jsonschema

from kvpilot.operator.api.crd import build_crd


def crd_schema() -> dict:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict, value):
    """The API server's defaulting: absent properties get their default, recursively."""
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties") or {}
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
        for name, sub in props.items():
            if name in value:
                value[name] = apply_defaults(sub, value[name])
        addl = schema.get("additionalProperties")
        if isinstance(addl, dict):
            for name in value:
                if name not in props:
                    value[name] = apply_defaults(addl, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(schema["items"], v) for v in value]
    return value


def cel_errors(schema: dict, value, path: str = "") -> list[str]:
    """The message of every CEL rule that does not hold, walking the value with its schema."""
    errors = []
    for r in schema.get("x-kubernetes-validations") or []:
        try:
            ok = cel.evaluate(r["rule"], {"self": value})
        except Exception as e:  # a runtime error fails the rule, as in the API server
            ok, r = False, {**r, "message": f"{r['message']} ({type(e).__name__}: {e})"}
        if ok is not True:
            errors.append(f"{path or '.'}: {r['message']}")
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                errors += cel_errors(sub, value[name], f"{path}.{name}")
        addl = schema.get("additionalProperties")
        if isinstance(addl, dict):
            for name, v in value.items():
                errors += cel_errors(addl, v, f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            errors += cel_errors(schema["items"], v, f"{path}[{i}]")
    return errors


def api_server_errors(spec: dict) -> list[str]:
    """What the API server would refuse `spec` for (empty: admitted)."""
    schema = crd_schema()["properties"]["spec"]
    value = apply_defaults(schema, copy.deepcopy(spec))
    errors = [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
              for e in jsonschema.Draft4Validator(schema).iter_errors(value)]
    return errors or cel_errors(schema, value)
