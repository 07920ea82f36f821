"""Send one soak request and judge its answer: ok, cancelled (the client disconnected on
purpose) or failed, with the kind of failure. Never raises.

A failure is anything a well-behaved server must not do with a valid request: a non-200
status (kinds `http_STATUS`, or `no_envelope_STATUS` when the body is not OpenAI's error
envelope), an error event in a stream, a stream that ends without `[DONE]`, a transport
error, or an answer missing what was asked for (choices, finish reasons, logprobs, usage)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .serve import sse_data
from .soak_mix import SoakRequest

FINISH_REASONS = ("stop", "length")
ENVELOPE_FIELDS = {"message", "type", "param", "code"}


@dataclass
class Outcome:
    status: str  # "ok" | "cancelled" | "failed"
    kind: str = ""  # the failure's kind
    message: str = ""
    cancel_missed: bool = False  # marked for cancelling, but it finished first


class BadAnswer(Exception):
    """The server answered 200 with something a valid request must not get."""


def _failed(kind: str, message: str) -> Outcome:
    return Outcome("failed", kind, message[:300])


def http_error(status: int, text: str) -> Outcome:
    try:
        error = json.loads(text)["error"]
        enveloped = isinstance(error, dict) and ENVELOPE_FIELDS <= error.keys()
    except (ValueError, TypeError, KeyError):
        enveloped = False
    return _failed(f"http_{status}" if enveloped else f"no_envelope_{status}", f"HTTP {status}: {text}")


def _text_of(req: SoakRequest, choice: dict) -> str:
    if req.endpoint == "chat":
        return (choice.get("delta") or choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def _logprob_count(req: SoakRequest, choice: dict) -> int:
    lp = choice.get("logprobs")
    if lp is None:
        return 0
    return len(lp["content"] if req.endpoint == "chat" else lp["tokens"])


class _Choices:
    """Per-choice text, logprob entries and finish reason, checked once the answer is whole."""

    def __init__(self, req: SoakRequest) -> None:
        self.req = req
        self.text = [""] * req.n
        self.logprobs = [0] * req.n
        self.finish: list[str | None] = [None] * req.n

    def add(self, choice: dict) -> str:
        i = choice["index"]
        if not 0 <= i < self.req.n:
            raise BadAnswer(f"choice index {i} for n={self.req.n}")
        text = _text_of(self.req, choice)
        self.text[i] += text
        self.logprobs[i] += _logprob_count(self.req, choice)
        if choice.get("finish_reason") is not None:
            self.finish[i] = choice["finish_reason"]
        return text

    def check(self) -> None:
        for i in range(self.req.n):
            if self.finish[i] not in FINISH_REASONS:
                raise BadAnswer(f"choice {i} ended with finish_reason {self.finish[i]!r}")
            if self.req.logprobs and self.text[i] and not self.logprobs[i]:
                raise BadAnswer(f"choice {i} carries text but no logprobs")


async def _json_answer(client, req: SoakRequest, headers: dict) -> Outcome:
    resp = await client.post(req.path, json=req.body, headers=headers)
    if resp.status_code != 200:
        return http_error(resp.status_code, resp.text)
    answer = resp.json()
    choices = _Choices(req)
    for choice in answer["choices"]:
        choices.add(choice)
    choices.check()
    if not isinstance(answer.get("usage", {}).get("completion_tokens"), int):
        raise BadAnswer("no usage in the answer")
    return Outcome("ok")


async def _stream_answer(client, req: SoakRequest, headers: dict) -> Outcome:
    async with client.stream("POST", req.path, json=req.body, headers=headers) as resp:
        if resp.status_code != 200:
            return http_error(resp.status_code, (await resp.aread()).decode(errors="replace"))
        choices, chunks, usage, done = _Choices(req), 0, None, False
        async for event in sse_data(resp):
            if event is None:
                done = True
                break
            if "error" in event:
                return _failed("stream_error", json.dumps(event["error"]))
            if event.get("usage"):
                usage = event["usage"]
            if any([choices.add(c) for c in event.get("choices", ())]):
                chunks += 1
            if req.cancel_after is not None and chunks >= req.cancel_after:
                return Outcome("cancelled")  # leaving the block closes the connection mid-stream
        if not done:
            return _failed("broken_stream", "the stream ended without [DONE]")
        choices.check()
        if req.include_usage and not isinstance((usage or {}).get("completion_tokens"), int):
            raise BadAnswer("include_usage was asked for, and no usage chunk came")
        return Outcome("ok", cancel_missed=req.cancel_after is not None)


async def send(client, req: SoakRequest, headers: dict) -> Outcome:
    try:
        if req.stream:
            return await _stream_answer(client, req, headers)
        return await _json_answer(client, req, headers)
    except BadAnswer as exc:
        return _failed("bad_answer", str(exc))
    except (ValueError, KeyError, TypeError) as exc:  # JSON that is not an OpenAI answer
        return _failed("bad_answer", f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # transport: refused, reset, timed out, cut mid-body
        return _failed(f"transport_{type(exc).__name__}", str(exc) or type(exc).__name__)
