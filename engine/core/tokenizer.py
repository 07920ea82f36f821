"""A Hugging Face-format tokenizer: tokenizer.json via `tokenizers`, chat template via jinja2.

Reads the three files a model directory carries: tokenizer.json (the pipeline),
tokenizer_config.json (special tokens, chat template) and generation_config.json (the
extra stop ids). Encoding, decoding and chat rendering match transformers'
`AutoTokenizer` for the same directory.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and stop tokens."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self._config = dict(config or {})
        self._generation_config = dict(generation_config or {})
        self.chat_template: str | None = chat_template or _pick_template(self._config.get("chat_template"))
        # Named special tokens as strings ("bos_token" -> "<|begin_of_text|>"), when set.
        self.special_tokens: dict[str, str] = {
            name: text for name in _SPECIAL_NAMES if (text := _token_text(self._config.get(name)))
        }
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_token_id: int | None = self._id_of(self.bos_token)
        if self.bos_token_id is None and isinstance(self._generation_config.get("bos_token_id"), int):
            self.bos_token_id = self._generation_config["bos_token_id"]
        eos = {self._id_of(self.eos_token)} | set(_as_ids(self._generation_config.get("eos_token_id")))
        self.eos_token_ids: frozenset[int] = frozenset(i for i in eos if i is not None)
        added = tokenizer.get_added_tokens_decoder()
        # The ids `decode(..., skip_special_tokens=True)` drops.
        self.all_special_ids: list[int] = sorted(i for i, tok in added.items() if tok.special)
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"model: {folder} has no tokenizer.json (a `tokenizers` pipeline file)")
        config = _read_json(folder / "tokenizer_config.json")
        template = None
        if not config.get("chat_template"):
            # transformers >= 4.43 may save the template in a file of its own.
            if (folder / "chat_template.jinja").is_file():
                template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
            else:
                template = _read_json(folder / "chat_template.json").get("chat_template")
        return cls(
            _HFTokenizer.from_file(str(tok_file)),
            config,
            _read_json(folder / "generation_config.json"),
            template,
        )

    # -- encoding and decoding ---------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Ids unknown to the tokenizer (a model vocabulary padded past it) decode to nothing."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary entries (e.g. "Ġworld" in byte-level BPE); "" for unknown ids."""
        return [self._tok.id_to_token(i) or "" for i in ids]

    def token_to_text(self, token_id: int) -> str:
        """One token decoded on its own, special tokens kept (for logprobs display).

        A token holding part of a multi-byte character shows as U+FFFD.
        """
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __len__(self) -> int:
        return self.vocab_size

    # -- chat ----------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template, as transformers does.

        The result already holds the template's own special tokens (such as BOS), so
        encode it with `add_special_tokens=False`. Errors the template raises (for
        example, roles that do not alternate) become ValueError.
        """
        if not self.chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template (tokenizer_config.json has no "
                "`chat_template`); use a completion prompt instead"
            )
        # transformers drops None-valued keys: many templates test for a key's presence.
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        variables = {**self.special_tokens, "tools": None, "documents": None, **template_kwargs}
        try:
            return self._compiled_template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template: {exc}") from exc

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        try:
            return _chat_environment().from_string(self.chat_template or "")
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not parse: {exc}") from exc

    # -- helpers -------------------------------------------------------------------------

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _chat_environment() -> ImmutableSandboxedEnvironment:
    """The sandbox transformers renders chat templates in, with the same helpers."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _pick_template(raw: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of named templates."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def _token_text(raw: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and isinstance(raw.get("content"), str):
        return raw["content"]
    return None


def _as_ids(raw: Any) -> list[int]:
    if isinstance(raw, bool):
        return []
    if isinstance(raw, int):
        return [raw]
    if isinstance(raw, list):
        return [i for i in raw if isinstance(i, int) and not isinstance(i, bool)]
    return []


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}
