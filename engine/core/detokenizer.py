"""Streaming detokenization: text deltas as tokens arrive, whole characters only.

Byte-level tokens may hold part of a UTF-8 character; decoding them alone gives U+FFFD.
Following vLLM, we decode a short window of tokens twice: from `prefix` to `read` (text
already emitted) and from `prefix` to the end. The difference is new text, emitted only
when it does not end in U+FFFD (an incomplete character waits for its next bytes).
Each step decodes only the window since the last emission, so it costs O(window), not
O(output length).
"""

from __future__ import annotations

from typing import Sequence

from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context for the first output token: SentencePiece-style
# decoders strip a sequence's leading space, which the context keeps.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, a delta at a time.

    After `flush()`, `text` equals `tokenizer.decode(output_ids)` for byte-level
    tokenizers (whenever the prompt ends on a character boundary, which a text prompt
    always does).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends mid-character (token-id prompts only): don't let the
            # output's first bytes complete a character that belongs to the prompt.
            context, context_text = [], ""
        self._window: list[int] = context  # tokens from `prefix` on
        self._read = len(context)  # window[:read] is already emitted (or prompt)
        self._read_text = context_text  # decode(window[:read])
        self._pieces: list[str] = []
        self._text: str | None = ""

    @property
    def text(self) -> str:
        """All output text emitted so far (without any held-back tail)."""
        if self._text is None:
            self._text = "".join(self._pieces)
            self._pieces = [self._text]
        return self._text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return the text they complete ("" if none yet)."""
        self._window.extend(token_ids)
        new_text = self._decode(self._window)
        if len(new_text) <= len(self._read_text) or new_text.endswith(_REPLACEMENT):
            return ""  # nothing decodes yet, or the tail is an incomplete character
        return self._emit(new_text)

    def flush(self) -> str:
        """Emit whatever is held back (a truly invalid tail shows as U+FFFD)."""
        new_text = self._decode(self._window)
        if len(new_text) <= len(self._read_text):
            return ""
        return self._emit(new_text)

    def _emit(self, new_text: str) -> str:
        delta = new_text[len(self._read_text):]
        # The tokens just read become the next window's context.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._read_text = self._decode(self._window)
        self._pieces.append(delta)
        self._text = None
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""
