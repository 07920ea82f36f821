"""The OpenAPI schema at /openapi.json: the request models as the server validates them
(types, bounds, enums, required fields) and every error status in the OpenAI envelope.
Routes parse their own bodies (to answer bad JSON in the envelope), so FastAPI cannot
see the models; each route names its model here, and the schema carries it."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
_DESCRIPTIONS = {
    400: "invalid input; `param` names the field", 401: "missing or invalid API key",
    404: "unknown model", 408: "the body did not arrive in time",
    413: "the body is larger than the server's limit", 429: "the waiting queue is full (Retry-After)",
    500: "the request failed inside the engine", 503: "the server is shutting down (Retry-After)",
}
_GENERATION_ERRORS = (400, 401, 404, 408, 413, 429, 500, 503)


def _error(status: int) -> dict:
    return {"description": _DESCRIPTIONS[status],
            "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}}


def no_body_responses(*statuses: int) -> dict:
    return {"responses": {str(s): _error(s) for s in statuses}}


def request_body(model: type[BaseModel]) -> dict:
    """openapi_extra for a POST route whose body is `model`."""
    ok = {"description": "the result (text/event-stream when `stream` is true)",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    return {
        "x-kvpilot-model": model.__name__,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=model.__name__)}}}},
        "responses": {"200": ok, **{str(s): _error(s) for s in _GENERATION_ERRORS}},
    }


def _schemas(models: list[type[BaseModel]]) -> dict:
    out = {"ErrorResponse": ERROR_SCHEMA}
    for model in models:
        schema = model.model_json_schema(ref_template=_REF)
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


def install_openapi(app: FastAPI, api_key: bool) -> None:
    from . import protocol

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            models = []
            for path in schema["paths"].values():
                for op in path.values():
                    name = op.pop("x-kvpilot-model", None)
                    if name is not None:
                        models.append(getattr(protocol, name))
                        op["responses"].pop("422", None)  # bad input is a 400, never a 422
            schema.setdefault("components", {})["schemas"] = _schemas(models)
            if api_key:
                schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                for route, path in schema["paths"].items():
                    if route.startswith(("/v1", "/tokenize", "/detokenize")):
                        for op in path.values():
                            op["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
