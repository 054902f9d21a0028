"""mmapcache: one shared, file-backed copy of a dataset's samples per machine, for every process that reads it."""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import (
    CacheFormatError,
    CacheMismatchError,
    CacheNotFoundError,
    CacheReadOnlyError,
    InsufficientSpaceError,
    LayoutError,
    MmapCacheError,
    SampleNotCachedError,
)

__all__ = [
    "__version__",
    "MmapCachedDataset",
    "CacheReadOnlyWarning",
    "MmapCacheError",
    "CacheNotFoundError",
    "CacheFormatError",
    "CacheMismatchError",
    "CacheReadOnlyError",
    "InsufficientSpaceError",
    "LayoutError",
    "SampleNotCachedError",
]

# The dataset module imports torch; loading it lazily (PEP 562) lets numpy-only users of the store, such as
# `mmapcache inspect`, import the package without paying for torch.
_LAZY = {"MmapCachedDataset": "dataset", "CacheReadOnlyWarning": "dataset"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
