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
    CacheRemovedWarning,
    DistributedOrderWarning,
    InsufficientSpaceError,
    LayoutError,
    MmapCacheError,
    SampleNotCachedError,
    SourceError,
    SpecError,
    StreamBypassWarning,
    StreamPositionWarning,
    StreamTimeoutError,
    UncachedFieldWarning,
    UnsupportedFileSystemError,
    UsageError,
    WorkerStartError,
)

__all__ = [
    "__version__",
    "MmapCachedDataset",
    "Mixture",
    "PadCollate",
    "Padded",
    "TextCollate",
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
    "CacheRemovedWarning",
    "DistributedOrderWarning",
    "StreamBypassWarning",
    "StreamPositionWarning",
    "UncachedFieldWarning",
]

if TYPE_CHECKING:  # what the lazy names below are, for type checkers
    from .admin.report import describe, list_caches
    from .admin.verify import VerifyResult, verify
    from .dataset import MmapCachedDataset
    from .fill.build import build
    from .fill.driver import BuildReport
    from .mixture import Mixture
    from .read.collate import PadCollate, Padded
    from .read.sampler import ShareSampler
    from .read.text_collate import TextCollate
    from .store.admin import gc, remove
    from .store.paths import cache_root

# Loaded lazily (PEP 562): the dataset module imports torch, and the others need not be paid for by a script
# that only opens a cache, so `mmapcache inspect` starts without importing torch.
_LAZY = {
    "MmapCachedDataset": "dataset",
    "Mixture": "mixture",
    "PadCollate": "read.collate",
    "Padded": "read.collate",
    "ShareSampler": "read.sampler",
    "TextCollate": "read.text_collate",
    "build": "fill.build",
    "BuildReport": "fill.driver",
    "verify": "admin.verify",
    "VerifyResult": "admin.verify",
    "describe": "admin.report",
    "list_caches": "admin.report",
    "cache_root": "store.paths",
    "remove": "store.admin",
    "gc": "store.admin",
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
