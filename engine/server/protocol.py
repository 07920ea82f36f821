"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Strict: a string where a number belongs (or `true` where an integer belongs) is a 400,
not a silent coercion. Every number carries the bounds the engine can hold (they appear
in the OpenAPI schema). Unknown fields are accepted and ignored, as OpenAI clients send
fields this server has no use for; fields that would change the answer and that this
server does not implement (`UNSUPPORTED`) are refused by name. Responses are plain dicts
built in serving code."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..core.sampling_params import (
    INT32_MAX, INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_REPETITION_PENALTY, MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
)

MAX_N = 16  # choices per request: n sequences take n slots of the batch and the queue
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
ROLES = ("system", "developer", "user", "assistant")  # tool/function: no tools here

# Fields of OpenAI's API (and vLLM's) this server does not implement, with the values
# that ask for nothing (sent by some clients by default). Anything else is a 400.
_NO_TOOLS = {"tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
             "function_call": (None, "none")}
_NO_STRUCTURED_OUTPUT = {
    "response_format": (None, {"type": "text"}), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
}
_NO_VLLM_EXTRAS = {"use_beam_search": (None, False), "prompt_logprobs": (None,),
                   "bad_words": (None, []), "allowed_token_ids": (None,),
                   "truncate_prompt_tokens": (None,), "logits_processors": (None,)}


class _Body(BaseModel):
    # allow_inf_nan: 1e400 parses as inf; refused naming its field.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields both generation endpoints share: OpenAI's plus vLLM's extensions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # only empty: biases are not implemented
    # OpenAI's tiers; "flex" marks traffic that tolerates slow answers (a batch), which the
    # autotuner then holds to no latency objective. "auto" is served as "default".
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def engine_tier(self) -> str:
        """The tier the engine serves and labels the request with."""
        return "default" if self.service_tier in (None, "auto") else self.service_tier


class CompletionRequest(_Sampling):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {**_NO_STRUCTURED_OUTPUT, **_NO_VLLM_EXTRAS}
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: TokenCount | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "tool_calls": (None, []), "function_call": (None,), "audio": (None,)}
    role: Literal[ROLES]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_NO_TOOLS, **_NO_STRUCTURED_OUTPUT, **_NO_VLLM_EXTRAS,
        "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
        "web_search_options": (None,), "reasoning_effort": (None,), "verbosity": (None,),
    }
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


def unsupported_field(model: type[_Body], data: dict) -> str | None:
    """The first field in `data` that `model` refuses (asking for what is not implemented),
    as a dotted path; chat messages are looked into."""
    for name, neutral in model.UNSUPPORTED.items():
        if name in data and not any(data[name] == v and type(data[name]) is type(v) for v in neutral):
            return name
    messages = data.get("messages") if "messages" in model.model_fields else None
    if isinstance(messages, list):
        for i, m in enumerate(messages):
            if isinstance(m, dict):
                inner = unsupported_field(ChatMessage, m)
                if inner is not None:
                    return f"messages.{i}.{inner}"
    return None
