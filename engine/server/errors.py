"""The OpenAI error envelope, and handlers so every failure a client can cause is a 4xx
in that envelope: never a 422, never a traceback."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvpilot.server")

# status -> (type, code): the values the OpenAI API uses for the same failures.
_KINDS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", None),
    429: ("rate_limit_error", "queue_full"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "unavailable"),
}


class APIError(Exception):
    """Raise from a route; rendered as `{"error": {...}}` with its status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        default_type, default_code = _KINDS.get(status, ("invalid_request_error", None))
        self.status = status
        self.message = message
        self.param = param
        self.code = code or default_code
        self.type = type or default_type


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict:
    err = APIError(status, message, param=param, code=code, type=type)
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}},
        status_code=err.status, headers=headers,
    )


def _describe_validation(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    """One readable sentence naming the first bad field, and that field as `param`."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "the request body is not valid JSON", None
    if not loc and kind in ("model_attributes_type", "dict_type", "missing"):
        return "the request body must be a JSON object", None
    param = loc[0] if loc else None
    same_field = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == loc[:1]]
    if len(same_field) > 1 and param is not None:
        # A union (e.g. prompt: str | list[int]) reports one error per member type.
        return f"{param}: invalid type or value ({first.get('msg', 'invalid value')})", param
    path = ".".join(loc) if loc else "body"
    message = f"{path}: {first.get('msg', 'invalid value')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, param


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The JSON body as `model`, whatever the Content-Type says; 400 in the envelope otherwise."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = _describe_validation(exc)
        raise APIError(400, message, param=param) from None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
        return error_response(APIError(status, message), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error"))
