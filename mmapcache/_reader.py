"""The warm read path: copying rows out of the maps under the seqlock, one row or a batch at a time.

Everything a read needs is precomputed here once per process (numpy views, converters, the sample builder), so a
hit costs no memmap construction, lock, file system call or JSON: a few memoryview loads, one copy per field,
and the rebuild of the sample's containers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _gather
from ._codec import batch_builder, batch_converter, compile_checker, leaf_converter, sample_builder
from ._gather import take
from ._layout import BOOL, FLOAT, INT, NDARRAY, NPSCALAR, TENSOR, Field
from ._store import Store

# A reader that loses the seqlock race this many times in a row (a row rewritten again and again) gives up and
# treats the row as a miss, which waits for the writer lock instead of spinning.
_RETRIES = 4


class RowReader:
    """Reads complete rows of one open store. Safe across processes and threads (it never writes state)."""

    def __init__(self, store: Store, *, recompute_stale: bool) -> None:
        self.store = store
        self.state = store.state
        self.recompute_stale = recompute_stale
        layout = store.layout
        self.fields = layout.fields
        self.data = store.data
        self.shapes = store.shapes
        self.variable = any(f.variable for f in self.fields)
        self.build = sample_builder(layout.structure)
        self.check = compile_checker(layout)
        self.build_batch = batch_builder(layout.structure)
        self._readers = [self._field_reader(n) for n in range(len(self.fields))]
        # Closures over the maps, never over self: a cycle through self would keep the maps (and the file
        # system) busy after close until the garbage collector ran.
        self._raw_readers = [_raw_reader(data, shapes) for data, shapes in zip(self.data, self.shapes)]
        self._miss_converters = [_value_converter(f) for f in self.fields]
        self._batch_converters = [batch_converter(f) for f in self.fields]
        self._splitters = [_splitter(f) for f in self.fields]
        self._row_bytes = [f.nbytes for f in self.fields]
        self._buffers = _gather.buffers
        structure = layout.structure
        # A flat tuple of leaves in field order (the usual (input, target) pair): zip() builds the samples in C.
        self._zip_tuples = "tuple" in structure and [s.get("leaf") for s in structure["tuple"]] == list(
            range(len(self.fields)))

    def _field_reader(self, n: int) -> Callable[[int], Any]:
        """A function copying field ``n`` of a row out of the map, as the type the source returned."""
        field, data, shapes = self.fields[n], self.data[n], self.shapes[n]
        if field.kind in (INT, FLOAT, BOOL):
            return data.item  # Python int/float/bool straight from the buffer
        if field.kind == NPSCALAR:
            return lambda row: data[row].copy()[()]
        convert = leaf_converter(field)
        if shapes is not None:
            def read_variable(row: int) -> Any:
                shape = tuple(shapes[row].tolist())
                size = int(np.prod(shape, dtype=np.int64))
                return convert(data[row].reshape(-1)[:size].reshape(shape).copy())
            return read_variable
        if not field.shape:
            return lambda row: convert(data[row, ...].copy())  # data[row] would be a numpy scalar, not an array
        return lambda row: convert(data[row].copy())

    # --- one row -----------------------------------------------------------------------------------------------

    def read(self, row: int) -> Any | None:
        """The sample in ``row``, or None if it is not filled (or stale, or being written): a miss."""
        leaves = self._consistent(row, self._readers)
        return None if leaves is None else self.build(leaves)

    def read_values(self, row: int) -> list[np.ndarray] | None:
        """The flattened stored values of ``row`` (numpy, at actual shape), or None on a miss."""
        return self._consistent(row, self._raw_readers)

    def _consistent(self, row: int, readers: list[Callable[[int], Any]]) -> list[Any] | None:
        """Each reader's value of ``row``, copied under the seqlock; None if the row is not readable.

        The one seqlock read loop: the copy counts only if the row's counter was even before it and unchanged
        after it (no writer started or finished meanwhile). A row rewritten ``_RETRIES`` times in a row is
        treated as a miss, which waits for the writer lock instead of spinning.
        """
        filled, seq = self.state.filled, self.state.seq
        byte, bit = row >> 3, row & 7
        for _ in range(_RETRIES):
            if not filled[byte] >> bit & 1 or (self.recompute_stale and self.state.stale[byte] >> bit & 1):
                return None
            before = seq[row]
            if before & 1:
                return None
            values = [read(row) for read in readers]
            if seq[row] == before:
                return values
        return None

    def sample_from_values(self, values: list[Any]) -> Any:
        """The sample a hit would return, from what ``check(sample, index)`` returned for a miss.

        A miss thereby returns the same types as a hit: a plain ``Tensor`` (not requiring grad, not a
        ``Parameter`` or other subclass), ``int``/``float``/``bool`` (not an ``IntEnum``), a base-class ndarray,
        a numpy scalar, and the cache's containers. Arrays are not copied: a tensor shares memory with the
        source's (``torch.from_numpy`` of the checked numpy view), as a hit's tensor is a view of its own copy.
        """
        return self.build([convert(value) for convert, value in zip(self._miss_converters, values)])

    def write(self, row: int, values: list[Any]) -> None:
        """Copies a checked sample's values into ``row``. The caller holds the writer lock (``publish``).

        Arrays go through ``pwrite`` (the kernel copies into the shared pages; no page faults in this process),
        scalars through the map.
        """
        for data, shapes, fd, offset, row_bytes, value in zip(
            self.data, self.shapes, self.store.data_fds, self.store.data_offsets, self._row_bytes, values
        ):
            if shapes is not None:
                shapes[row] = value.shape
            if fd < 0 or data.ndim == 1:
                data[row] = value
            else:
                _pwrite_all(fd, np.ascontiguousarray(value), offset + row * row_bytes)

    # --- batches -----------------------------------------------------------------------------------------------

    def gather(self, rows: np.ndarray,
               alloc: Callable[..., np.ndarray] = np.empty) -> tuple[list[np.ndarray], list[int]]:
        """Copies the given rows (fixed-shape fields only) into fresh per-field batch arrays, in order.

        ``alloc`` makes each array; for ``numpy.empty`` (the default) an earlier batch's array that nothing
        references any more is recycled instead (``_gather.BufferPool``: no page faults on fresh memory). Large
        copies are split over threads (``_gather.take``).

        Returns the arrays and the positions that could not be read (not cacheable, not filled, stale under
        ``recompute``, or rewritten during the copy); the caller fills those positions.
        """
        if alloc is np.empty:
            alloc = self._buffers.empty
        n = len(rows)
        state = self.state
        cacheable = rows >= 0
        safe_rows = np.where(cacheable, rows, 0)
        readable = cacheable & state.filled_rows(safe_rows)
        if self.recompute_stale:
            readable &= ~state.stale_rows(safe_rows)
        before = state.seq_np[safe_rows]
        # The counter must be even *when the copy starts*: a writer that began between the filled check above and
        # this load leaves it odd for the whole copy, so "unchanged after the copy" alone would accept a torn row.
        readable &= (before & 1) == 0
        count = int(np.count_nonzero(readable))
        # Rows that cannot be read are filled by the caller anyway: a mostly cold batch copies only its hits.
        hits = None if count * 2 >= n else np.flatnonzero(readable)
        columns = []
        for field, data in zip(self.fields, self.data):
            out = alloc((n, *field.shape), field.np_dtype)
            if hits is None:
                take(data, safe_rows, out)
            elif count:
                out[hits] = data[safe_rows[hits]]
            columns.append(out)
        readable &= state.seq_np[safe_rows] == before
        return columns, np.flatnonzero(~readable).tolist()

    def split(self, columns: list[np.ndarray]) -> list[list[Any]]:
        """Per field, the list of per-sample values of a gathered batch (views into the fresh batch arrays)."""
        return [split(column) for split, column in zip(self._splitters, columns)]

    def samples(self, columns: list[np.ndarray]) -> list[Any]:
        """The per-sample values of a gathered batch, as the source returned them (views into the batch arrays)."""
        per_field = self.split(columns)
        if self._zip_tuples:
            return list(zip(*per_field))
        build = self.build
        return [build(leaves) for leaves in zip(*per_field)]

    def collate(self, columns: list[np.ndarray]) -> Any:
        """The batch as ``default_collate`` would build it, from gathered columns (no extra copy)."""
        return self.build_batch([convert(column) for convert, column in zip(self._batch_converters, columns)])


def _raw_reader(data: np.ndarray, shapes: np.ndarray | None) -> Callable[[int], np.ndarray]:
    """A function copying one field of a row out of the map as numpy, at its actual shape."""
    if shapes is None:
        return lambda row: data[row, ...].copy()

    def read_variable(row: int) -> np.ndarray:
        shape = tuple(shapes[row].tolist())
        return data[row].reshape(-1)[: int(np.prod(shape, dtype=np.int64))].reshape(shape).copy()
    return read_variable


def _splitter(field: Field) -> Callable[[np.ndarray], list[Any]]:
    """Splits a gathered batch array into per-sample values of the source's types."""
    if field.kind == TENSOR:
        convert = batch_converter(field)
        return lambda batch: list(convert(batch).unbind(0))
    if field.kind in (INT, FLOAT, BOOL):
        return lambda batch: batch.tolist()
    if field.kind == NDARRAY and not field.shape:
        # Iterating a 1-D batch yields numpy scalars; a 0-d ndarray field must stay a 0-d ndarray, as ds[i] gives.
        return lambda batch: [batch[i, ...] for i in range(len(batch))]
    return list  # ndarray rows (views of the fresh batch) or numpy scalars (iteration yields copies)


def _value_converter(field: Field) -> Callable[[Any], Any]:
    """Turns one value returned by the checker (fast path: the source's own object or a numpy view of its
    tensor; slow path: a numpy array) into the type a hit returns for ``field``."""
    if field.kind == INT:
        return int  # int(x) of an exact int is x itself; of an IntEnum or a 0-d array, a plain int
    if field.kind == FLOAT:
        return float
    if field.kind == BOOL:
        return bool
    if field.kind == NPSCALAR:
        return lambda value: value[()]  # a numpy scalar from a numpy scalar or a 0-d array
    if field.kind == NDARRAY:
        return np.asarray  # drops ndarray subclasses (np.memmap, np.matrix) without a copy
    return leaf_converter(field)  # torch.from_numpy (and a view for dtypes numpy lacks): a plain Tensor


def _pwrite_all(fd: int, value: np.ndarray, offset: int) -> None:
    # Flattened first: memoryview refuses to cast a multi-dimensional view with a zero in its shape (0x3 field).
    view = value.reshape(-1).data.cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
