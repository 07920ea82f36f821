"""What both generation endpoints share: model check, sampling parameters, admission,
disconnect watching, SSE framing and usage."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..core.outputs import TokenLogprob
from ..config.validation import LengthError, RequestError
from ..core.sampling_params import SamplingParams
from .async_engine import AsyncEngine
from .streams import ChoiceDelta, EngineError, RequestStream, StreamUpdate, StreamClosed
from .errors import APIError, error_body
from .limits import ServerLimits
from .prompts import PromptEncoder
from .protocol import _Sampling
from .server_timing import server_timing

log = logging.getLogger("kvpilot.server")


@dataclass
class ServerSettings:
    served_model_name: str
    model_path: str
    max_queued_requests: int | None = None
    api_key: str | None = None
    drain_timeout: float = 30.0
    limits: ServerLimits = field(default_factory=ServerLimits)


@dataclass
class ServerState:
    """Per-app mutable state (lives on app.state, never module-global)."""

    settings: ServerSettings
    engine: AsyncEngine
    draining: bool = False
    prompts: PromptEncoder = field(init=False)

    def __post_init__(self) -> None:
        self.prompts = PromptEncoder(self.engine.tokenizer)


def check_model(model: str | None, settings: ServerSettings) -> str:
    if model is not None and model != settings.served_model_name:
        raise APIError(404, f"the model `{model}` does not exist; this server serves "
                            f"`{settings.served_model_name}`", param="model", code="model_not_found")
    return settings.served_model_name


def _param_of(message: str, fields) -> str | None:
    word = message.split(" ", 1)[0].strip("'\"`:")
    return word if word in fields else None


def build_params(body: _Sampling, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    kwargs = dict(
        n=body.n, seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos, max_tokens=max_tokens, min_tokens=body.min_tokens,
        logprobs=logprobs, include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param=_param_of(str(exc), type(body).model_fields)) from None


async def admit(state: ServerState, request: Request, prompt_ids: list[int],
                params: SamplingParams, arrival: float, service_tier: str = "default",
                max_tokens_field: str = "max_tokens") -> RequestStream:
    """Queue the request in the engine: 503 while draining, 429 when the queue is full, 400
    naming the field when the engine's add_request (the one place that checks the prompt's
    ids, resolves max_tokens and checks the id) refuses it. `max_tokens_field` is the name
    the client gave max_tokens (chat's max_completion_tokens)."""
    if state.draining:
        raise APIError(503, "the server is shutting down and admits no new requests")
    limit = state.settings.max_queued_requests
    if limit is not None and params.n > limit:  # it would never fit, whoever else waits
        raise APIError(400, f"n ({params.n}) exceeds the server's waiting queue "
                            f"({limit} sequences, --max-queued-requests)", param="n")
    if limit is not None and state.engine.queue_length + params.n > limit:
        raise APIError(429, f"the waiting queue is full ({limit} sequences); retry later")
    try:
        return await state.engine.add(request.headers.get("x-request-id"), prompt_ids, params,
                                      arrival_time=arrival, service_tier=service_tier)
    except RequestError as exc:
        if isinstance(exc, LengthError):
            state.engine.metrics.length_refusals.inc()
        param = max_tokens_field if exc.param == "max_tokens" else exc.param
        raise APIError(400, str(exc), param=param) from None
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


async def watch_disconnect(request: Request, stream: RequestStream) -> None:
    """Close the stream (aborting the request in the engine, freeing its KV blocks) as soon
    as the client goes away. It waits on the ASGI receive channel for `http.disconnect` (the
    body is read by now), as vLLM's listen_for_disconnect does, instead of polling: a poll
    per request woke the event loop thousands of times a second once thousands of requests
    queued, and took the engine thread's CPU. The handler cancels it when the request ends."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                if not stream.finished:
                    log.info("client disconnected; aborting request %s", stream.request_id)
                stream.close()
                return
    except asyncio.CancelledError:
        pass


async def final_snapshot(stream: RequestStream, watcher: asyncio.Task) -> StreamUpdate | None:
    """Wait for the request to finish; None if the client went away first."""
    snap = None
    try:
        async for snap in stream:
            pass
    except StreamClosed:
        return None
    except EngineError as exc:
        raise APIError(500, str(exc)) from None
    finally:
        watcher.cancel()
        stream.close()
    if snap is None:
        raise APIError(500, "the request ended without output")
    return snap


class DeltaTracker:
    """What each choice's next chunk carries: its new text, and the logprobs of every token
    since the last chunk (tokens whose text a stop string holds back wait for the next)."""

    def __init__(self, n: int) -> None:
        self.pending: list[list[TokenLogprob]] = [[] for _ in range(n)]
        self.done = [False] * n

    def take(self, d: ChoiceDelta) -> tuple[str, list[TokenLogprob] | None] | None:
        """(new text, new logprobs) for a chunk, or None when there is nothing to send."""
        i = d.index
        if self.done[i]:
            return None
        if d.logprobs is not None:
            self.pending[i] += d.logprobs
        if not d.text and d.finish_reason is None:
            return None
        logprobs = None
        if d.logprobs is not None:
            logprobs, self.pending[i] = self.pending[i], []
        self.done[i] = d.finish_reason is not None
        return d.text, logprobs


async def sse_events(stream: RequestStream, watcher: asyncio.Task, first: list[str],
                     render: Callable[[StreamUpdate], str | None],
                     usage_chunk: Callable[[StreamUpdate], str] | None) -> AsyncIterator[str]:
    """The SSE body: `first` chunks, one chunk per snapshot that `render`s to something,
    the usage chunk if asked for, then [DONE]. Closing (a disconnect) aborts the request."""
    last = None
    try:
        for chunk in first:
            yield chunk
        async for snap in stream:
            last = snap
            chunk = render(snap)
            if chunk:
                yield chunk
        if usage_chunk is not None and last is not None:
            yield usage_chunk(last)
        yield sse("[DONE]")
    except StreamClosed:
        return
    except EngineError as exc:
        yield sse(error_body(500, str(exc)))
        yield sse("[DONE]")
    finally:
        watcher.cancel()
        stream.close()


def usage(num_prompt_tokens: int, snap: StreamUpdate) -> dict:
    completion = sum(len(c.token_ids) for c in snap.choices)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def now_s() -> int:
    return int(time.time())


class Reply:
    """One admitted request's response plumbing: ids and headers, the disconnect watcher,
    the JSON body or the SSE stream with its usage chunk."""

    def __init__(self, request: Request, stream: RequestStream, *, id_prefix: str, object: str,
                 model: str, num_prompt_tokens: int, include_usage: bool = False,
                 service_tier: str | None = None) -> None:
        self.stream = stream
        rid = stream.request_id
        self.headers = {} if request.headers.get("x-request-id") else {"X-Request-Id": rid}
        self.head = {"id": f"{id_prefix}-{rid}", "object": object, "created": now_s(), "model": model}
        if service_tier is not None:  # as OpenAI does: the tier that served it, when one was asked for
            self.head["service_tier"] = service_tier
        self.num_prompt_tokens = num_prompt_tokens
        self.include_usage = include_usage
        self.watcher = asyncio.create_task(watch_disconnect(request, stream))

    async def final(self) -> StreamUpdate | None:
        return await final_snapshot(self.stream, self.watcher)

    def json(self, choices: list[dict], snap: StreamUpdate) -> JSONResponse:
        timing = server_timing(snap.metrics, [len(c.token_ids) for c in snap.choices])
        headers = {**self.headers, "Server-Timing": timing} if timing else self.headers
        return JSONResponse({**self.head, "choices": choices,
                             "usage": usage(self.num_prompt_tokens, snap)}, headers=headers)

    def chunk(self, choices: list[dict]) -> str:
        return sse({**self.head, "choices": choices, **({"usage": None} if self.include_usage else {})})

    def _usage_chunk(self, snap: StreamUpdate) -> str:
        return sse({**self.head, "choices": [], "usage": usage(self.num_prompt_tokens, snap)})

    def streaming(self, first: list[str], render: Callable[[StreamUpdate], str | None]) -> StreamingResponse:
        events = sse_events(self.stream, self.watcher, first, render,
                            self._usage_chunk if self.include_usage else None)
        return StreamingResponse(events, media_type="text/event-stream", headers=self.headers)

    @staticmethod
    def client_gone() -> Response:
        return Response(status_code=499)  # nobody reads it; the request was aborted
