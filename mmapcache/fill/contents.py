"""What a dataset can ask of, and do to, its cache's contents: which samples are cached or missing, filling them
(``fill``, ``prefill``) and marking them for recomputation (``refresh``). A mixin of ``MmapCachedDataset``: the
methods are the dataset's public API, written beside the miss path they drive."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import CacheFormatError, SampleNotCachedError
from ..read.reader import RowReader
from ..store.heap import UNCACHED
from ..store.rows import RowMap, check_index, check_indices
from .misses import Misses, removed_message
from .prefill import DEFAULT_PATIENCE, prefill

_FIRST_BATCH = 8  # samples in fill()'s first batch, which times the source
_BATCH_SECONDS = 0.5  # and the source's time a later batch takes at most

__all__ = ["CacheContents"]


class CacheContents:
    """The cache-content methods of ``MmapCachedDataset`` (see the module docstring). Safe across processes."""

    path: str
    dataset: Any
    seed: int
    _rows: RowMap
    _length: int
    _epoch_view: memoryview
    _misses: Misses

    _ensure_open: Callable[[], RowReader]
    _where: Callable[[], str]

    def is_cached(self, index: int) -> bool:
        """Whether sample ``index`` (for the current epoch's variant) is filled. Safe across processes."""
        reader = self._ensure_open()
        index = check_index(index, self._length, self._where())
        row = self._rows.row(index, self._epoch_view[0])
        state = reader.state
        return row >= 0 and state.is_filled(row) and (not self._rows.keyed or state.keys[row] == index) and not (
            reader.recompute_stale and state.stale[row >> 3] >> (row & 7) & 1)

    @property
    def num_cached(self) -> int:
        """How many samples ``is_cached`` (their current epoch's variant is filled, and not stale with
        ``stale="recompute"``). Safe across processes; costs a scan of the cacheable samples."""
        reader = self._ensure_open()
        epoch = self._epoch_view[0]
        idx = self._rows.cacheable(epoch)
        rows = self._rows.rows_of(idx, epoch)
        cached = self._filled(reader, idx, rows)
        if reader.recompute_stale:
            cached &= ~reader.state.stale_rows(rows)
        return int(cached.sum())

    @property
    def uncached_by_heap(self) -> int:
        """How many times a sample passed through uncached because a ragged field's heap had no room (every
        access counts; ``max_bytes`` or the file system is full). Safe across processes."""
        return int(self._ensure_open().store.heap_counters[:, UNCACHED].sum())

    @property
    def num_cacheable(self) -> int:
        """How many samples can be cached (all of them unless ``max_bytes``/``cache_indices`` limited it; 0 for a
        stream, which keeps no sample for good: ``stream_stats["slots"]`` is its ring's size)."""
        return self._rows.slots

    def lengths(self, field: str, epoch: int | None = None) -> np.ndarray:
        """Every sample's length in ``field``, as an int64 array of ``len(ds)``: the size of its value's first
        dimension (a token field's tokens; a ``str``'s UTF-8 bytes), read from the cache's index without reading a
        value, for the epoch's variant (default: the current epoch's). For token budgets, packing, and
        ``ds.loader(group_by_length=...)``. The stored values' lengths: a ``transform=`` that changes them (a
        random crop, truncation) is not seen.

        Raises:
            ValueError: no such field, a scalar field, or a stream (whose ring holds positions, not samples).
            SampleNotCachedError: a sample is not stored (a partial cache, or one not filled yet: ``ds.fill()``,
                ``ds.prefill()`` on every rank, or ``mmapcache build``).
        """
        from ..read.lengths import sample_lengths

        reader = self._ensure_open()
        if reader.store.meta["mode"] == "stream":
            raise ValueError(f"{self._where()} is a stream: its ring holds the next positions of each epoch, not "
                             "every sample, so it has no lengths to give")
        if self._rows.keyed:
            raise ValueError(f"{self._where()} is a rotating node share: its rows hold another generation's samples "
                             "each rotation, so it has no lengths of the dataset's samples to give")
        epoch = self._epoch_view[0] if epoch is None else int(epoch)
        return sample_lengths(reader, self._rows.rows_of(np.arange(self._length, dtype=np.int64), epoch), field,
                              self._where())

    def cacheable_indices(self) -> np.ndarray:
        """The source indices the cache can hold (this epoch's, for a rotating share), in slot order (int64)."""
        return self._rows.cacheable(self._epoch_view[0])

    def _filled(self, reader: RowReader, idx: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` (cacheable, of source indices ``idx``) hold their sample, their key checked where
        rows change meaning (a rotating share)."""
        return reader.state.filled_rows(rows, idx if self._rows.keyed else None)

    def missing_indices(self, indices: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """The cacheable ones among ``indices`` (default: all) whose current epoch's variant is not filled, or is
        stale. Safe across processes."""
        reader = self._ensure_open()
        epoch = self._epoch_view[0]
        idx = self._rows.cacheable(epoch) if indices is None else check_indices(indices, self._length, self._where())
        rows = self._rows.rows_of(idx, epoch)
        keep = rows >= 0
        idx, rows = idx[keep], rows[keep]
        return idx[~self._filled(reader, idx, rows) | reader.state.stale_rows(rows)] if len(rows) else idx

    def refresh(self, fraction: float | None = None, indices: Sequence[int] | None = None) -> int:
        """Marks filled samples stale so they are recomputed (on access, or by ``mmapcache build --follow``).

        Args:
            fraction: a random share of the filled rows to mark, in [0, 1] (seeded by ``seed`` and the epoch).
            indices: source indices to mark (all their variants).

        Returns the number of rows newly marked. Safe across processes; readers never see a half-rewritten sample.
        """
        reader = self._ensure_open()
        if (fraction is None) == (indices is None):
            raise TypeError("refresh() takes exactly one of fraction= or indices=")
        if indices is not None:
            rows = self._rows.all_rows_of(check_indices(indices, self._length, self._where()), self._epoch_view[0])
        else:
            number = (int, float, np.integer, np.floating)
            if isinstance(fraction, (bool, np.bool_)) or not isinstance(fraction, number) or not 0 <= fraction <= 1:
                raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
            filled = np.flatnonzero(reader.state.filled_mask())
            # Seeded by (seed, epoch) only, as documented: every DDP rank calling it marks the same rows.
            rng = np.random.default_rng([self.seed, self._epoch_view[0]])
            rows = rng.choice(filled, size=round(float(fraction) * len(filled)), replace=False)
        return reader.state.mark_stale(rows)

    def fill(self, indices: Sequence[int] | np.ndarray | None = None) -> int:
        """Computes and stores every not-yet-filled or stale sample among ``indices`` (default: all cacheable
        ones), in this process, for the current epoch's variant. Returns how many this call stored.

        Stale rows are rewritten too: with ``stale="serve"`` this is what replaces the previous version. Safe
        across processes (each row is published under the writer lock; readers never see a half-written row).

        Raises:
            CacheFormatError: the cache was removed (``mmapcache rm --force``), or replaced, while this process had
                it open: nothing stored here could be read by another process; open the dataset again.
        """
        reader = self._ensure_open()
        if reader.store.moved():
            raise CacheFormatError(removed_message(self.path))
        todo = self.missing_indices(indices)
        if self.dataset is None and len(todo):
            raise SampleNotCachedError(
                f"fill() needs the source dataset: {len(todo)} sample(s) of the cache at {self.path} are unfilled "
                f"or stale (first: {int(todo[0])}); open it with MmapCachedDataset(path, dataset)"
            )
        if len(todo):
            reader.state.check_writable()
        # Computed, checked and stored a batch at a time, as the loader's misses are (Misses.store_batch): one writer
        # lock per batch, not per row. A batch of about 4 MB: its buffers are reused from one batch to the next.
        # (Ragged values live in the heaps, their size unknown here: a batch of them is kept to the old chunk size.)
        # And of about _BATCH_SECONDS of the source's time at most, from a first batch of a few, growing at most
        # twofold: a batch is stored at its end, and a peer's prefill, which watches the rows fill, took a batch of
        # slow samples (1,024 of 0.1 s) for a dead peer and computed its share again. (A source that turns slow
        # mid-fill can still hold a batch past that: twice the last one's samples.)
        per_batch = max(1, min(64 if reader.ragged else 1024, (4 << 20) // max(1, reader.row_bytes)))
        epoch, stored, at, size = self._epoch_view[0], 0, 0, min(per_batch, _FIRST_BATCH)
        while at < len(todo):
            idx = todo[at:at + size]
            started = time.perf_counter()
            stored += self._misses.store_batch(idx, self._rows.rows_of(idx, epoch))
            took = time.perf_counter() - started
            at += len(idx)
            # (at most twice the last batch: a source fast at first and slow later is not given 1,024 at once)
            size = max(1, min(per_batch, 2 * len(idx), int(len(idx) * _BATCH_SECONDS / max(took, 1e-9))))
        return stored

    def prefill(self, *, rank: int | None = None, world_size: int | None = None, barrier: bool = True,
                patience: float = DEFAULT_PATIENCE) -> int:
        """Fills the cache before training, cooperatively with the other processes (DDP ranks) of this node: each
        computes a disjoint share, then they wait for each other. See ``mmapcache.distributed.prefill``.

        Returns how many samples this process stored. Safe across processes.
        """
        return prefill(self, rank=rank, world_size=world_size, barrier=barrier, patience=patience)
