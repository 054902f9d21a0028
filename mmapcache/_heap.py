"""Heaps: where ragged fields' values live, packed back to back, and how a writer finds room for one.

One heap per ragged field (``<field>.heap``), its per-row ``[offset, nbytes, *shape]`` in ``<field>.index.npy``
and its four counters ``[end, capacity, abandoned, uncached]`` in ``heaps.u64`` (see ``_format``). Readers map a
heap at its size and map it again when they meet a value past their mapping; a heap never shrinks, so an old
mapping stays valid for everything it covers. Writers allocate under the cache's writer lock (``_filled``):
in place when the new value fits the row's previous extent, else at the end, growing the file with
``posix_fallocate`` first (never a sparse page a reader could fault on: SIGBUS on a full tmpfs). When the file
system or the cache's heap budget has no room, ``allocate`` returns None and the sample is served uncached.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading

import numpy as np

from ._files import open_file
from .errors import CacheFormatError

END, CAPACITY, ABANDONED, UNCACHED = range(4)
COUNTERS = 4
# Growth step: at least this, else an eighth of the capacity (so reserved-but-unused space stays under ~12.5%).
_MIN_EXTENT = 1 << 14
_PAGE = 4096


class Heap:
    """One ragged field's heap file, mapped for reading (and open for ``pwrite`` in a writable store).

    Thread-safe for readers: ``view`` may remap concurrently; every mapping made is kept until ``close``
    (values copied out of an older one are still valid: the heap only grows).
    """

    def __init__(self, directory: str, name: str, counters: np.ndarray, writable: bool) -> None:
        self.path = os.path.join(directory, name)
        self.counters = counters  # this heap's four uint64 counters (a view of heaps.u64)
        self.writable = writable
        try:
            self.fd = open_file(directory, name, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            raise CacheFormatError(f"{self.path} is missing; the cache is damaged: remove it (`mmapcache rm "
                                   f"--force {directory}`) and build it again") from None
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.buf = np.empty(0, np.uint8)
        self.size = 0
        self.remap()
        if int(counters[END]) > self.size:
            raise CacheFormatError(f"{self.path} has {self.size} bytes but its counters in heaps.u64 say "
                                   f"{int(counters[END])} are in use: the file is truncated; remove the cache and "
                                   "build it again")

    def remap(self) -> None:
        """Maps the heap at its current size, if it grew since the last mapping."""
        with self._lock:
            size = os.fstat(self.fd).st_size
            if size <= self.size:
                return
            m = mmap.mmap(self.fd, size, mmap.MAP_SHARED,
                          access=mmap.ACCESS_WRITE if self.writable else mmap.ACCESS_READ)
            self._maps.append(m)
            self.buf = np.frombuffer(m, np.uint8)
            self.size = size

    def covering(self, end: int) -> np.ndarray:
        """The mapped bytes, remapped if ``end`` lies past them (a value written after this process mapped)."""
        if end > self.size:
            self.remap()
        return self.buf

    # --- writing (caller holds the writer lock) ----------------------------------------------------------------

    def allocate(self, old_offset: int, old_nbytes: int, nbytes: int, align: int,
                 budget_left: int | None) -> int | None:
        """Where to write a value of ``nbytes`` for a row whose previous extent is ``(old_offset, old_nbytes)``.

        Returns the offset, or None when there is no room (``uncached`` is counted). Caller holds the writer lock.
        """
        c = self.counters
        end = int(c[END])
        if nbytes <= old_nbytes and old_offset >= 0 and old_offset + old_nbytes <= end:
            c[ABANDONED] += old_nbytes - nbytes  # the tail this row no longer uses
            return old_offset
        offset = -(-end // align) * align
        need = offset + nbytes
        capacity = int(c[CAPACITY])
        if need > capacity:
            grown = max(need, capacity + max(_MIN_EXTENT, capacity // 8))
            grown = -(-grown // _PAGE) * _PAGE
            if budget_left is not None:
                grown = min(grown, capacity + budget_left)
            if grown < need or not self._reserve(grown):
                c[UNCACHED] += 1
                return None
            c[CAPACITY] = grown
        c[END] = need
        if old_nbytes > 0 and old_offset >= 0 and old_offset + old_nbytes <= end:
            c[ABANDONED] += old_nbytes
        c[ABANDONED] += offset - end  # alignment padding
        return offset

    def _reserve(self, size: int) -> bool:
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                return False
            raise
        return True

    def write(self, offset: int, value: np.ndarray) -> None:
        """Copies a value's bytes to ``offset`` with ``pwrite`` (the kernel copies into the shared pages)."""
        view = np.ascontiguousarray(value).reshape(-1).view(np.uint8).data
        while view:
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.buf = np.empty(0, np.uint8)
        for m in self._maps:
            with contextlib.suppress(BufferError, ValueError):
                m.close()
        self._maps.clear()


def budget_left(counters: np.ndarray, budget: int | None) -> int | None:
    """Bytes the heaps may still reserve together (``heap_budget`` minus every heap's capacity), or None."""
    if budget is None:
        return None
    return max(0, budget - int(counters[:, CAPACITY].sum()))
