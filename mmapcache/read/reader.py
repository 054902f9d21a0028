"""The warm read path: copying rows out of the maps under the seqlock, one row or a batch at a time, and the
one writer of a row's bytes.

Everything a read needs is precomputed here once per process (numpy views, converters, the sample builder), so a
hit costs no memmap construction, lock, file system call or JSON: a few memoryview loads, one copy per field,
and the rebuild of the sample's containers. Ragged fields are read from their heaps (``store.heap``): one value at a
time for ``ds[i]``, and for a batch one gather of the index rows and one vectorised copy of the values
(``RaggedColumn``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CacheFormatError, LayoutError
from ..format.batch import compile_batch_filler
from ..format.check import call, compile_checker
from ..format.codec import (
    batch_builder,
    batch_converter,
    leaf_converter,
    sample_builder,
    subclass_wrapper,
)
from ..format.layout import (
    BOOL,
    FLOAT,
    INT,
    JSON,
    NDARRAY,
    NPSCALAR,
    PYLIST,
    STR,
    TENSOR,
    TEXT_KINDS,
    Field,
)
from ..store.store import Store
from . import gather as _gather
from .gather import take
from .ragged import (
    RaggedColumn,
    Torn,
    gather_ragged,
    ones_reader,
    ragged_reader,
    ragged_splitter,
    str_reader,
    torch_target,
)

# A reader that loses the seqlock race this many times in a row (a row rewritten again and again) gives up and
# treats the row as a miss, which waits for the writer lock instead of spinning.
_RETRIES = 4


def _checker(store: Store, narrow: bool = True) -> Callable[[Any, int], list[Any]]:
    """The layout's check of one sample (``format.check``). A sample it refuses is the source's fault
    (``LayoutError``) unless the cache's own rows contradict the layout ``meta.json`` records: then that file is
    damaged, whoever computed the sample (a miss, a build worker, a producer, an opener comparing samples)."""
    def refused(exc: LayoutError, index: int) -> Exception:
        damage = store.layout_contradiction()
        if damage is None:
            return exc
        return CacheFormatError(f"{damage}; the file is damaged (sample {index} did not fit it either: {exc}). "
                                "Remove the cache (`mmapcache rm --force`) and build it again")
    return compile_checker(store.layout, store.path, refused, narrow=narrow)


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
        self.ragged = [n for n, f in enumerate(self.fields) if f.ragged]
        self.wrap = subclass_wrapper(layout)
        self.build = sample_builder(layout.structure)
        self.check = _checker(store)
        # A sample served but never stored (an index outside cache_indices): its values need not fit store_as.
        self.check_served = _checker(store, narrow=False) if any(f.stored or f.ones for f in self.fields) \
            else self.check
        # A batch of misses checked and written into the batch's columns at once (plain fields, no max_shapes).
        self.fill_batch = compile_batch_filler(layout) if not self.variable else None
        self.build_batch = batch_builder(layout.structure)
        self._readers = [self._field_reader(n) for n in range(len(self.fields))]
        # Closures over the maps, never over self: a cycle through self would keep the maps (and the file
        # system) busy after close until the garbage collector ran.
        self._raw_readers = [
            (ones_reader(index, f.np_dtype) if f.ones else ragged_reader(index, heap, f.storage_dtype))
            if heap is not None and index is not None
            else _raw_reader(data, shapes)
            for f, data, shapes, index, heap in zip(self.fields, self.data, self.shapes, store.index, store.heaps)
        ]
        self._miss_converters = [_value_converter(f) for f in self.fields]
        self._batch_converters = [batch_converter(f) for f in self.fields]
        self._splitters = [_splitter(f, store.path) for f in self.fields]
        self._row_bytes = [f.nbytes for f in self.fields]
        self._buffers = _gather.buffers
        # Read once per open (not per batch): $MMAPCACHE_GATHER_THREADS. One thread: a plain numpy.take.
        self._copy_rows = _take_rows if _gather.configured_threads() <= 1 else take
        structure = layout.structure
        # A flat tuple of leaves in field order (the usual (input, target) pair): zip() builds the samples in C.
        self._zip_tuples = self.wrap is None and "tuple" in structure and [
            s.get("leaf") for s in structure["tuple"]] == list(range(len(self.fields)))
        self._warned: set[str] = set()

    def _field_reader(self, n: int) -> Callable[[int], Any]:
        """A function copying field ``n`` of a row out of the map, as the type the source returned."""
        field, data, shapes = self.fields[n], self.data[n], self.shapes[n]
        heap = self.store.heaps[n]
        if heap is not None:
            index = self.store.index[n]
            if field.kind == STR:
                return str_reader(index, heap)  # type: ignore[arg-type]
            raw = ones_reader(index, field.np_dtype) if field.ones else ragged_reader(  # type: ignore[arg-type]
                index, heap, field.storage_dtype)  # type: ignore[arg-type]
            convert = leaf_converter(field)
            return lambda row: convert(raw(row))
        if field.kind in (INT, FLOAT, BOOL):
            return data.item  # Python int/float/bool straight from the buffer
        if field.kind == NPSCALAR:
            return lambda row: data[row].copy()[()]
        convert = leaf_converter(field)
        if shapes is not None:
            raw = _raw_reader(data, shapes)
            return lambda row: convert(raw(row))
        if not field.shape:
            return lambda row: convert(data[row, ...].copy())  # data[row] would be a numpy scalar, not an array
        return lambda row: convert(data[row].copy())

    # --- one row -----------------------------------------------------------------------------------------------

    def read(self, row: int, key: int = -1) -> Any | None:
        """The sample in ``row``, or None if it is not filled (or stale, or being written, or holds another key
        than ``key`` when one is given): a miss."""
        if not self.state.filled[row >> 3] >> (row & 7) & 1:
            return None  # a miss before the seqlock loop, which says the same (a cold ds[i]: one frame less)
        leaves = self._consistent(row, self._readers, key)
        if leaves is None:
            return None
        return self.build(leaves if self.wrap is None else self.wrap(leaves))

    def read_values(self, row: int, key: int = -1) -> list[np.ndarray] | None:
        """The flattened stored values of ``row`` (numpy, at actual shape), or None on a miss."""
        return self._consistent(row, self._raw_readers, key)

    def _consistent(self, row: int, readers: list[Callable[[int], Any]], key: int = -1) -> list[Any] | None:
        """Each reader's value of ``row``, copied under the seqlock; None if the row is not readable.

        The one seqlock read loop: the copy counts only if the row's counter was even before it and unchanged
        after it (no writer started or finished meanwhile). A row rewritten ``_RETRIES`` times in a row is
        treated as a miss, which waits for the writer lock instead of spinning. With ``key >= 0`` (rows whose
        meaning changes: a rotating share, the stream ring) the row's key, read inside the same window, must be
        ``key``.
        """
        filled, seq = self.state.filled, self.state.seq
        byte, bit = row >> 3, row & 7
        for _ in range(_RETRIES):
            if not filled[byte] >> bit & 1 or (self.recompute_stale and self.state.stale[byte] >> bit & 1):
                return None
            before = seq[row]
            if before & 1 or (key >= 0 and self.state.keys[row] != key):
                return None
            try:
                values = [read(row) for read in readers]
            except Exception as exc:
                # A ragged value read while a writer rewrote it (a torn offset, shape or UTF-8 sequence) fails
                # here; the counter then says so, and the read is retried. A row no writer touched that cannot be
                # read is damaged.
                if seq[row] != before:
                    continue
                raise self._damaged(row, readers, exc) from (None if isinstance(exc, Torn) else exc)
            if seq[row] == before:
                return values
        return None

    def _damaged(self, row: int, readers: list[Callable[[int], Any]], exc: Exception) -> CacheFormatError:
        """The error for a complete row that a field's reader refused (``exc``), naming the field."""
        name = "?"
        for field, read in zip(self.fields, readers):
            try:
                read(row)
            except Exception:
                name = field.name
                break
        path = self.store.path
        why = str(exc) if isinstance(exc, Torn) else f"{type(exc).__name__}: {exc}"
        return CacheFormatError(f"{path}: row {row}, field {name!r}: the stored value cannot be read ({why}); the "
                                f"cache is damaged: remove it (`mmapcache rm --force {path}`) and build it again "
                                f"(`mmapcache verify {path}` lists the damage)")

    def sample_from_values(self, values: list[Any]) -> Any:
        """The sample a hit would return, from what ``check(sample, index)`` returned for a miss.

        A miss thereby returns the same types as a hit: a plain ``Tensor`` (not requiring grad, not a
        ``Parameter`` or other subclass), ``int``/``float``/``bool`` (not an ``IntEnum``), a base-class ndarray,
        a numpy scalar, and the cache's containers. Arrays are not copied: a tensor shares memory with the
        source's (``torch.from_numpy`` of the checked numpy view), as a hit's tensor is a view of its own copy.
        """
        leaves = list(map(call, self._miss_converters, values))
        return self.build(leaves if self.wrap is None else self.wrap(leaves))

    @property
    def row_bytes(self) -> int:
        """Bytes of a row's fixed-size fields (a ragged field's values are in its heap)."""
        return sum(self._row_bytes)

    @property
    def fixed(self) -> bool:
        """Whether every field has fixed-size rows (no ragged or ``max_shapes`` field): misses written as a batch."""
        return not self.ragged and not self.variable

    # --- batches -----------------------------------------------------------------------------------------------

    def gather(self, rows: np.ndarray, alloc: Callable[..., np.ndarray] = np.empty,
               keys: np.ndarray | None = None, cacheable: bool = False) -> tuple[list[np.ndarray], list[int]]:
        """Copies the given rows (fixed-shape fields only) into fresh per-field batch arrays, in order.

        ``alloc`` makes each array; for ``numpy.empty`` (the default) an earlier batch's array that nothing
        references any more is recycled instead (``read.gather.BufferPool``: no page faults on fresh memory). Large
        copies are split over threads (``read.gather.take``).

        Returns the arrays and the positions that could not be read (not cacheable, not filled, stale under
        ``recompute``, holding another key than ``keys`` says when given, or rewritten during the copy); the
        caller fills those positions.

        ``cacheable`` says every row is one (>= 0). Then, when every row of the cache is complete and no writer
        changed anything during the copy (``SlotState.all_complete``), no row is checked one by one: a warm cache's
        batch costs one gather per field and two loads.
        """
        if alloc is np.empty:
            alloc = self._buffers.empty
        state = self.state
        if cacheable and keys is None:
            counter = state.all_complete()
            if counter >= 0:
                columns = self._take(rows, alloc)
                if columns is not None and state.changes[0] == counter:
                    return columns, []
        return self._gather_checked(rows, alloc, keys)

    def _take(self, rows: np.ndarray, alloc: Callable[..., np.ndarray]) -> list[Any] | None:
        """Every field of ``rows`` (all cacheable and complete), copied without checks; None if a ragged value's
        index row describes no value (damage: the checked gather finds and reports it)."""
        columns: list[Any] = []
        n = len(rows)
        for field, data, index, heap in zip(self.fields, self.data, self.store.index, self.store.heaps):
            if heap is not None:
                column = gather_ragged(field, index, heap, rows, np.ones(n, bool))  # type: ignore[arg-type]
                if not column.valid.all():
                    return None
                columns.append(column)
                continue
            out = alloc((n, *field.shape), field.np_dtype)
            self._copy_rows(data, rows, out)
            columns.append(out)
        return columns

    def _gather_checked(self, rows: np.ndarray, alloc: Callable[..., np.ndarray],
                        keys: np.ndarray | None) -> tuple[list[np.ndarray], list[int]]:
        """``gather`` with each row's state checked (filled, stale, key, its seqlock counter)."""
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
        if keys is not None:
            readable &= state.keys_np[safe_rows] == keys
        count = int(np.count_nonzero(readable))
        # Rows that cannot be read are filled by the caller anyway: a mostly cold batch copies only its hits.
        hits = None if count * 2 >= n else np.flatnonzero(readable)
        columns: list[Any] = []
        for field, data, index, heap in zip(self.fields, self.data, self.store.index, self.store.heaps):
            if heap is not None:
                if not count:  # a cold batch: nothing to locate in the heap
                    columns.append(RaggedColumn.empty(n, len(field.shape), field.np_dtype))
                    continue
                column = gather_ragged(field, index, heap, safe_rows, readable)  # type: ignore[arg-type]
                readable &= column.valid
                columns.append(column)
                continue
            out = alloc((n, *field.shape), field.np_dtype)
            if hits is None:
                self._copy_rows(data, safe_rows, out)
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
        build, wrap = self.build, self.wrap
        if wrap is not None:
            return [build(wrap(list(leaves))) for leaves in zip(*per_field)]
        return [build(leaves) for leaves in zip(*per_field)]

    def collate(self, columns: list[Any], pad: Any = None) -> Any:
        """The batch as ``default_collate`` would build it, from gathered columns (no extra copy). A ragged field
        becomes a list of its values, or with ``pad`` (a ``PadCollate``) a ``Padded`` batch. So does a 1-D list of
        numbers (always ragged), in every batch: ``default_collate`` transposes a batch of lists of one length (a
        list of L tensors of B numbers), and such a batch of token ids (every batch of one sample, or lengths equal
        by chance) would change its structure from one batch to the next. With a ``TextCollate``, its batch."""
        collate = getattr(pad, "from_columns", None)  # a TextCollate
        if collate is not None:
            return collate(self, columns)
        leaves = []
        for field, convert, split, column in zip(self.fields, self._batch_converters, self._splitters, columns):
            if not field.ragged:
                leaves.append(convert(column) if pad is None else pad.named(field, convert(column)))
            elif field.kind == JSON:
                leaves.append(None)  # a tensor subclass's attributes: default_collate's stack drops them too
            elif pad is not None and field.kind not in TEXT_KINDS and (
                    pad.fields is None or field.name in pad.fields):
                leaves.append(pad.pad(*column.merged(), torch_target(field)))
            else:
                leaves.append(split(column))
        return self.build_batch(leaves)


