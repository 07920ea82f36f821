"""The OpenAI error envelope, and handlers so every failure a client can cause is a 4xx
in that envelope: never a 422, never a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .json_body import BodyError, decode_json
from .protocol import _Body, unsupported_field

log = logging.getLogger("kvpilot.server")

# status -> (type, code): the values the OpenAI API uses for the same failures.
_KINDS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", None),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "queue_full"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "unavailable"),
}
# Seconds a client should wait before retrying: a full queue turns over within steps; a
# draining server is leaving, and the Service sends the retry to another replica.
RETRY_AFTER_S = {429: 1, 503: 1}


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

    @property
    def headers(self) -> dict[str, str]:
        retry = RETRY_AFTER_S.get(self.status)
        return {"Retry-After": str(retry)} if retry is not None else {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict:
    return APIError(status, message, param=param, code=code, type=type).body()


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers={**err.headers, **(headers or {})})


async def send_error(send, err: APIError, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """The envelope straight on the ASGI channel, for middleware that answers before the app.
    `headers` override the error's own (a Retry-After computed by the caller, say)."""
    body = json.dumps(err.body()).encode()
    given = {k for k, _ in headers}
    await send({"type": "http.response.start", "status": err.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in err.headers.items() if k.lower().encode() not in given),
        *headers]})
    await send({"type": "http.response.body", "body": body})


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


INLINE_BODY_BYTES = 64 * 1024  # larger bodies are decoded and validated on a worker thread


async def parse_body(request: Request, model: type[_Body]) -> BaseModel:
    """The JSON body as `model`, whatever the Content-Type says; 400 in the envelope otherwise
    (the body's size and read time were bounded by BodyGuard before the route ran). Decoding
    and validating a body of megabytes takes a few hundred ms: not on the event loop."""
    raw = await request.body()
    if len(raw) <= INLINE_BODY_BYTES:
        return _parse(raw, model)
    return await asyncio.to_thread(_parse, raw, model)


def _parse(raw: bytes, model: type[_Body]) -> BaseModel:
    try:
        data = decode_json(raw)
    except BodyError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    field = unsupported_field(model, data)
    if field is not None:
        raise APIError(400, f"{field} is not supported by this server", param=field.split(".")[0])
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
