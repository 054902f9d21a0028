"""Slot state: the filled and stale bitmaps, the per-row seqlock counters, the keys and the cache-wide counter.

This is the only module that takes the writer lock (``store.lock``) or changes the state files (see ``format.spec``
for their layout).

Publication protocol (a writer storing row ``r`` for source index ``key``), all under the writer lock:
  1. re-check: a filled, non-stale row with an even counter is left alone (someone else stored it);
  2. ``seq[r]`` becomes odd; 3. the row's bytes are written (heap room is found first: with none, the counter
  is put back and nothing was written), then ``keys[r] = key``; 4. ``seq[r]`` becomes even;
  5. the filled bit is set and the stale bit cleared.
Readers take no lock: a row is read if its filled bit is set and its counter is even, and the copy is kept only
if the counter did not change meanwhile. A writer killed between 2 and 4 leaves an odd counter, which the next
writer (holding the lock, so it knows nobody is mid-write) treats as "not filled".

Memory ordering: row bytes are stored before the counter and bit stores, and readers load the bit and counter
before the bytes. On x86-64 (total store order) that program order is what other processes observe; the flock
system calls around every write are full barriers on the writer side.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ..errors import CacheFormatError, CacheReadOnlyError
from ..format.spec import CHANGES, CHANGES_WORDS, FILLED, KEYS, SEQ, STALE
from .files import open_file
from .lock import WriterLock

T = TypeVar("T")
Publication = tuple[int, int, Callable[[bool], None]]  # (row, key, write(owned)): one row for publish_many


class NoRoom(Exception):
    """Raised by a row's ``write`` before it writes anything, and then by ``publish``: a heap has no room for the
    value (the sample is served uncached)."""


class Declined(Exception):
    """Raised by a batch's ``write`` before it writes anything, and then by ``publish_rows``: the batch cannot be
    stored at once as its rows would be one at a time (``RowWriter.write_new_rows``); nothing was changed, and the
    caller publishes the rows one by one (``publish_many``)."""


def bitmap_bytes(rows: int) -> int:
    return (rows + 7) // 8


class SlotState:
    """The mapped state files of one cache (see ``format.spec``): filled bits, stale bits and seqlock counters.

    Safe across processes: readers are lock-free, writers go through ``publish``/``mark_stale``, which take the
    writer lock. Attribute access to the memoryviews is the warm read path; keep it free of calls.
    """

    def __init__(self, directory: str, rows: int, writable: bool) -> None:
        self.rows = rows
        self.writable = writable
        self.directory = directory
        self.lock = WriterLock(directory)
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        nbits = bitmap_bytes(rows)
        self._maps = [
            map_exact(directory, name, size, access, writable)
            for name, size in ((FILLED, nbits), (STALE, nbits), (SEQ, 4 * rows), (KEYS, 8 * rows),
                               (CHANGES, 8 * CHANGES_WORDS))
        ]
        filled_map, stale_map, seq_map, keys_map, changes_map = self._maps
        # memoryviews index ~3x faster than numpy scalars; numpy views serve the vectorised paths.
        self.filled = memoryview(filled_map)
        self.stale = memoryview(stale_map)
        self.seq = memoryview(seq_map).cast("I")
        self.filled_np = np.frombuffer(filled_map, np.uint8)
        self.stale_np = np.frombuffer(stale_map, np.uint8)
        self.seq_np = np.frombuffer(seq_map, "<u4")
        self.keys = memoryview(keys_map).cast("q")
        self.keys_np = np.frombuffer(keys_map, "<i8")
        # changes.u64: [changes, complete] (see _format): the cache-wide seqlock of the warm path's fast check.
        self.changes = memoryview(changes_map).cast("Q")
        # Counts kept beside these files that a writer killed mid-change may leave off what they count (a heap's
        # free counter): each recounts one, under the lock, when a change finds the last one interrupted.
        self.recounts: list[Callable[[], None]] = []

    # --- reading (lock-free) -----------------------------------------------------------------------------------

    def is_filled(self, row: int) -> bool:
        return bool(self.filled[row >> 3] >> (row & 7) & 1) and not self.seq[row] & 1

    def filled_rows(self, rows: np.ndarray, keys: np.ndarray | None = None) -> np.ndarray:
        """Boolean mask of the given rows that hold a complete sample (filled bit set, counter even), and with
        ``keys`` the sample of that key (where rows change meaning: a rotating share, the stream)."""
        bits = (self.filled_np[rows >> 3] >> (rows & 7).astype(np.uint8)) & 1
        filled = (bits == 1) & (self.seq_np[rows] & 1 == 0)
        if keys is not None:
            filled &= self.keys_np[rows] == keys
        return filled

    def stale_rows(self, rows: np.ndarray) -> np.ndarray:
        return ((self.stale_np[rows >> 3] >> (rows & 7).astype(np.uint8)) & 1) == 1

    def all_complete(self) -> int:
        """The cache-wide counter if every row is complete (filled, even, not stale) and no writer is changing
        rows, else -1. A reader that copies rows and then finds ``changes[0]`` still equal to it needs no per-row
        check: nothing was written meanwhile (the fast path of ``RowReader.gather``)."""
        changes = self.changes
        counter = changes[0]
        if counter & 1 or changes[1] != self.rows:
            return -1
        return counter

    def complete_rows(self) -> int:
        """Rows that are complete: filled bit set, counter even (no writer mid-write), not stale."""
        odd = (self.seq_np & 1).astype(bool)
        return int((self.filled_mask() & ~odd & ~self.stale_mask()).sum())

    def _begin_change_locked(self) -> None:
        """Marks the cache as being changed (``changes[0]`` odd). Caller holds the writer lock. An odd counter
        found here is a writer that died mid-change: what it may have left half changed is recounted first."""
        counter = self.changes[0]
        if counter & 1:
            self._recount_locked()
        self.changes[0] = counter | 1

    def _recount_locked(self) -> None:
        """After a writer died mid-change (``changes[0]`` found odd under the lock): the words it may have left
        apart, which readers or ``verify`` compare, are taken again from what they count (the complete rows from
        the bits; a heap's free counter from its lists, through ``recounts``). Every change of several words
        happens inside a change window, so an even counter says they agree. Caller holds the writer lock."""
        self.changes[1] = self.complete_rows()
        for recount in self.recounts:
            recount()

    def _end_change_locked(self) -> None:
        self.changes[0] = (self.changes[0] + 1) & 0xFFFFFFFFFFFFFFFF  # wraps (from a damaged odd 2**64 - 1)

    def filled_mask(self) -> np.ndarray:
        """Boolean array over all rows: filled bit set."""
        return np.unpackbits(self.filled_np, bitorder="little", count=self.rows).astype(bool)

    def owned_mask(self) -> np.ndarray:
        """Boolean array over all rows: written whole (counter even and not 0), so the heap extents its index
        records are the row's own, to reuse or free, filled bit or not (a row whose writer died is odd, and owns
        nothing: see ``publish``)."""
        seq = self.seq_np
        return (seq & 1 == 0) & (seq != 0)

    def stale_mask(self) -> np.ndarray:
        return np.unpackbits(self.stale_np, bitorder="little", count=self.rows).astype(bool)

    def count_filled(self) -> int:
        return int(np.unpackbits(self.filled_np, bitorder="little", count=self.rows).sum())

    def check_consistency(self, where: str) -> None:
        """Detects damaged state files: bits past the end, or filled rows that were never written."""
        extra = self.rows % 8
        for name, bits in ((FILLED, self.filled_np), (STALE, self.stale_np)):
            if extra and len(bits) and bits[-1] >> extra:
                raise CacheFormatError(
                    f"{where}/{name}: bits are set past row {self.rows}, the cache's size; the file is damaged: "
                    f"remove the cache (`mmapcache rm --force {where}`) and build it again"
                )
        counter = self.changes[0]
        filled = self.filled_mask()
        never_written = filled & (self.seq_np == 0)
        if never_written.any():
            rows = np.flatnonzero(never_written)
            raise CacheFormatError(
                f"{where}/{FILLED}: {len(rows)} row(s) (first: {rows[0]}) are marked filled but were never written "
                f"(their counter in {SEQ} is 0); the file is damaged: remove the cache (`mmapcache rm --force "
                f"{where}`) and build it again"
            )
        # The count of complete rows lets a reader of a complete cache skip every per-row check: a count that is
        # too high would serve empty rows. Exact whenever no writer is mid-change (an even counter, unchanged
        # during the count); a writer that died mid-change left it odd, and the next writer counts again.
        if not counter & 1:
            complete = int((filled & (self.seq_np & 1 == 0) & ~self.stale_mask()).sum())
            if self.changes[0] == counter and self.changes[1] != complete:
                raise CacheFormatError(
                    f"{where}/{CHANGES}: it counts {self.changes[1]} complete rows, but {complete} rows are filled, "
                    f"not stale and not being written; the file is damaged: remove the cache (`mmapcache rm --force "
                    f"{where}`) and build it again"
                )

    # --- writing (under the writer lock) -----------------------------------------------------------------------

    def check_writable(self) -> None:
        """Raises ``CacheReadOnlyError`` if this process cannot write the cache."""
        self._require_writable()

    def _require_writable(self) -> None:
        if not self.writable:
            raise CacheReadOnlyError(
                "this process opened the cache read-only (no write permission on its files, or a read-only mount)"
            )

    def under_lock(self, change: Callable[[], T]) -> T:
        """Runs ``change()`` under the writer lock and returns its result: for state kept beside these files and
        changed under the same lock (the stream ring's counters, ``store.ring``). Safe across processes and threads."""
        self._require_writable()
        with self.lock:
            return change()

    def still(self, look: Callable[[], T]) -> T:
        """Runs ``look()`` under the writer lock, on a read-only opening too, and returns its result: no writer
        changes the state files, the heaps or the ring meanwhile, so a check that reads several of them together
        (``verify``) sees one moment of the cache, not a writer's change half made. Writers wait for it: keep
        ``look`` short (no source calls). Safe across processes and threads."""
        with self.lock:
            return look()

    def publish(self, row: int, key: int, write: Callable[[bool], None],
                wanted: Callable[[], bool] | None = None) -> bool:
        """Stores row ``row`` (holding source index ``key``) by calling ``write(owned)`` under the lock, unless it is
        already filled with ``key`` and not stale. ``owned`` says whether the row's previous bytes are intact
        (its counter was even and it had been written): only then are its old heap extents its own to reuse or
        free. ``write`` may raise ``NoRoom`` (a full heap) or ``CacheFormatError`` (a damaged heap) before writing
        anything: the row is then left as it was, and the exception propagates (for ``NoRoom``, the caller serves
        the sample uncached, and counts it). ``wanted``, if
        given, is asked under the lock first: False leaves the row alone (a stream position its reader has
        passed). Returns whether this call stored the row. Safe across processes and threads."""
        if not self.writable:
            self._require_writable()
        with self.lock:
            if wanted is not None and not wanted():
                return False
            # _begin_change_locked and _end_change_locked, inlined: this is every single miss's path.
            changes = self.changes
            counter = changes[0]
            if counter & 1:
                self._recount_locked()
            changes[0] = counter | 1
            try:
                return self._publish_locked(row, key, write)
            finally:
                changes[0] = (changes[0] + 1) & 0xFFFFFFFFFFFFFFFF

    def publish_many(self, items: list[Publication], no_room: list[int] | None = None,
                     wanted: Callable[[np.ndarray], np.ndarray] | None = None) -> int:
        """``publish`` for several ``(row, key, write)`` under one acquisition of the lock (a batch's misses);
        rows without heap room (``NoRoom``) are skipped (and added to ``no_room``). ``wanted`` as for
        ``publish_rows``. Returns how many this call stored. Safe across processes and threads."""
        self._require_writable()
        stored = 0
        with self.lock:
            if wanted is not None and items:
                mask = wanted(np.array([key for _, key, _ in items], np.int64))
                items = [item for item, keep in zip(items, mask.tolist()) if keep]
            self._begin_change_locked()
            try:
                for row, key, write in items:
                    try:
                        stored += self._publish_locked(row, key, write)
                    except NoRoom:
                        if no_room is not None:
                            no_room.append(row)
            finally:
                self._end_change_locked()
        return stored

    def publish_rows(self, rows: np.ndarray, keys: np.ndarray, write: Callable[[np.ndarray], None],
                     wanted: Callable[[np.ndarray], np.ndarray] | None = None, *, new_only: bool = False) -> int:
        """``publish`` for many distinct rows at once, each step vectorised (a batch's misses): under one lock,
        the rows still to store (not complete, or holding another key) get odd counters, ``write(positions)``
        writes the rows ``rows[positions]``, then keys, even counters and bits are set for all of them.
        ``wanted(keys)``, if given, is asked under the lock first: rows where it is False are left alone (a
        stream's positions its readers have passed). Returns how many were stored. Safe across processes and
        threads.

        ``write`` may refuse before it writes anything, by raising ``Declined``, ``NoRoom`` or ``CacheFormatError``:
        the rows are then left as they were, and the exception propagates. With ``new_only`` (ragged values
        packed at the heaps' ends: ``RowWriter.write_new_rows``), ``Declined`` is also raised if a row to store
        owns heap extents (see ``publish``), which ``write`` would have to reuse or free."""
        self._require_writable()
        with self.lock:
            self._begin_change_locked()
            try:
                candidates = np.arange(len(rows)) if wanted is None else np.flatnonzero(wanted(keys))
                rows, keys = rows[candidates], keys[candidates]
                bits = 1 << (rows & 7).astype(np.uint8)
                byte = rows >> 3
                seq = self.seq_np[rows]
                complete = ((self.filled_np[byte] & bits) != 0) & (seq & 1 == 0) & ((self.stale_np[byte] & bits) == 0)
                todo = np.flatnonzero(~complete | (self.keys_np[rows] != keys))
                if not len(todo):
                    return 0
                rows, seq, bits, byte = rows[todo], seq[todo], bits[todo], byte[todo]
                if new_only and np.any((seq & 1 == 0) & (seq != 0)):
                    raise Declined
                self.seq_np[rows] = seq | 1
                try:
                    write(candidates[todo])
                except (Declined, NoRoom, CacheFormatError):
                    self.seq_np[rows] = seq  # refused before anything was written: the rows stay what they were
                    raise
                self.keys_np[rows] = keys[todo]
                even = (seq | 1) + np.uint32(1)
                self.seq_np[rows] = np.where(even == 0, np.uint32(2), even)  # 0 means "never written"
                np.bitwise_or.at(self.filled_np, byte, bits)
                np.bitwise_and.at(self.stale_np, byte, ~bits)
                self.changes[1] += int((~complete[todo]).sum())
                return len(todo)
            finally:
                self._end_change_locked()

    def _publish_locked(self, row: int, key: int, write: Callable[[bool], None]) -> bool:
        """Caller holds the writer lock."""
        counters, filled_bits, stale_bits = self.seq, self.filled, self.stale
        byte, mask = row >> 3, 1 << (row & 7)
        seq = counters[row]
        filled = bool(filled_bits[byte] & mask) and not seq & 1  # odd: a writer died mid-write
        complete = filled and not stale_bits[byte] & mask
        if complete and self.keys[row] == key:
            return False
        counters[row] = (seq | 1) & 0xFFFFFFFF
        try:
            write(not seq & 1 and seq != 0)
        except (NoRoom, CacheFormatError):
            counters[row] = seq  # refused before anything was written: the row stays what it was
            raise
        self.keys[row] = key
        counters[row] = ((seq | 1) + 1) & 0xFFFFFFFF or 2  # wraps past 0 to 2: 0 means "never written"
        filled_bits[byte] |= mask
        stale_bits[byte] &= ~mask & 0xFF
        if not complete:  # (a row rewritten for another key was complete before, and still is)
            self.changes[1] += 1
        return True

    def empty_locked(self, rows: np.ndarray, release: Callable[[np.ndarray], None]) -> None:
        """Unfills ``rows`` (distinct, each owned: its counter even and not 0) and calls ``release(rows)`` to give
        back what they own, inside their seqlock window: a reader copying one retries, then finds it unfilled. The
        caller holds the writer lock, in a change window (``publish``'s ``write``). A writer killed here leaves
        the rows odd and unfilled (their extents lost, never handed to two rows; see ``publish``)."""
        if not len(rows):
            return
        seq = self.seq_np[rows]
        bits, byte = (1 << (rows & 7)).astype(np.uint8), rows >> 3
        complete = ((self.filled_np[byte] & bits) != 0) & ((self.stale_np[byte] & bits) == 0)
        self.seq_np[rows] = seq | 1
        np.bitwise_and.at(self.filled_np, byte, ~bits)
        release(rows)
        even = (seq | 1) + np.uint32(1)
        self.seq_np[rows] = np.where(even == 0, np.uint32(2), even)
        self.changes[1] -= int(complete.sum())

    def mark_stale(self, rows: np.ndarray) -> int:
        """Marks the given rows stale (only those that are filled). Returns how many were newly marked."""
        self._require_writable()
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        with self.lock:
            self._begin_change_locked()
            try:
                filled = self.filled_mask()[rows]
                stale = self.stale_mask()
                targets = rows[filled & ~stale[rows]]
                stale[targets] = True
                self.stale_np[:] = np.packbits(stale, bitorder="little")
                self.changes[1] = self.complete_rows()
            finally:
                self._end_change_locked()
        return len(targets)

    def close(self) -> None:
        self.lock.close()
        # Views must go before their maps can close; a map still exported elsewhere stays open until collected. In
        # their place, what says so to a reader still at work on the closed cache (a loader another thread
        # iterates while this one closes the dataset). (Not a __getattr__: a class with one has every attribute
        # read unspecialised, and these are the warm read path's.)
        closed = _Closed(self.directory)
        self.filled = self.stale = self.seq = self.keys = self.changes = closed  # type: ignore[assignment]
        self.filled_np = self.stale_np = self.seq_np = self.keys_np = closed  # type: ignore[assignment]
        for m in self._maps:
            with contextlib.suppress(BufferError):
                m.close()
        self._maps = []


class _Closed:
    """A closed cache's state views: any index into one raises, saying the cache was closed under the reader."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __getitem__(self, key: Any) -> Any:
        raise ValueError(f"the cache at {self.directory} was closed (ds.close()) while this process still read or "
                         "filled it (a loader in another thread?): close it after the loops that read it; a new pass "
                         "opens it again")

    def __setitem__(self, key: Any, value: Any) -> None:
        self[key]

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        return self[None]


# (whatever a state method does with a view: numpy's conversions, comparisons, bit operations)
for _name in ("__array__", "__len__", "__iter__", "__eq__", "__ne__", "__and__", "__rand__", "__or__", "__ror__",
              "__rshift__", "__lshift__", "__invert__", "__getattr__"):
    setattr(_Closed, _name, _Closed._refuse)


def map_exact(directory: str, name: str, size: int, access: int, writable: bool) -> mmap.mmap:
    """Maps a state file, checking it has exactly the expected size."""
    path = os.path.join(directory, name)
    try:
        fd = open_file(directory, name, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        raise CacheFormatError(f"{path} is missing; the cache is damaged: remove it and build it again") from None
    try:
        found = os.fstat(fd).st_size
        if found != size:
            raise CacheFormatError(
                f"{path} has {found} bytes, expected {size}; the file is truncated or damaged: remove the cache "
                "(`mmapcache rm --force`) and build it again"
            )
        return mmap.mmap(fd, size, mmap.MAP_SHARED, access=access) if size else mmap.mmap(-1, 1)
    finally:
        os.close(fd)
