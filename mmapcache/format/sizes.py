"""Human-readable byte sizes: parsing ``8G``/``512M`` and printing ``1.5 GiB``."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
# ASCII digits only ([0-9], not \d, which also matches '١٠٠٠'); the prefix in either case, an optional 'i' after
# it, and the byte unit 'B' in upper case only: a lower-case 'b' conventionally means bits.
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([KMGTkmgt])([iI]?))?(B?)\s*$")
_BITS = re.compile(r"^\s*([0-9.]+)\s*([KMGTkmgt]?)[iI]?b\s*$")


def parse_size(value: Any, name: str = "size") -> int:
    """Bytes from an integer (Python or numpy) or a string like ``"8G"``, ``"512M"``, ``"1.5GiB"``, ``"1000000"``.

    Units are binary (``K`` = 1024). A lower-case ``b`` (``"8Gb"``) is refused: bits or bytes would be a guess.

    Raises:
        TypeError: not an integer or a string (bools are refused too).
        ValueError: not positive, or not a size.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a byte count or a size like '8G', got {value!r}")
    if isinstance(value, (int, np.integer)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
        return int(value)
    if isinstance(value, str):
        bits = _BITS.match(value)
        if bits:
            meant = bits.group(1) + bits.group(2).upper()
            raise ValueError(f"{name}={value!r}: a lower-case 'b' means bits to some and bytes to others; for bytes "
                             f"write '{meant}' or '{meant}B' (binary units: '8G' and '8GB' both mean 8 GiB)")
        match = _SIZE.match(value)
        if match and (match.group(2) or not match.group(3)):  # an 'i' needs a prefix: '8iB' is a typo
            size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
            if size > 0:
                return size
        raise ValueError(f"{name}={value!r} is not a size; write a byte count, or a number with K, M, G or T, "
                         "in ASCII digits (e.g. '8G')")
    raise TypeError(f"{name} must be a byte count or a size like '8G', got {type(value).__name__}")


def format_size(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
