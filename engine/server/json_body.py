"""A request body from bytes to plain JSON values, refusing by name what would break the
layers below validation: bytes that are not UTF-8, nesting deeper than any API field
needs, integers past what any field holds (Python refuses to parse past 4300 digits, so
long ones never reach `int()`), and strings with lone surrogates (JSON's `\\ud800`), which
the tokenizer cannot take."""

from __future__ import annotations

import json
import re

MAX_DEPTH = 32  # the deepest API field (a chat message's content part) sits at depth 4
MAX_INT_DIGITS = 20  # int64 takes 19 digits (and a sign)
_SURROGATE = re.compile("[\ud800-\udfff]")
_NESTED = (str, dict, list)  # what check_values looks into


class BodyError(ValueError):
    """The body cannot be used; `param` names the top-level field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class OversizedInt:
    """An integer literal too long for any field: kept as a value validation refuses by its
    field's name ("must be an integer"), instead of a parse error for the whole body."""

    def __init__(self, digits: str) -> None:
        self.num_digits = len(digits)

    def __repr__(self) -> str:
        return f"<integer of {self.num_digits} digits>"


def _parse_int(digits: str) -> int | OversizedInt:
    return int(digits) if len(digits) <= MAX_INT_DIGITS else OversizedInt(digits)


def decode_json(raw: bytes) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"body: not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_int=_parse_int)
    except RecursionError:
        raise BodyError(f"body: JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise BodyError(f"body: not valid JSON ({exc})") from None
    check_values(data)
    return data


def _path(parts: list) -> str:
    return ".".join(str(p) for p in parts) or "body"


def check_values(data: object) -> None:
    """Depth and lone surrogates, without recursion (the depth is what is checked)."""
    stack: list[tuple[object, list]] = [(data, [])]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise BodyError(f"{_path(path[:2])}: JSON nested deeper than {MAX_DEPTH} levels",
                            param=_param(path))
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise BodyError(f"{_path(path)}: text is not valid Unicode (a lone surrogate "
                                "such as \\ud800)", param=_param(path))
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    raise BodyError(f"{_path(path)}: a key is not valid Unicode (a lone surrogate)",
                                    param=_param(path) or key)
                if isinstance(item, _NESTED):
                    stack.append((item, [*path, key]))
        elif isinstance(value, list):  # numbers need no look (a prompt's token ids)
            stack.extend((item, [*path, i]) for i, item in enumerate(value) if isinstance(item, _NESTED))


def _param(path: list) -> str | None:
    return str(path[0]) if path else None