def _take_rows(data: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    np.take(data, rows, axis=0, out=out, mode="clip")


def _raw_reader(data: np.ndarray, shapes: np.ndarray | None) -> Callable[[int], np.ndarray]:
    """A function copying one field of a row out of the map as numpy, at its actual shape."""
    if shapes is None:
        return lambda row: data[row, ...].copy()

    limit = data.shape[1:]

    def read_variable(row: int) -> np.ndarray:
        shape = tuple(shapes[row].tolist())
        if not all(0 <= s <= m for s, m in zip(shape, limit)):
            raise Torn(f"its stored shape {shape} is outside the field's maximum {limit}")
        return data[row].reshape(-1)[:math.prod(shape)].reshape(shape).copy()
    return read_variable


def _splitter(field: Field, path: str) -> Callable[[Any], list[Any]]:
    """Splits a gathered batch (an array with a leading batch axis, or a ``RaggedColumn``) into per-sample values
    of the source's types."""
    if field.ragged:
        return ragged_splitter(field, path)
    if field.kind == PYLIST:
        return lambda batch: batch.tolist()
    if field.kind == TENSOR:
        convert = batch_converter(field)
        from .collate import split_rows

        return lambda batch: split_rows(convert(batch))
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
    # str, bytes, lists and metadata from their stored form; a tensor through torch.from_numpy (and a view for
    # dtypes numpy lacks): a plain Tensor, which subclass_wrapper may then make a subclass.
    return leaf_converter(field)
