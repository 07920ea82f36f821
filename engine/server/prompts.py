"""Prompt text to token ids, off the event loop and bounded.

Tokenizing is CPU work proportional to the text (about 1.7 s per MB for builtin:tiny's
tokenizer), so long texts go to a worker thread and the loop keeps answering /health and
streams meanwhile. And a text too long to fit max_model_len is refused before any of it is
tokenized: a token covers at most `max_chars_per_token` characters (the longest entry of the
vocabulary; byte-level vocabularies spell each byte as one character), so a text longer
than max_model_len x that (with slack for normalizers that merge characters) cannot fit."""

from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

from .errors import APIError

T = TypeVar("T")
INLINE_CHARS = 1024  # shorter texts tokenize in well under a millisecond: no thread hop
NORMALIZER_SLACK = 4  # NFC/NFKC may merge up to a few characters into one


def longest_token_chars(tokenizer) -> int:
    return max(1, max(len(t) for t in tokenizer.convert_ids_to_tokens(range(len(tokenizer)))))


class PromptEncoder:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_chars_per_token = longest_token_chars(tokenizer)

    def max_chars(self, max_model_len: int) -> int:
        return max_model_len * self.max_chars_per_token * NORMALIZER_SLACK

    def check_size(self, num_chars: int, max_model_len: int, param: str) -> None:
        if num_chars > self.max_chars(max_model_len):
            raise APIError(400, f"{param}: {num_chars} characters are more than max_model_len "
                                f"({max_model_len}) tokens can hold (at most {self.max_chars(max_model_len)} "
                                "characters for this tokenizer)", param=param)

    async def encode(self, text: str, max_model_len: int, param: str = "prompt",
                     add_special_tokens: bool = True) -> list[int]:
        self.check_size(len(text), max_model_len, param)
        return await self.run(len(text), lambda: self.tokenizer.encode(
            text, add_special_tokens=add_special_tokens), param)

    async def run(self, num_chars: int, work: Callable[[], T], param: str) -> T:
        """`work` (tokenizing or rendering a template) inline when short, else on a thread;
        a failure on the user's text is a 400 naming `param`."""
        try:
            return work() if num_chars <= INLINE_CHARS else await asyncio.to_thread(work)
        except APIError:
            raise
        except Exception as exc:  # the tokenizer's own refusal of this text
            raise APIError(400, f"{param}: the tokenizer could not encode this text "
                                f"({type(exc).__name__})", param=param) from None
