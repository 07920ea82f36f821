"""The routing key of a request: the start of its prompt.

Requests that share their first `prefix_chars` characters (or, for token-id prompts,
their first `prefix_tokens` ids) share a key, so they land on the replica whose prefix
cache holds that start. Text is used as the client sent it: the gateway has no tokenizer
for every model it serves, and equal text gives equal tokens on one model."""
from __future__ import annotations

import json

DEFAULT_PREFIX_CHARS = 256
DEFAULT_PREFIX_TOKENS = 64


def _message_text(message) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):  # content parts: the text ones, in order
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                          and isinstance(p.get("text"), str))
    return f"{message.get('role', '')}\x1f{content if isinstance(content, str) else ''}\x1e"


def prefix_key(body: dict, prefix_chars: int = DEFAULT_PREFIX_CHARS,
               prefix_tokens: int = DEFAULT_PREFIX_TOKENS) -> bytes | None:
    """The key to hash, or None when the body has no prompt to key on."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            return None
        text = ""
        for message in messages:  # only as many messages as the key needs
            text += _message_text(message)
            if len(text) >= prefix_chars:
                break
        return text[:prefix_chars].encode("utf-8", "surrogatepass") or None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: the first one's start
    if isinstance(prompt, str):
        return prompt[:prefix_chars].encode("utf-8", "surrogatepass") or None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:prefix_tokens]):
        return json.dumps(prompt[:prefix_tokens]).encode()
    return None
