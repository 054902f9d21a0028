"""Human-readable byte sizes: parsing ``8G``/``512M`` and printing ``1.5 GiB``."""

from __future__ import annotations

import re
from typing import Any

_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(value: Any, name: str = "size") -> int:
    """Bytes from an int or a string like ``"8G"``, ``"512M"``, ``"1.5GiB"``, ``"1000000"`` (binary units)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a byte count or a size like '8G', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match:
            size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
            if size > 0:
                return size
        raise ValueError(f"{name}={value!r} is not a size; write a byte count or a number with K, M, G or T (e.g. '8G')")
    raise TypeError(f"{name} must be a byte count or a size like '8G', got {type(value).__name__}")


def format_size(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
