"""Kubernetes resource quantities ("500m", "2Gi") for resourceFieldRef env."""
from __future__ import annotations

import math
from decimal import Decimal

_SUFFIX = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}


def parse(q: str | int | float) -> Decimal:
    s = str(q).strip()
    for suffix in sorted(_SUFFIX, key=len, reverse=True):
        if suffix and s.endswith(suffix):
            return Decimal(s[: -len(suffix)]) * Decimal(_SUFFIX[suffix])
    return Decimal(s)


def divide_ceil(q: str, divisor: str | None) -> str:
    """The kubelet rounds value/divisor up to an integer."""
    value = parse(q) / parse(divisor or "1")
    return str(math.ceil(value))
