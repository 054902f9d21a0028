"""A stream's controls on its dataset: whether it is one, its counters, its producers (``produce``) and its reading
side for the loader. A mixin of ``MmapCachedDataset``: the methods are the dataset's public API for ``stream=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import SampleNotCachedError, UsageError
from ..read.reader import RowReader
from ..read.stream import StreamReads
from ..store.ring import Ring, producers_of
from .producer import Producer, SourceFactory

__all__ = ["StreamControls"]


class StreamControls:
    """The stream methods of ``MmapCachedDataset`` (see the module docstring)."""

    path: str
    dataset: Any
    check_finite: bool
    _ring: Ring | None
    _streams: StreamReads | None

    _ensure_open: Callable[[], RowReader]

    @property
    def stream(self) -> bool:
        """Whether this is a stream (``stream=True``): read it through ``ds.loader()``."""
        return self._ensure_open() is not None and self._ring is not None

    @property
    def stream_stats(self) -> dict[str, Any]:
        """A stream's counters (``store.ring``): values ``produced``, ``served`` from the ring, ``computed`` by readers
        (the producer was behind), ``waited`` seconds, ``skipped`` (produced too late), positions ``ahead`` (ready
        in the ring past the slowest reader), and the ``producers`` running. Safe across processes."""
        ring = self._stream_ring()
        stats: dict[str, Any] = ring.stats()
        stats["waited"] = stats.pop("waited_ns") / 1e9
        stats["producers"] = producers_of(self.path)
        return stats

    def produce(self, workers: int = 1, *, context: Any = None) -> Producer:
        """Starts ``workers`` producer processes filling this stream's ring ahead of its readers, from this
        dataset's source; returns a handle (``stop()``, or use it as a context manager). Producers stop by
        themselves when the cache is removed. See ``mmapcache._producer``."""
        self._stream_ring()
        if self.dataset is None:
            raise SampleNotCachedError(f"produce() needs the source dataset: open the stream at {self.path} with "
                                       "MmapCachedDataset(path, dataset, stream=True)")
        return Producer.start(self.path, SourceFactory(self.dataset), workers, context, self.check_finite)

    def _stream_ring(self) -> Ring:
        self._ensure_open()
        if self._ring is None:
            raise UsageError(f"the cache at {self.path} is not a stream; open it with stream=True (a new path)")
        return self._ring

    def stream_reads(self) -> StreamReads:
        """The reading side of this stream in this process (``read.stream.StreamReads``), for ``ds.loader``."""
        self._stream_ring()
        assert self._streams is not None  # made with the ring
        return self._streams
