"""The one writer of a row's bytes: a checked sample's values into a row (fixed fields with ``pwrite``, ragged ones into
extents of their heaps), or a batch's rows at once. Every method runs under the cache's writer lock, inside the
row's seqlock window (``store.state.SlotState.publish``): it never takes the lock, and it writes nothing it was not
asked to (damage found in a heap's counters or a row's extent is refused before the first byte).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import UncachedFieldWarning, warn
from ..format.fields import Field
from .heap import ABANDONED, CAPACITY, END, FREE, UNCACHED, Heap, budget_left
from .state import Declined, NoRoom
from .store import Store

__all__ = ["RowWriter"]

# Rows smaller than this are stored through the map (see RowWriter.write_rows), larger ones with pwrite.
_PAGE_BYTES = 4096


class RowWriter:
    """Writes rows of one open, writable store (see the module docstring). One per process and open cache.

    Args:
        store: the open store.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.fields = store.layout.fields
        self.data = store.data
        self.shapes = store.shapes
        self.ragged = [n for n, f in enumerate(self.fields) if f.ragged]
        self._row_bytes = [f.nbytes for f in self.fields]
        # Every field stored through the map by ``write`` (fixed, no ``max_shapes``, under a page or 1-D): its loop
        # reduced to the assignments (a single miss of small rows is mostly such overhead).
        self._through_map = not self.ragged and all(
            data is not None and shapes is None and (fd < 0 or data.ndim == 1 or row_bytes < _PAGE_BYTES)
            for data, shapes, fd, row_bytes in zip(self.data, self.shapes, store.data_fds, self._row_bytes))
        # The fixed and max_shapes fields, for a row at a time: (field, data, shapes, fd, offset, row bytes).
        self._fixed = [(n, data, shapes, fd, offset, row_bytes) for n, (data, shapes, fd, offset, row_bytes) in
                       enumerate(zip(self.data, self.shapes, store.data_fds, store.data_offsets, self._row_bytes))
                       if data is not None]
        # Each ragged field's index as int64 words (a memoryview: a row's words set ~3x faster than a numpy row).
        self._index_words = {n: (_words(store.index[n]), 2 + len(self.fields[n].shape))  # type: ignore[arg-type]
                             for n in self.ragged}
        # For a row's first values (``_append``): (field, heap, index words, index width, alignment, storer).
        self._appends = [(n, _heap(store, n), *self._index_words[n], max(self.fields[n].value_itemsize, 1),
                          _storer(self.fields[n]) if self.fields[n].stored is not None or self.fields[n].ones else None)
                         for n in self.ragged]
        self._warned: set[str] = set()
        # A ragged value as its heap holds it: narrower where the field is stored so (checked to fit before it
        # comes here: format.check.narrow_problem), and for a field of ones no bytes at all, only its shape.
        self._stored = {n: _storer(f) for n, f in enumerate(self.fields) if f.stored is not None or f.ones}
        # Rows whose values no reader will read again (a stream's ring: the positions every reader has passed), asked
        # under the writer lock when a value finds no heap room: their extents are given back first (``_room``).
        self.passed: Callable[[], np.ndarray] | None = None
        self.heap_bytes = 0  # bytes of ragged values this writer wrote into heaps (a build's report counts them)
        self.waiting: dict[int, int] = {}  # with ``passed``: row -> the field that found no room (see ``gave_up``)

    def write(self, row: int, values: list[Any], owned: bool) -> None:
        """Copies a checked sample's values into ``row``. The caller holds the writer lock (``publish``), which
        says whether the row's previous heap extents are ``owned`` (intact, so reusable or freed).

        Arrays of a page or more go through ``pwrite`` (the kernel copies into the shared pages; no page faults in
        this process), smaller ones and scalars through the map (a system call would cost more than the copy).
        Ragged values get their heap room first: with none for one of them, ``NoRoom`` is raised before anything is
        written (the sample is then served uncached), and so is ``CacheFormatError`` for a heap whose counters or
        this row's extent are damaged.
        """
        if self._through_map:
            for data, value in zip(self.data, values):
                data[row] = value
            return
        if self.ragged:
            self._write_ragged(row, values, owned)
        self._write_fixed(row, values)

    def _write_fixed(self, row: int, values: list[Any]) -> None:
        """The fixed and ``max_shapes`` fields of one row (ragged ones are skipped)."""
        for n, data, shapes, fd, offset, row_bytes in self._fixed:
            value = values[n]
            if shapes is not None:
                shapes[row] = value.shape
            if fd < 0 or data.ndim == 1 or (row_bytes < _PAGE_BYTES and shapes is None):
                data[row] = value
            else:  # (a max_shapes field's value: its bytes at the row's start, whatever its shape)
                _pwrite_all(fd, np.ascontiguousarray(value), offset + row * row_bytes)

    def write_rows(self, rows: np.ndarray, columns: list[np.ndarray], positions: np.ndarray) -> None:
        """Copies batch positions ``positions`` of gathered ``columns`` into cache rows ``rows[positions]``, a field
        at a time (``fixed`` layouts). The caller holds the writer lock (``SlotState.publish_rows``).

        Small rows are stored through the map in one vectorised assignment per field (one system call per row
        would cost more than the copy); rows of a page or more through ``pwrite`` (no page faults here), one per
        run of consecutive rows that are consecutive in the batch too (a fill's or a build's chunk: one call).
        """
        targets = rows[positions]
        runs: tuple[list[int], list[int], list[int]] | None = None  # each run's first position, first row, length
        for data, fd, offset, row_bytes, column in zip(
                self.data, self.store.data_fds, self.store.data_offsets, self._row_bytes, columns):
            if data is None:
                continue  # a ragged field (write_new_rows writes its values)
            if fd < 0 or data.ndim == 1 or row_bytes < _PAGE_BYTES:
                data[targets] = column[positions]
                continue
            if runs is None:
                # Runs of rows following each other in the cache and in the batch, as plain ints (a cold shuffled
                # batch is 256 runs of one row: numpy scalars and slices per run would cost more than the copy).
                firsts = np.concatenate(([0], np.flatnonzero((np.diff(targets) != 1) | (np.diff(positions) != 1))
                                         + 1))
                runs = (positions[firsts].tolist(), targets[firsts].tolist(),
                        np.diff(firsts, append=len(targets)).tolist())
            flat, pwrite = np.ascontiguousarray(column).reshape(-1).data.cast("B"), os.pwrite
            for k, row, count in zip(*runs):
                start, size, at = k * row_bytes, count * row_bytes, offset + row * row_bytes
                written = pwrite(fd, flat[start:start + size], at)
                if written != size:  # a short write: the rest
                    _pwrite_view(fd, flat[start + written:start + size], at + written)

    def write_new_rows(self, rows: np.ndarray, ragged: list[Any],
                       fixed: tuple[np.ndarray, list[Any], np.ndarray] | list[list[Any]]) -> None:
        """Copies a batch of checked samples' values into ``rows``, none of which owns heap extents (see ``write``):
        each ragged field's values packed back to back at its heap's end with one system call, and their index rows
        set at once. Those are the offsets ``write`` gives them one row at a time (a row's first value gets an extent
        of its own size at the end of the heap). Where ``write`` would do otherwise, ``Declined`` is raised before
        anything is written: a heap has free extents (``write`` reuses them), or there is no room for the whole
        batch (``write`` stores the values that fit); and ``CacheFormatError`` for a heap whose counters are
        damaged. The caller holds the writer lock (``SlotState.publish_rows``).

        Args:
            rows: the rows to write (int64).
            ragged: per ragged field, in field order, the rows' checked values: a list of arrays (one a row), or
                ``(flat, shapes)``: their elements back to back in C order, in the field's dtype, and their shapes
                ``(len(rows), ndim)`` (a batch's column: one ``pwrite``).
            fixed: the fixed fields' values: ``(batch rows, batch columns, positions)``, the batch's columns holding
                them at ``positions`` (``rows`` is ``batch rows[positions]``), written a step per field
                (``write_rows``); or per row its checked values (as ``write`` takes them).
        """
        store = self.store
        plans: list[tuple[int, Heap, int, int, list[np.ndarray], np.ndarray]] = []  # (field, heap, start, end, ...)
        for n, given in zip(self.ragged, ragged):
            heap, index = store.heaps[n], store.index[n]
            assert heap is not None and index is not None  # a ragged field has both (see Store)
            heap.check_counters()
            if int(heap.counters[FREE]):
                raise Declined
            if isinstance(given, tuple):
                values, sizes, shapes = self._packed(n, *given)
            else:
                values = [np.ascontiguousarray(v) for v in given]
                if n in self._stored:
                    values = [self._stored[n](v) for v in values]
                if any(v.itemsize != self.fields[n].value_itemsize for v in values):
                    raise Declined  # (not a value as checked: one row at a time says what it is)
                sizes = np.fromiter((v.nbytes for v in values), np.int64, len(values))
                shapes = np.array([v.shape for v in values], np.int64).reshape(len(values), -1)
            # (a field of ones stores no bytes: values of itemsize 0)
            itemsize = max(self.fields[n].value_itemsize, 1)
            start = -(-int(heap.counters[END]) // itemsize) * itemsize  # every value a multiple: all stay aligned
            entries = np.empty((len(sizes), index.shape[1]), np.int64)
            entries[:, 0] = np.where(sizes > 0, start + np.cumsum(sizes) - sizes, 0)  # (an empty value: 0, 0)
            entries[:, 1] = sizes
            entries[:, 2:] = shapes
            plans.append((n, heap, start, start + int(sizes.sum()), values, entries))
        budget = budget_left(store.heap_counters, store.heap_budget)
        if budget is not None and sum(max(0, end - int(heap.counters[CAPACITY]))
                                      for _, heap, _, end, _, _ in plans) > budget:
            raise Declined  # (before any heap grows: one at a time, the fields would share what is left)
        for _, heap, _, end, _, _ in plans:
            if not heap.reserve(end, budget_left(store.heap_counters, store.heap_budget)):
                raise Declined
        for n, heap, start, end, values, entries in plans:
            c = heap.counters
            if end > start:
                padding = start - int(c[END])
                c[END] = end  # first: a kill before the padding is counted leaves it uncounted, never over the end
                c[ABANDONED] += padding
            heap.write_packed(start, values)
            store.index[n][rows] = entries  # type: ignore[index]
            self.heap_bytes += end - start
        if isinstance(fixed, tuple):
            self.write_rows(*fixed)
        else:
            for row, values in zip(rows.tolist(), fixed):
                self._write_fixed(row, values)

    def _packed(self, n: int, flat: np.ndarray, shapes: np.ndarray) -> tuple[list[np.ndarray], np.ndarray,
                                                                             np.ndarray]:
        """Field ``n``'s values given back to back (``flat``, of ``shapes``): as its heap stores them (narrowed, or
        nothing for a field of ones), and each one's bytes there."""
        field = self.fields[n]
        counts = shapes[:, 0] if shapes.shape[1] == 1 else np.prod(shapes, axis=1, dtype=np.int64)
        if field.ones:
            return [], np.zeros(len(shapes), np.int64), shapes
        stored = np.ascontiguousarray(flat).reshape(-1).astype(field.storage_dtype, copy=False)
        if len(stored) != int(counts.sum()):
            raise ValueError(f"field {field.name!r}: {len(stored)} elements given for values of {int(counts.sum())}")
        return [stored], counts * stored.itemsize, shapes

    def _write_ragged(self, row: int, values: list[Any], owned: bool) -> None:
        """Finds room for every ragged value of the row (all or nothing), writes them and their index rows, then
        frees what the row no longer uses (see ``store.heap``)."""
        if not owned and self._append(row, values):
            return
        store = self.store
        plan: list[tuple[int, Heap, int, int, np.ndarray, tuple[int, int]]] = []
        taken: list[tuple[Heap, int, int]] = []  # room allocated so far, given back if a later field has none
        try:
            for n in self.ragged:
                value = np.ascontiguousarray(values[n])
                if n in self._stored:
                    value = self._stored[n](value)
                heap, (words, width) = store.heaps[n], self._index_words[n]
                assert heap is not None  # a ragged field has one (see Store)
                # Damage (counters, or an index row, that describe bytes outside the heap) is refused here, before
                # anything is written: a write past what posix_fallocate reserved would be a sparse page.
                heap.check_counters()
                old_offset, old_capacity = (words[row * width], words[row * width + 1]) if owned else (0, 0)
                if owned:
                    heap.check_extent(old_offset, old_capacity, max(value.itemsize, 1), row)
                if owned and value.nbytes <= old_capacity:
                    # In place, keeping the row's room; but a value that uses under half of it moves to a free
                    # extent that fits, if there is one, so large extents circulate to the rows that grow.
                    smaller = heap.reuse(value.nbytes, max(value.itemsize, 1)) if 2 * value.nbytes < old_capacity \
                        else None
                    if smaller is None:
                        plan.append((n, heap, old_offset, old_capacity, value, (0, 0)))
                        continue
                    taken.append((heap, *smaller))
                    plan.append((n, heap, *smaller, value, (old_offset, old_capacity)))
                    continue
                room = heap.allocate(value.nbytes, max(value.itemsize, 1),
                                     budget_left(store.heap_counters, store.heap_budget), exact=old_capacity == 0)
                if room is None:
                    room = self._room(n, value, (old_offset, old_capacity))
                if room is None:
                    if self.passed is None:
                        self.gave_up(n)
                    else:  # a stream's producer tries again as readers move on (it calls gave_up if it stops)
                        self.waiting[row] = n
                    raise NoRoom
                taken.append((heap, *room))
                plan.append((n, heap, *room, value, (old_offset, old_capacity)))
        except BaseException:
            for taken_heap, taken_offset, taken_capacity in taken:
                taken_heap.free(taken_offset, taken_capacity)
            raise
        for n, heap, offset, capacity, value, _ in plan:
            heap.write(offset, value)
            self.heap_bytes += value.nbytes
            words, width = self._index_words[n]
            base = row * width
            words[base] = offset
            words[base + 1] = capacity
            for d, size in enumerate(value.shape, base + 2):
                words[d] = size
        for _, heap, _, _, _, (unused_offset, unused_capacity) in plan:
            if unused_capacity:
                heap.free(unused_offset, unused_capacity)

    def _append(self, row: int, values: list[Any]) -> bool:
        """``_write_ragged`` for a row that owns no extents (a cold miss), where every value goes where ``allocate``
        puts a row's first value when no heap has free extents: at its heap's end, in an extent of its own size, the
        heap grown first if it must. False, with nothing written, where that is not so (a heap with free extents, or
        one that cannot grow): the general path decides then. The same steps as that path, without its bookkeeping
        for rows that own extents (every miss of a new cache comes here)."""
        staged = []
        for n, heap, words, width, align, storer in self._appends:
            value = values[n]
            if type(value) is not np.ndarray or not value.flags.c_contiguous:
                value = np.ascontiguousarray(value)
            if storer is not None:
                value = storer(value)
            heap.check_counters()  # (damage is refused before anything is written)
            w = heap.words
            if w[FREE]:
                return False
            nbytes = value.nbytes
            offset = -(-w[END] // align) * align if nbytes else 0
            if nbytes and offset + nbytes > w[CAPACITY] and not heap.reserve(
                    offset + nbytes, budget_left(self.store.heap_counters, self.store.heap_budget)):
                return False
            staged.append((heap, w, words, row * width, offset, nbytes, value))
        for heap, w, words, base, offset, nbytes, value in staged:
            if nbytes:
                end = w[END]
                w[END] = offset + nbytes
                w[ABANDONED] += offset - end  # alignment padding
                written = os.pwrite(heap.fd, value, offset)
                if written < nbytes:  # a short write: the rest
                    _pwrite_view(heap.fd, value.reshape(-1).view(np.uint8).data[written:], offset + written)
                self.heap_bytes += nbytes
            words[base] = offset
            words[base + 1] = nbytes
            for d, size in enumerate(value.shape, base + 2):
                words[d] = size
        return True

    def _room(self, n: int, value: np.ndarray, kept: tuple[int, int]) -> tuple[int, int] | None:
        """Room for field ``n``'s value once ``allocate`` found none: the extents of rows no reader will read again
        given back (``passed``), then, if enough bytes lie on no row's extent, the free lists rebuilt from what rows
        own (``Heap.sweep``), and ``allocate`` asked again. ``kept`` is the extent of the row being written (the
        caller made its counter odd, and frees that extent only once the new value is written; the room taken for
        the row's earlier fields lies in other heaps)."""
        store = self.store
        heap, index = store.heaps[n], store.index[n]
        assert heap is not None and index is not None
        passed = self.passed() if self.passed is not None else np.empty(0, np.int64)
        if len(passed):
            # Checked first, for every field: a damaged extent is refused before any row changes.
            for m in self.ragged:
                other, extents = store.heaps[m], store.index[m]
                assert other is not None and extents is not None
                for row, (offset, capacity) in zip(passed.tolist(), extents[passed, :2].tolist()):
                    other.check_extent(offset, capacity, max(self.fields[m].value_itemsize, 1), row)
            store.state.empty_locked(passed, self._give_back)
        if not heap.worth_sweeping(value.nbytes):
            return None
        owned = np.flatnonzero(store.state.owned_mask())
        heap.sweep(np.concatenate((index[owned, :2], np.array([kept], np.int64))))
        return heap.allocate(value.nbytes, max(value.itemsize, 1), budget_left(store.heap_counters, store.heap_budget))

    def _give_back(self, rows: np.ndarray) -> None:
        """Frees the heap extents of ``rows`` (being emptied: ``SlotState.empty_locked``)."""
        for m in self.ragged:
            heap, index = self.store.heaps[m], self.store.index[m]
            assert heap is not None and index is not None
            for offset, capacity in index[rows, :2].tolist():
                heap.free(offset, capacity)
            index[rows, :2] = 0

    def gave_up(self, n: int) -> None:
        """Counts a sample that passes through uncached for want of room in field ``n``'s heap (``mmapcache
        inspect`` shows the count), and warns once per field."""
        heap = self.store.heaps[n]
        assert heap is not None
        heap.counters[UNCACHED] += 1
        self._warn_uncached(self.fields[n])

    def _warn_uncached(self, field: Field) -> None:
        if field.name in self._warned:
            return
        self._warned.add(field.name)
        budget = self.store.heap_budget
        why = f"the cache's heap budget ({budget} bytes, from max_bytes)" if budget is not None else \
            "the file system"
        if self.store.meta["mode"] == "stream":
            what = (f"the stream at {self.store.path} has no room left in {why} for field {field.name!r}: producers "
                    "hold such values until readers pass the values before them, and give up those that readers "
                    "wait for or reach; the readers compute them (`mmapcache inspect` counts them). Give the "
                    "stream a larger max_bytes")
        else:
            what = (f"the cache at {self.store.path} has no room left in {why} for field {field.name!r}: further "
                    "samples that need room pass through uncached (computed from the source on every access; "
                    "`mmapcache inspect` counts them). Give the cache a larger max_bytes, or free space")
        warn(what, UncachedFieldWarning)



# A value of no bytes that keeps its shape (what a field of ones stores: its index row records the shape).
_NOTHING = np.dtype([])


def _storer(field: Field) -> Callable[[np.ndarray], np.ndarray]:
    """How a checked value of ``field`` is stored: converted to its narrower type, or (ones) its shape alone."""
    if field.ones:
        return lambda value: np.empty(value.shape, _NOTHING)
    stored = field.storage_dtype
    return lambda value: value.astype(stored, copy=False)


def _heap(store: Store, n: int) -> Heap:
    heap = store.heaps[n]
    assert heap is not None  # a ragged field has one (see Store)
    return heap


def _words(index: np.ndarray) -> memoryview:
    """A ragged field's index (``(rows, 2 + ndim)`` int64) as a flat memoryview of its words."""
    if not index.size:
        return memoryview(b"").cast("q")
    return memoryview(index.reshape(-1)).cast("B").cast("q")  # type: ignore[arg-type]


def _pwrite_all(fd: int, value: np.ndarray, offset: int) -> None:
    # Flattened first: memoryview refuses to cast a multi-dimensional view with a zero in its shape (0x3 field).
    _pwrite_view(fd, value.reshape(-1).data.cast("B"), offset)


def _pwrite_view(fd: int, view: memoryview, offset: int) -> None:
    """Writes all of ``view`` at ``offset`` (``pwrite`` may write less than asked)."""
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
