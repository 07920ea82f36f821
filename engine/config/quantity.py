"""Byte sizes written the way Kubernetes writes them ("64Mi", "1G", "1073741824")."""

from __future__ import annotations

import re

_SUFFIXES = {
    "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|k|M|G|T|)\s*$")


def parse_bytes(name: str, value: object) -> int:
    """Parse an int or a Kubernetes quantity string into bytes; ValueError names `name`."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count, got {value!r}")
    if isinstance(value, int):
        result = value
    elif isinstance(value, float) and value.is_integer():
        result = int(value)
    elif isinstance(value, str) and (m := _QUANTITY.match(value)):
        result = int(float(m.group(1)) * _SUFFIXES[m.group(2)])
    else:
        raise ValueError(
            f"{name} must be a byte count such as 67108864, 64Mi or 1G, got {value!r}"
        )
    if result <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return result


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
