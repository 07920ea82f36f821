"""POST /v1/chat/completions: the model's chat template, streaming or not."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from ..core.outputs import TokenLogprob
from ..core.sampling_params import MAX_LOGPROBS
from .errors import APIError
from .protocol import ChatCompletionRequest, ChatMessage
from .serving_common import (
    DeltaTracker, Reply, ServerState, admit, build_params, check_model,
)



async def chat_prompt_ids(state: ServerState, messages: list[ChatMessage],
                          add_generation_prompt: bool = True) -> list[int]:
    """The rendered conversation's token ids: refused up front when its text could not fit
    max_model_len, rendered and tokenized off the event loop when long."""
    num_chars = sum(len(m.text()) for m in messages)
    state.prompts.check_size(num_chars, state.engine.max_model_len, "messages")
    return await state.prompts.run(num_chars, lambda: render_chat_prompt(
        state.engine.tokenizer, messages, add_generation_prompt), "messages")


def render_chat_prompt(tokenizer, messages: list[ChatMessage],
                       add_generation_prompt: bool = True) -> list[int]:
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # template errors (e.g. an unsupported role) are the caller's input
        raise APIError(400, f"the chat template could not render these messages: {exc}",
                       param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _logprob_entries(tokenizer, entries: list[TokenLogprob], k: int) -> list[dict]:
    out = []
    for e in entries:
        text = tokenizer.token_to_text(e.token_id)
        top = []
        for tid, lp in e.top[:k]:
            t = tokenizer.token_to_text(tid)
            top.append({"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))})
        out.append({"token": text, "logprob": e.logprob, "bytes": list(text.encode("utf-8")),
                    "top_logprobs": top})
    return out


async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 state: ServerState) -> Response:
    arrival = time.monotonic()
    model = check_model(body.model, state.settings)
    tokenizer = state.engine.tokenizer
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                f"{body.top_logprobs}", param="top_logprobs")
    top_k = body.top_logprobs or 0
    max_tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = build_params(body, max_tokens=max_tokens, logprobs=top_k if body.logprobs else None)
    prompt_ids = await chat_prompt_ids(state, body.messages, body.add_generation_prompt)
    stream = await admit(state, request, prompt_ids, params, arrival, body.engine_tier, max_tokens_field)
    reply = Reply(request, stream, id_prefix="chatcmpl",
                  object="chat.completion.chunk" if body.stream else "chat.completion", model=model,
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
                lp = {"content": _logprob_entries(tokenizer, c.logprobs, top_k)}
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": lp, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
        return reply.json(choices, snap)

    tracker = DeltaTracker(body.n)

    def render(snap) -> str | None:
        out = []
        for c in snap.deltas:
            delta = tracker.take(c)
            if delta is None:
                continue
            text, logprobs = delta
            lp = {"content": _logprob_entries(tokenizer, logprobs, top_k)} if logprobs is not None else None
            out.append({"index": c.index, "delta": {"content": text} if text else {},
                        "logprobs": lp, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason if c.finish_reason else None})
        return reply.chunk(out) if out else None

    first = [reply.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None} for i in range(body.n)])]
    return reply.streaming(first, render)
