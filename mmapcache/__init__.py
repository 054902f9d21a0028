"""mmapcache: one shared, file-backed copy of a dataset's samples per machine, for every process that reads it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__
from .errors import (
    CacheFormatError,
    CacheInUseError,
    CacheMismatchError,
    CacheNotFoundError,
    CacheReadOnlyError,
    CacheReadOnlyWarning,
    DistributedOrderWarning,
    InsufficientSpaceError,
    LayoutError,
    MmapCacheError,
    SampleNotCachedError,
    SourceError,
    SpecError,
    StreamBypassWarning,
    StreamTimeoutError,
    UncachedFieldWarning,
    UnsupportedFileSystemError,
    UsageError,
    WorkerStartError,
)

__all__ = [
    "__version__",
    "MmapCachedDataset",
    "PadCollate",
    "Padded",
    "ShareSampler",
    "build",
    "BuildReport",
    "verify",
    "VerifyResult",
    "describe",
    "list_caches",
    "cache_root",
    "remove",
    "gc",
    "MmapCacheError",
    "CacheNotFoundError",
    "CacheFormatError",
    "CacheMismatchError",
    "CacheReadOnlyError",
    "CacheInUseError",
    "InsufficientSpaceError",
    "LayoutError",
    "SampleNotCachedError",
    "SpecError",
    "UnsupportedFileSystemError",
    "UsageError",
    "WorkerStartError",
    "SourceError",
    "StreamTimeoutError",
    "CacheReadOnlyWarning",
    "DistributedOrderWarning",
    "StreamBypassWarning",
    "UncachedFieldWarning",
]

if TYPE_CHECKING:  # what the lazy names below are, for type checkers
    from ._admin import gc, remove
    from ._build import build
    from ._driver import BuildReport
    from ._paths import cache_root
    from ._report import describe, list_caches
    from ._sampler import ShareSampler
    from ._verify import VerifyResult, verify
    from .collate import PadCollate, Padded
    from .dataset import MmapCachedDataset

# Loaded lazily (PEP 562): the dataset module imports torch, and the others need not be paid for by a script
# that only opens a cache, so `mmapcache inspect` starts without importing torch.
_LAZY = {
    "MmapCachedDataset": "dataset",
    "PadCollate": "collate",
    "Padded": "collate",
    "ShareSampler": "_sampler",
    "build": "_build",
    "BuildReport": "_driver",
    "verify": "_verify",
    "VerifyResult": "_verify",
    "describe": "_report",
    "list_caches": "_report",
    "cache_root": "_paths",
    "remove": "_admin",
    "gc": "_admin",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
