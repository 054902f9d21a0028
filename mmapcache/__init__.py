"""mmapcache: one shared, file-backed copy of a dataset's samples per machine, for every process that reads it."""

from __future__ import annotations

__version__ = "0.1.0"

from .dataset import CacheReadOnlyWarning, MmapCachedDataset
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
