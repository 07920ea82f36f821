"""Command-line flags generated from a settings dataclass: names, types, defaults and
help come from its fields, so a setting is declared once."""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING, fields


def _scalar(tp) -> type:
    """The argparse type of a field annotation: its one scalar type, or str for a union of
    several (such as int | str, a byte quantity the dataclass parses)."""
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
    args = [a for a in args if a is not type(None)]
    if len(args) > 1:
        return str
    return args[0] if args and args[0] in (int, float, str, bool) else str


def _flag_fields(cls):
    """The fields that get a flag: init fields not marked `metadata={"flag": False}`."""
    return [f for f in fields(cls) if f.init and f.metadata.get("flag", True)]


def add_dataclass_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls, prefix: str,
                        flag_names: dict[str, str] | None = None) -> None:
    """One `--PREFIX-FIELD` flag per flag field of `cls` (or the name in flag_names), with
    the field's metadata: `help`, `choices`, and `exclusive` (fields sharing a name go in one
    mutually exclusive group). Every default is None, so `dataclass_from_args` can tell
    what the user set."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for f in _flag_fields(cls):
        target = parser
        if "exclusive" in f.metadata:
            if f.metadata["exclusive"] not in groups:
                groups[f.metadata["exclusive"]] = parser.add_mutually_exclusive_group()
            target = groups[f.metadata["exclusive"]]
        flag = (flag_names or {}).get(f.name) or "--" + f"{prefix}{f.name}".replace("_", "-")
        default = None if f.default is MISSING else f.default
        help_text = f.metadata.get("help", "")
        if default is not None:
            help_text += f" (default: {default})"
        kind = _scalar(hints[f.name])
        dest = f"{prefix}{f.name}"
        if kind is bool:
            target.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif "choices" in f.metadata:
            target.add_argument(flag, dest=dest, type=kind, default=None, help=help_text,
                                choices=f.metadata["choices"])
        else:
            target.add_argument(flag, dest=dest, type=kind, default=None, help=help_text,
                                metavar=f.name.upper())


def dataclass_from_args(cls, args: argparse.Namespace, prefix: str, **extra):
    """The dataclass from the flags the user gave (the rest keep the dataclass's defaults)."""
    given = {f.name: getattr(args, f"{prefix}{f.name}") for f in _flag_fields(cls)
             if getattr(args, f"{prefix}{f.name}", None) is not None}
    return cls(**given, **extra)
