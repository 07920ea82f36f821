"""The engine's one check of a positive integer setting, for configs, live limits,
simulator arguments and model shapes alike: `True` is refused although Python counts it
as an int, and the message names the field."""

from __future__ import annotations


def positive_int(name: str, value: object, where: str = "") -> int:
    """`value` when it is an integer >= 1; ValueError naming `where` + `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}{name} must be a positive integer, got {value!r}")
    return value
