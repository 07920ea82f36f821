"""POST /v1/completions: text or token-id prompts, streaming or not."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from ..core.outputs import TokenLogprob
from .errors import APIError
from .protocol import CompletionRequest
from .serving_common import (
    DeltaTracker, Reply, ServerState, admit, build_params, check_model,
)


async def _prompt_ids(body: CompletionRequest, state: ServerState) -> tuple[list[int], str | None]:
    """(token ids, prompt text if given as text). One prompt per request."""
    prompt = body.prompt
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported: send one prompt per "
                                    "request", param="prompt")
            prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return await state.prompts.encode(prompt, state.engine.max_model_len), prompt
    return list(prompt), None  # ids are checked once, by the engine's add_request


class _LogprobRenderer:
    """OpenAI legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, tokenizer, start_offset: int) -> None:
        self.tok = tokenizer
        self.offset = start_offset

    def render(self, entries: list[TokenLogprob]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.tok.token_to_text(e.token_id)
            top = {self.tok.token_to_text(i): lp for i, lp in e.top}
            top.setdefault(text, e.logprob)
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


async def create_completion(body: CompletionRequest, request: Request, state: ServerState) -> Response:
    arrival = time.monotonic()
    model = check_model(body.model, state.settings)
    tokenizer = state.engine.tokenizer
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of is not supported (it must equal n)", param="best_of")
    if body.suffix:
        raise APIError(400, "suffix is not supported by this server", param="suffix")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported (no prompt logprobs)",
                       param="echo")
    params = build_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs)
    prompt_ids, prompt_text = await _prompt_ids(body, state)
    stream = await admit(state, request, prompt_ids, params, arrival, body.engine_tier)
    echo_text = ""
    if body.echo:
        echo_text = prompt_text if prompt_text is not None else tokenizer.decode(prompt_ids)
    reply = Reply(request, stream, id_prefix="cmpl", object="text_completion", model=model,
                  num_prompt_tokens=len(prompt_ids),
                  include_usage=bool(body.stream_options and body.stream_options.include_usage),
                  service_tier=body.engine_tier if body.service_tier is not None else None)
    if not body.stream:
        snap = await reply.final()
        if snap is None:
            return reply.client_gone()
        choices = []
        for c in snap.choices:
            lp = None
            if c.logprobs is not None:
                lp = _LogprobRenderer(tokenizer, len(echo_text)).render(c.logprobs)
            choices.append({"index": c.index, "text": echo_text + c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return reply.json(choices, snap)

    tracker = DeltaTracker(body.n)
    renderers = [_LogprobRenderer(tokenizer, len(echo_text)) for _ in range(body.n)]

    def render(snap) -> str | None:
        out = []
        for c in snap.deltas:
            delta = tracker.take(c)
            if delta is None:
                continue
            text, logprobs = delta
            out.append({"index": c.index, "text": text,
                        "logprobs": renderers[c.index].render(logprobs) if logprobs is not None else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason if c.finish_reason else None})
        return reply.chunk(out) if out else None

    first = [reply.chunk([{"index": i, "text": echo_text, "logprobs": None, "finish_reason": None}
                          for i in range(body.n)])] if echo_text else []
    return reply.streaming(first, render)
