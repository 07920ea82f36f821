"""The FastAPI application: routes, auth and request-id middleware, lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_fastapi_instrumentator import Instrumentator

from ..config.validation import token_ids
from .async_engine import AsyncEngine
from .errors import APIError, install_error_handlers, parse_body, send_error
from .body_guard import BodyGuard
from .openapi import install_openapi, no_body_responses, request_body
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .serving_chat import chat_prompt_ids, create_chat_completion
from .serving_common import ServerSettings, ServerState, check_model, now_s
from .serving_completions import create_completion
from .tuning import TuningWatcher

log = logging.getLogger("kvpilot.server")


def kvpilot_version() -> str:
    try:
        return metadata.version("kvpilot")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


# Routes behind the API key: generation, and the tokenizer (anyone could otherwise spend
# the server's CPU on it). /health, /version, /metrics and /openapi.json stay open.
PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


# Methods that keep their name; any other (a client may send kilobytes of letters) is
# seen as OTHER, so the HTTP metrics' `method` label has a fixed set of values.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"})


class MethodMiddleware:
    """Outermost, pure ASGI: a request with both Content-Length and Transfer-Encoding is
    refused (RFC 9112 6.3: two framings may be request smuggling) and its connection
    closed, before the API key is looked at, so nothing after it on that connection is
    read as another request; an unknown method becomes OTHER (answered 405 or 404 as
    before, counted under one label value); HEAD is served as GET, whose body the HTTP
    server drops (it reads the method from its own scope), so every GET route answers
    HEAD, /health included."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            names = {name for name, _ in scope.get("headers") or ()}
            if b"content-length" in names and b"transfer-encoding" in names:
                await send_error(send, APIError(400, "the request has both Content-Length and "
                                                     "Transfer-Encoding"), [(b"connection", b"close")])
                return
            method = scope["method"]
            if method == "HEAD":
                scope = {**scope, "method": "GET"}
            elif method not in HTTP_METHODS:
                scope = {**scope, "method": "OTHER"}
        await self.app(scope, receive, send)


class EdgeMiddleware:
    """Pure ASGI (streams and disconnect detection pass through untouched): checks the API
    key on PROTECTED_PREFIXES before anything else (the body is not read for a bad key),
    and echoes a client's X-Request-Id header."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        request_id = headers.get(b"x-request-id")
        if self.api_key is not None and scope["path"].startswith(PROTECTED_PREFIXES):
            auth = headers.get(b"authorization", b"")
            token = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.api_key):
                extra = [(b"x-request-id", request_id)] if request_id else []
                await send_error(send, APIError(401, "missing or invalid API key (send "
                                                     "Authorization: Bearer <key>)"),
                                 [(b"www-authenticate", b"Bearer"), *extra])
                return
        if request_id is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_app(engine: AsyncEngine, settings: ServerSettings, tuning_file: str | None = None) -> FastAPI:
    state = ServerState(settings=settings, engine=engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        watcher_task = None
        if tuning_file:
            watcher = TuningWatcher(
                tuning_file, apply=engine.update_limits,
                current=engine.live_settings,
            )
            await watcher.check()  # values the operator already wrote apply before serving
            watcher_task = asyncio.create_task(watcher.run())
        try:
            yield
        finally:
            if watcher_task is not None:
                watcher_task.cancel()
            await engine.stop()

    app = FastAPI(title="kvpilot", version=kvpilot_version(), lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.kvpilot = state
    install_error_handlers(app)
    app.add_middleware(BodyGuard, limits=settings.limits)
    app.add_middleware(EdgeMiddleware, api_key=settings.api_key)
    # vLLM's HTTP metrics (http_requests_total, http_request_duration_seconds, ...), from the
    # same library and with the same exclusions as vLLM's server; outermost, so refusals count.
    # Its labels are bounded: paths without a route are grouped as "none", status codes by
    # class, and MethodMiddleware (added after, so outside it) names unknown methods OTHER.
    Instrumentator(excluded_handlers=["/metrics", "/health", "/load", "/ping", "/version", "/server_info"],
                   registry=engine.metrics.registry, should_group_untemplated=True,
                   should_group_status_codes=True).instrument(app)
    app.add_middleware(MethodMiddleware)
    install_openapi(app, api_key=settings.api_key is not None)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        return await create_completion(body, request, state)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        return await create_chat_completion(body, request, state)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": settings.served_model_name, "object": "model", "created": now_s(),
            "owned_by": "kvpilot", "root": settings.model_path, "parent": None,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.tokenizer.vocab_size,  # kvpilot extension (bench serve)
        }]}

    @app.get("/health", openapi_extra=no_body_responses(503))
    async def health():
        failure = engine.failure
        if failure is not None:
            raise APIError(503, f"engine failed: {failure}")
        if state.draining:
            raise APIError(503, "draining: the server is shutting down")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": kvpilot_version()}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(request: Request):
        body = await parse_body(request, TokenizeRequest)
        check_model(body.model, settings)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            ids = await chat_prompt_ids(state, body.messages, body.add_generation_prompt)
        else:
            ids = await state.prompts.encode(body.prompt, engine.max_model_len,
                                             add_special_tokens=body.add_special_tokens)
        # JSONResponse: FastAPI's encoder walks a returned dict in Python, on the event loop
        # (0.4 s for 175k token ids); json.dumps takes milliseconds.
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request):
        body = await parse_body(request, DetokenizeRequest)
        check_model(body.model, settings)
        tok = engine.tokenizer
        if body.tokens:  # decoding nothing is the empty string
            try:
                token_ids("tokens", body.tokens, tok.vocab_size)
            except ValueError as e:
                raise APIError(400, str(e), param="tokens") from None
        text = await state.prompts.run(len(body.tokens), lambda: tok.decode(body.tokens), "tokens")
        return JSONResponse({"prompt": text})

    return app
