"""The exception hierarchy of mmapcache.

Every exception is constructible from one message string, because DataLoader workers re-raise a worker's
exception in the main process as ``type(exc)(message)`` (``torch/_utils.py``, ``ExceptionWrapper.reraise``).
Messages say what went wrong, where (file, index, field path), what was found versus expected, and the fix.
Each class also inherits the builtin exception a caller would naturally catch.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "MmapCacheError",
    "CacheNotFoundError",
    "CacheFormatError",
    "CacheMismatchError",
    "CacheReadOnlyError",
    "InsufficientSpaceError",
    "SampleNotCachedError",
    "LayoutError",
    "SpecError",
    "CacheInUseError",
    "UnsupportedFileSystemError",
    "UsageError",
    "WorkerStartError",
    "SourceError",
    "StreamTimeoutError",
    "CacheReadOnlyWarning",
    "CacheRemovedWarning",
    "DistributedOrderWarning",
    "StreamBypassWarning",
    "UncachedFieldWarning",
]


class MmapCacheError(Exception):
    """Base class of every error raised by mmapcache."""


class CacheNotFoundError(MmapCacheError, FileNotFoundError):
    """No cache exists at the given path (and none could be created: no source dataset was given)."""


class CacheFormatError(MmapCacheError, ValueError):
    """The path is not a cache, or its files are damaged, truncated or of an unknown format version."""


class CacheMismatchError(MmapCacheError, ValueError):
    """An existing cache was made from a different source: length, fingerprint, layout or options differ."""


class CacheReadOnlyError(MmapCacheError, PermissionError):
    """The cache cannot be written by this process (file mode or a read-only mount)."""


class InsufficientSpaceError(MmapCacheError, OSError):
    """The file system holding the cache has too little free space to reserve it."""


class SampleNotCachedError(MmapCacheError, KeyError):
    """A sample was asked of a cache opened without a source dataset, and it is not filled."""

    def __str__(self) -> str:
        # KeyError.__str__ repr()s its argument, which would wrap the message in quotes.
        return str(self.args[0]) if self.args else ""


class LayoutError(MmapCacheError, TypeError):
    """A sample cannot be stored: an unsupported leaf type, or a layout that differs from the cache's."""


class SpecError(MmapCacheError, ValueError):
    """A dataset spec cannot be imported, is not callable, raised, or returned something that is not a dataset."""


class CacheInUseError(MmapCacheError, OSError):
    """A cache cannot be removed because processes use it (``users`` lists their pids); ``force=True`` removes
    it anyway (they keep reading the pages they mapped)."""

    def __init__(self, message: str, *, users: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.users = tuple(users)

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only attributes survive pickling (DataLoader workers, multiprocessing).
        return (_rebuild_in_use, (str(self), self.users))


def _rebuild_in_use(message: str, users: tuple[int, ...]) -> CacheInUseError:
    return CacheInUseError(message, users=users)


class UnsupportedFileSystemError(MmapCacheError, OSError):
    """The file system cannot hold a cache (no shared memory maps, or the parent is not a directory)."""



class UsageError(MmapCacheError, ValueError):
    """A problem with the command line or a library argument given as text; printed as one line, exit status 2."""


class WorkerStartError(MmapCacheError, RuntimeError):
    """DataLoader workers cannot be started with this dataset (e.g. ``spawn`` cannot import what an interactive
    ``__main__`` defines)."""


class SourceError(MmapCacheError, RuntimeError):
    """The source dataset raised where the library, not the caller, asked it for a sample (``build`` opening a
    cache; the source's exception is chained as ``__cause__``), or returned samples that cannot be stored safely
    (one output buffer that several DataLoader workers refill at once)."""


class StreamTimeoutError(MmapCacheError, TimeoutError):
    """A stream reader with ``on_miss="wait"`` waited longer than its timeout for a producer; the message says
    whether one is running (and its pids)."""


class StreamBypassWarning(UserWarning):
    """Readers of a stream compute its samples instead of reading what producers put in its ring: it was read by
    index (``ds[i]``, ``DataLoader(ds)``; read a stream through ``ds.loader()``), or its ring is too small for the
    loader's batches (create it with a larger ``max_bytes``)."""


class StreamPositionWarning(UserWarning):
    """A stream's reader went on from where it had stopped, not from the earlier epoch ``set_epoch`` asked for: a
    stream serves each computation once, and the epochs it has passed are gone. The message says how to start
    over (remove the stream) or to resume a job exactly (load its loader state)."""


class DistributedOrderWarning(UserWarning):
    """``ds.loader()`` in a distributed job with an order that cannot split the data across ranks (a sampler that
    gives every rank the whole dataset), or that repeats the last epoch's order (no ``set_epoch`` between two
    epochs), or over a node share without its sampler (``ds.sampler()``): the message names the fix."""


class CacheReadOnlyWarning(UserWarning):
    """Misses are served from the source but cannot be stored (the cache is read-only for this process)."""


class CacheRemovedWarning(UserWarning):
    """The cache was removed (``mmapcache rm --force``) or replaced while this process read it: what this process had
    mapped is still served, and the samples it lacks are computed from the source and served, not stored (nobody
    else could read them). Warned once per cache and process; open the dataset again to cache anew."""


class UncachedFieldWarning(UserWarning):
    """A ragged field's heap has no room left (the file system, or the cache's ``max_bytes``): samples that need
    room are served from the source, uncached. Warned once per field and process; ``mmapcache inspect`` counts
    them."""


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first caller outside this package (the user's line, whichever internal
    path led here: ``ds[i]``, ``ds.loader``, a build worker)."""
    import sys
    import warnings

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame: Any = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
