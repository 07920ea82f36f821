"""The gateway's ASGI application: /v1/completions and /v1/chat/completions routed by
`model`, /v1/models, /health and /metrics. Every refusal is the OpenAI error envelope
with the status a client can act on; no traceback reaches a client."""
from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpilot.engine.server.errors import APIError, send_error

from .admission import AdmissionQueue
from .config import GatewaySettings
from .edge import check_framing, check_text, metrics_allowed, read_body
from .forward import (REQUEST_HEADERS, Attempt, SSEUsage, Upstream, UpstreamFailed, Usage, inject_usage_request,
                      open_upstream)
from .metrics import GatewayMetrics
from .prefix import prefix_key
from .ratelimit import TenantLimits, reservation
from .relay import ClientGone, relay, until_gone
from .replicas import Replica
from .table import Backend, RoutingTable
from .tenants import Tenant, Tenants

log = logging.getLogger("kvpilot.gateway")
ROUTES = {"/v1/completions", "/v1/chat/completions"}
WAKE_RETRY_S = 10.0  # at most one scale-from-zero write per deployment this often


class Gateway:
    def __init__(self, settings: GatewaySettings, table: RoutingTable, tenants: Tenants,
                 session: aiohttp.ClientSession, metrics: GatewayMetrics | None = None, clock=time.monotonic,
                 waker=None, engine_key: str | None = None, metrics_key: str | None = None) -> None:
        self.settings = settings
        self.engine_key = engine_key  # the engines' --api-key, sent to replicas; never a tenant's
        self.metrics_key = metrics_key
        self.table = table
        self.tenants = tenants
        self.session = session  # the proxy's client to the replicas (forward.upstream_session)
        self.metrics = metrics or GatewayMetrics()
        self.clock = clock
        self.waker = waker  # KubernetesScaler (wake(namespace, name)); None: nothing scales from zero
        self._woken: dict[tuple[str, str], float] = {}
        self._tasks: set[asyncio.Task] = set()
        self.limits = {t.name: TenantLimits(t.requests_per_window, t.tokens_per_window, tenants.window)
                       for t in tenants.tenants}

    # ---- ASGI ----
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        started = finished = False
        method = "GET" if method == "HEAD" else method  # the server sends a HEAD answer's headers alone

        async def tracked_send(message) -> None:
            nonlocal started, finished
            started = started or message["type"] == "http.response.start"
            finished = finished or (message["type"] == "http.response.body" and not message.get("more_body"))
            await send(message)
        try:
            check_framing(scope)
            if path in ROUTES:
                if method != "POST":
                    raise APIError(405, f"{path} takes POST, not {_shown(method)}")
                await self._proxy(scope, receive, tracked_send, path, lambda: finished)
            elif path == "/v1/models" and method == "GET":
                await self._models(scope, tracked_send)
            elif path == "/health" and method == "GET":
                await _send_bytes(send, 200, b"", "text/plain")
            elif path == "/metrics" and method == "GET":
                metrics_allowed(self.settings.metrics_access, self.tenants.open, self.metrics_key,
                                _header(scope, b"authorization"))
                self._refresh_gauges()
                await _send_bytes(send, 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
            else:
                raise APIError(404, f"no route {_shown(method)} {_shown(path)}")
        except APIError as err:
            if not started:
                extra = [(b"connection", b"close")] if err.status in (400, 408, 413) else []
                await send_error(send, err, extra)
        except ClientGone:
            pass
        except Exception:  # noqa: BLE001 (a bug here fails this request alone, never with a traceback)
            log.exception("gateway: %s %s failed", method, path)
            if not started:
                await send_error(send, APIError(500, "the gateway failed to handle this request"))

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _refresh_gauges(self) -> None:
        self.metrics.replicas.clear()  # a model no longer served loses its series
        for model in self.table.models():
            self.metrics.replicas.labels(model).set(len(self.table.get(model).replicas))

    def _tenant(self, scope) -> Tenant:
        tenant = self.tenants.authenticate(_header(scope, b"authorization"))
        if tenant is None:
            raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer KEY` with a key "
                           "this gateway knows")
        return tenant

    async def _models(self, scope, send) -> None:
        tenant = self._tenant(scope)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvpilot"}
                for m in self.table.models() if tenant.may_use(m)]
        await _send_bytes(send, 200, json.dumps({"object": "list", "data": data}).encode(), "application/json")

    # ---- the proxied request ----
    async def _proxy(self, scope, receive, send, path: str, finished) -> None:
        started = self.clock()
        tenant = self._tenant(scope)
        body = await read_body(receive, self.settings.max_body_bytes, self.settings.body_read_timeout)
        payload = _json_object(body)
        check_text(body, payload)
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise APIError(400, "`model` is required: a string naming a served model", param="model")
        backend = self.table.get(model)
        if backend is None or not tenant.may_use(model):
            shown = model if len(model) <= 200 else model[:200] + "..."
            raise APIError(404, f"The model `{shown}` does not exist or you do not have access to it.",
                           param="model", code="model_not_found")
        code = 500
        try:
            code = await until_gone(receive, self._admit_and_forward(scope, send, path, body, payload, tenant,
                                                                     backend, started), finished)
        except APIError as err:
            code = err.status
            raise
        except ClientGone:
            code = 499  # nginx's "client closed request": the client left before the answer ended
            raise
        finally:
            self.metrics.requests.labels(model, tenant.name, str(code)).inc()
            self.metrics.duration.labels(model).observe(self.clock() - started)

    async def _admit_and_forward(self, scope, send, path, body, payload, tenant, backend: Backend,
                                 started: float) -> int:
        limits = self.limits.get(tenant.name)
        reserved = reservation(payload, limits.tokens.limit) if limits_tokens(limits) else 0
        refused = limits.admit(self.clock(), reserved) if limits else None
        if refused is not None:
            which, retry_after = refused
            self.metrics.rate_limited.labels(tenant.name, which).inc()
            err = APIError(429, f"tenant {tenant.name} is over its {which} limit "
                           f"({getattr(limits, which).limit} per {self.tenants.window:g} s); retry after "
                           f"{retry_after} s", type="rate_limit_error", code="rate_limit_exceeded")
            await send_error(send, err, [(b"retry-after", str(retry_after).encode())])
            return 429
        usage = Usage()
        sse = SSEUsage(usage, False, count=limits_tokens(limits))
        try:
            await self._acquire(backend, tenant)
            try:
                return await self._forward(scope, send, path, body, payload, tenant, backend, started, usage, sse)
            finally:
                backend.queue.release()
        finally:
            self._account(tenant, backend.model, usage, sse, reserved)

    async def _acquire(self, backend: Backend, tenant: Tenant) -> None:
        queue: AdmissionQueue = backend.queue
        waited_from = self.clock()
        held = not backend.replicas and backend.deployment is not None
        if held and backend.scaled_to_zero:
            self._wake(backend)
        gauge = self.metrics.queue_waiting.labels(backend.model)
        held_gauge = self.metrics.held.labels(backend.namespace, backend.deployment) if held else None
        gauge.inc()
        if held_gauge:
            held_gauge.inc()
        try:
            timeout = self.settings.scale_from_zero_timeout if held else self.settings.queue_timeout
            granted = await queue.acquire(tenant.priority, timeout)
        finally:
            gauge.dec()
            if held_gauge:
                held_gauge.dec()
        self.metrics.queue_wait.labels(backend.model).observe(self.clock() - waited_from)
        if not granted:
            reason = (f"model `{backend.model}` has no ready replica" if not backend.replicas else
                      f"every replica of `{backend.model}` is busy")
            raise APIError(503, f"{reason}; waited {timeout:g} s in the gateway's queue")

    def refreshed(self) -> None:
        """After each table refresh: a deployment put back to zero while requests wait for
        it (the autotuner's idle rule reading the last pod's metrics before the woken pod
        reports) is woken again, at most once per WAKE_RETRY_S, so no held request is
        left to time out."""
        for model in self.table.models():
            backend = self.table.get(model)
            if backend.scaled_to_zero and not backend.replicas and backend.queue.waiting:
                self._wake(backend)

    def _wake(self, backend: Backend) -> None:
        """Scale a deployment at zero to one replica (in the background; the request waits
        in the queue meanwhile). A failed write is retried by the next held request."""
        key = (backend.namespace, backend.deployment)
        now = self.clock()
        if self.waker is None or now - self._woken.get(key, -WAKE_RETRY_S) < WAKE_RETRY_S:
            return

        async def wake() -> None:
            try:
                await self.waker.wake(*key)
                self.metrics.wakes.labels(*key).inc()
                log.warning("scale from zero: %s/%s set to 1 replica for a held request", *key)
            except Exception as e:  # noqa: BLE001 (the API may be away; the next request retries)
                self._woken.pop(key, None)
                log.warning("scale from zero: scaling %s/%s to 1 failed: %s", *key, e)
        self._woken[key] = now
        task = asyncio.create_task(wake())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward(self, scope, send, path, body, payload, tenant, backend: Backend, started: float,
                       usage: Usage, sse: SSEUsage) -> int:
        now = self.clock()
        route = backend.picker.pick(list(backend.replicas.values()), prefix_key(payload, self.settings.prefix_chars))
        if route is None:
            raise APIError(503, f"model `{backend.model}` has no ready replica")
        self.metrics.routing.labels(backend.model, route.reason).inc()
        # Ejected replicas go last: tried only when every other one failed this request.
        order = tuple(sorted(route.order, key=lambda r: r.ejected(now)))
        stream = payload.get("stream") is True
        if stream and limits_tokens(self.limits.get(tenant.name)):
            sse.strip = inject_usage_request(payload)
            if sse.strip:
                body = json.dumps(payload).encode()
        headers = {k: v for k in REQUEST_HEADERS if (v := _header(scope, k.encode())) is not None}
        if self.engine_key:
            headers["authorization"] = f"Bearer {self.engine_key}"
        attempt = Attempt()
        timeout = self.settings.first_byte_timeout if stream else self.settings.response_timeout
        try:
            upstream = await open_upstream(Upstream(self.session, self.settings.retries + 1, timeout,
                                                    lambda r, cause: self._eject(backend, r, cause)),
                                           order, path, body, headers, attempt)
        except UpstreamFailed as e:
            code = "upstream_timeout" if e.status == 504 else "upstream_unavailable"
            raise APIError(e.status, f"model `{backend.model}`: {e}", type="server_error", code=code) from None
        finally:
            for cause in attempt.retries:
                self.metrics.retries.labels(backend.model, cause).inc()
        replica = attempt.replica
        try:
            code, failure = await relay(upstream, send, stream, sse, usage, replica.name,
                                        self.settings.stream_idle_timeout)
        finally:
            replica.in_flight -= 1
            upstream.release()  # to the pool once read to the end; closed if not (the engine aborts)
        if failure is None:
            replica.succeed()
        else:
            self._eject(backend, replica, "stream_timeout" if code == 504 else "stream_failed")
        log.info("%s tenant=%s model=%s replica=%s status=%d retries=%d prompt_tokens=%d "
                 "completion_tokens=%d seconds=%.3f%s", path, tenant.name, backend.model, replica.name, code,
                 len(attempt.retries), usage.prompt_tokens, usage.completion_tokens, self.clock() - started,
                 f" prompt={json.dumps(payload.get('prompt', payload.get('messages')))[:2000]}"
                 if self.settings.log_prompts else "")
        return code

    def _eject(self, backend: Backend, replica: Replica, cause: str) -> None:
        backoff = replica.fail(self.clock(), self.settings.eject_seconds, self.settings.eject_max_seconds)
        self.metrics.ejections.labels(backend.model, cause).inc()
        log.warning("replica %s of %s ejected for %g s (%s, %d in a row)", replica.name, backend.model, backoff,
                    cause, replica.failures)

    def _account(self, tenant: Tenant, model: str, usage: Usage, sse: SSEUsage, reserved: int) -> None:
        """Charge what the request cost: the engine's `usage` where it came; else (a stream
        cut by the client or the replica) an upper bound of the tokens passed on, at most
        the reservation unless more was seen."""
        total = usage.prompt_tokens + usage.completion_tokens
        if total:
            self.metrics.tokens.labels(tenant.name, model, "prompt").inc(usage.prompt_tokens)
            self.metrics.tokens.labels(tenant.name, model, "completion").inc(usage.completion_tokens)
        elif sse.streamed:
            total = min(sse.streamed, reserved) if reserved else sse.streamed
        limits = self.limits.get(tenant.name)
        if limits is not None:
            limits.settle(self.clock(), reserved, total)


def limits_tokens(limits: TenantLimits | None) -> bool:
    return limits is not None and limits.tokens is not None


def _json_object(body: bytes) -> dict:
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(payload, dict):
        raise APIError(400, "the request body must be a JSON object")
    return payload


def _shown(text: str, limit: int = 64) -> str:
    """A client's method or path in a message, cut short (it may be kilobytes)."""
    return text if len(text) <= limit else text[:limit] + "..."


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def _send_bytes(send, status: int, body: bytes, content_type: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
