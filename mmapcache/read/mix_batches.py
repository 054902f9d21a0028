"""Reading a mixture's batch: each source's samples gathered straight into the batch's arrays, one gather per source
and field, and collated once.

A batch is a set of flat ids (``read.mix_order``); it is read, and handed over, grouped by source (sources in their
order, each source's samples in the order's), so that each source's part of every fixed field is one contiguous
slice of the batch's array, filled by that cache's own gather (misses computed and stored as ``ds.loader``'s are),
and each ragged field's parts are joined into one ``RaggedColumn``. Sources whose samples cannot be gathered that
way (a ``transform``, a ``max_shapes`` field) or a ``collate_fn`` of the caller's are read as samples
(``__getitems__``) and collated together. Which source each sample came from is the batch's ``sources``.

The sources' layouts must agree (``merged_layout``): the same fields, kinds, dtypes and fixed shapes; a field one
cache stores ragged and another at a fixed shape is read as ragged (the fixed values are one shape of it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from ..errors import LayoutError
from ..format.layout import Layout
from . import arena
from .collate import PadCollate
from .gather import alloc_shared, buffers, reserve_rows
from .heap_batch import same_storage
from .lending import Lending
from .ragged import RaggedColumn

__all__ = ["MixedReads", "merged_layout"]


class _Source(Protocol):
    """What a mixture reads of a source (``MmapCachedDataset`` provides it)."""

    @property
    def reads_batches(self) -> bool: ...

    def gather_columns(self, idx: np.ndarray, epoch: int, alloc: Callable[..., np.ndarray] = np.empty) -> list[Any]:
        ...

    def collate_columns(self, columns: list[Any], pad: Any = None) -> Any: ...

    def samples_at(self, indices: Sequence[int] | np.ndarray, epoch: int | None = None) -> list[Any]: ...

    def __len__(self) -> int: ...

    # The warm path reads a source's maps itself where it may (``MixedReads._take``): its reader and row map.
    def _ensure_open(self) -> Any: ...

    _rows: Any


def merged_layout(names: Sequence[str], layouts: Sequence[Layout]) -> int:
    """The source whose layout the mixture's batches take (one that stores ragged every field any source stores
    ragged), after checking that the layouts agree (see the module docstring).

    Raises:
        LayoutError: naming the sources and the field that differ, and the fix.
    """
    first, name = layouts[0], names[0]
    for other, other_name in zip(layouts[1:], names[1:]):
        where = f"the mixture's sources {name!r} and {other_name!r}"
        names_a, names_b = [f.name for f in first.fields], [f.name for f in other.fields]
        if names_a != names_b and sorted(names_a) == sorted(names_b):
            raise LayoutError(f"{where} hold the same fields in another order ({names_a} and {names_b}): a "
                              "mixture reads every source's fields in one order; return each dict's keys in the same "
                              f"order from every source (fields by path: {names_a}) and create that cache again")
        if other.structure != first.structure or names_b != names_a:
            raise LayoutError(f"{where} hold samples of different structures (fields {[f.name for f in first.fields]}"
                              f" and {[f.name for f in other.fields]}): a mixture's sources must return samples of "
                              "one structure (the same container and field names)")
        for a, b in zip(first.fields, other.fields):
            if (a.kind, a.dtype, a.torch_dtype, a.tensor_class) != (b.kind, b.dtype, b.torch_dtype, b.tensor_class):
                raise LayoutError(f"{where} differ in field {a.name!r}: {_describe(a)} and {_describe(b)}; a "
                                  "mixture's sources must store each field as one type (cast it in one source)")
            if len(a.shape) != len(b.shape) or ((a.variable or b.variable) and (a.variable, a.shape) != (
                    b.variable, b.shape)):
                raise LayoutError(f"{where} differ in field {a.name!r}'s shape: {a.shape} and {b.shape}")
            fixed = [x == y or x < 0 or y < 0 for x, y in zip(a.shape, b.shape)]
            if not all(fixed) or (not a.ragged and not b.ragged and a.shape != b.shape):
                raise LayoutError(f"{where} store field {a.name!r} at different fixed shapes ({_shape(a)} and "
                                  f"{_shape(b)}): a batch cannot stack them. Create the caches with "
                                  f"ragged=[{a.name!r}] (values packed at their own size mix freely), or resize the "
                                  "values in one source")
    ragged = [any(layout.fields[k].ragged for layout in layouts) for k in range(len(first.fields))]
    for s, layout in enumerate(layouts):
        if all(f.ragged or not r for f, r in zip(layout.fields, ragged)):
            return s
    field = next(f.name for k, f in enumerate(first.fields) if ragged[k] and not all(
        layout.fields[k].ragged for layout in layouts))
    raise LayoutError(f"the mixture's sources store different fields ragged (field {field!r} among them), and none "
                      f"stores ragged all that the others do: create them with the same ragged= list")


def _describe(field: Any) -> str:
    kind = f"{field.kind} of {field.torch_dtype or field.dtype}"
    return kind if field.tensor_class is None else f"{kind} ({'.'.join(field.tensor_class)})"


def _shape(field: Any) -> str:
    return str(tuple("*" if d < 0 else d for d in field.shape))


class MixedReads(Dataset):
    """Maps ``(epoch, indices, bounds)`` to a batch (see the module docstring): source ``s``'s indices are
    ``indices[bounds[s]:bounds[s + 1]]`` (``grouped``); with ``return_source`` the batch is ``(batch, sources)``.
    Sent to DataLoader workers: the sources pickle as their paths.

    Args:
        sources: the caches, in the mixture's order; ``starts``: each one's first flat id.
        layouts: their layouts; ``main``: the source whose layout the batches take (``merged_layout``).
        pad: a ``PadCollate`` fused into the gather, or None; ``collate``: a caller's ``collate_fn`` (read as
            samples), or None.
        return_source: yield ``(batch, sources)``, ``sources`` an int64 tensor of each sample's source.
    """

    lending: Lending | None = None  # while its loader starts workers (``read.lending``)

    def __init__(self, sources: Sequence[_Source], starts: np.ndarray, layouts: Sequence[Layout], main: int,
                 pad: PadCollate | None, collate: Any, return_source: bool) -> None:
        self.sources, self.starts, self.main = list(sources), starts, main
        self.pad, self.collate, self.return_source = pad, collate, return_source
        fields = [layout.fields for layout in layouts]
        self.fields = fields[main]
        self.ragged = [f.ragged for f in fields[main]]
        # Per source, per field: where its gather's fixed arrays go (the batch's slice, or a scratch array to be
        # joined as one shape of a ragged field).
        self.fixed_here = [[not f.ragged for f in source_fields] for source_fields in fields]
        self.dtypes = [f.np_dtype for f in fields[main]]
        self.shapes = [tuple(f.shape) for f in fields[main]]
        self.batched = collate is None and all(s.reads_batches for s in self.sources)
        self._pid = -1  # the process _prepare ran in

    def __getitem__(self, key: tuple[int, np.ndarray, tuple[int, ...]]) -> Any:
        return arena.read(self.lending, self._read, *key)

    def _read(self, epoch: int, indices: np.ndarray, bounds: tuple[int, ...]) -> Any:
        if self._pid != os.getpid():
            self._prepare()
        batch = self._warm_batch(epoch, indices, bounds) if self._all_warm else None
        if batch is None and self._direct is not None:
            batch = self._from_heaps(epoch, indices, bounds)
        if batch is not None:
            pass
        elif self.batched:
            parts = [(s, bounds[s], bounds[s + 1]) for s in range(len(self.sources)) if bounds[s + 1] > bounds[s]]
            batch = self._gathered(epoch, indices, parts)
        else:
            samples = [x for s in range(len(self.sources))  # (the variants of the mixture's epoch, as above)
                       for x in self.sources[s].samples_at(indices[bounds[s]:bounds[s + 1]], epoch)]
            batch = (self.collate or self.pad or default_collate)(samples)
        if not self.return_source:
            return batch
        return batch, torch.from_numpy(np.repeat(np.arange(len(self.sources)), np.diff(bounds)))

    def _warm_batch(self, epoch: int, indices: np.ndarray, bounds: tuple[int, ...]) -> Any:
        """``_gathered`` where every source is a cache of fixed fields this process reads as it is (``_prepare``):
        each part copied straight into the batch's arrays; None where a part is not complete or a writer changed a
        source meanwhile (the caller then gathers with the checks). The loop of a small-row batch: kept lean."""
        n = len(indices)
        alloc = self._alloc
        reserve_rows(self.fields, n)
        out = [alloc((n, *shape), dtype) for shape, dtype in zip(self.shapes, self.dtypes)]
        a = bounds[0]
        for s, warm in enumerate(self._warm):
            b = bounds[s + 1]
            if b == a:
                continue
            state, rowmap, data = warm  # type: ignore[misc]
            rows = indices[a:b] if rowmap is None else rowmap.rows_of(indices[a:b], epoch)
            counter = state.all_complete()
            if counter < 0 or (rowmap is not None and not rowmap.total and int(rows.min()) < 0):
                return None
            for target, field in zip(out, data):
                field.take(rows, 0, target[a:b], "clip")
            if state.changes[0] != counter:
                return None
            a = b
        return self._collate(out, self.pad)

    def _from_heaps(self, epoch: int, indices: np.ndarray, bounds: tuple[int, ...]) -> Any:
        """The batch read by its ``PadCollate``/``TextCollate`` straight from the sources' maps, every part at once
        (``read.heap_batch``): each token copied once, into the padded tensors; None where a part is not complete
        or a writer changed a source meanwhile (the caller gathers with the checks)."""
        parts = []
        for s, (reader, rowmap) in enumerate(self._direct):  # type: ignore[arg-type]
            a, b = bounds[s], bounds[s + 1]
            if a == b:
                continue
            rows = indices[a:b] if rowmap is None else rowmap.rows_of(indices[a:b], epoch)
            if rowmap is not None and not rowmap.total and int(rows.min()) < 0:
                return None  # (an index a partial cache does not hold: the checked gather computes it)
            parts.append((reader, rows))
        return self.pad.read_parts(parts) if parts else None  # type: ignore[union-attr]

    def _gathered(self, epoch: int, indices: np.ndarray, parts: list[tuple[int, int, int]]) -> Any:
        """Every source's part gathered into the batch's arrays (fixed fields) or joined (ragged ones). A source
        whose maps this process may read as they are (``_prepare``) is copied straight into them, if every row the
        part asks for is complete and no writer changed the cache meanwhile (its cache-wide counter, as
        ``RowReader.gather``'s warm path checks); any other part (a miss, a partial cache's uncached index, a
        ragged field) through the source's checked gather."""
        n = len(indices)
        alloc = self._alloc
        reserve_rows(self.fields, n)
        out = [None if ragged else alloc((n, *shape), dtype)
               for ragged, shape, dtype in zip(self.ragged, self.shapes, self.dtypes)]
        pieces: list[list[RaggedColumn]] = [[] for _ in self.ragged]
        for s, a, b in parts:
            idx = indices[a:b]
            warm = self._warm[s]
            if warm is not None:
                state, rowmap, data = warm
                rows = idx if rowmap is None else rowmap.rows_of(idx, epoch)
                counter = state.all_complete()
                if counter >= 0 and (rowmap is None or rowmap.total or int(rows.min()) >= 0):
                    for k, field in enumerate(data):
                        field.take(rows, 0, out[k][a:b], "clip")  # type: ignore[index]
                    if state.changes[0] == counter:
                        continue
            into = _slices(out, [k for k, here in enumerate(self.fixed_here[s]) if here], a, b)
            columns = self.sources[s].gather_columns(idx, epoch, into)
            for k, column in enumerate(columns):
                if self.ragged[k]:
                    pieces[k].append(column if isinstance(column, RaggedColumn) else _as_ragged(column))
        merged = [out[k] if not self.ragged[k] else _joined(pieces[k]) for k in range(len(self.ragged))]
        return self._collate(merged, self.pad)

    def _prepare(self) -> None:
        """This process's view of the sources (after a fork or unpickling in a worker): the maps of each source with
        fixed fields only (``(state, row map or None where rows are indices, data)``), the collation of the batches'
        layout, and where batches are made (shared memory in a DataLoader worker; recycled buffers here)."""
        self._warm: list[tuple[Any, Any, list[np.ndarray]] | None] = []
        for source, fixed in zip(self.sources, self.fixed_here):
            reader, rows = source._ensure_open(), source._rows
            # (Not where the batch's layout has a ragged field: a source that stores it fixed, of one shape, is
            # joined as ragged by its checked gather; the batch has no fixed array to copy it into.)
            if reader.ragged or reader.variable or rows.keyed or not all(fixed) or any(self.ragged):
                self._warm.append(None)
                continue
            identity = rows.total and rows.variants == 1 and rows.slot_index is None
            self._warm.append((reader.state, None if identity else rows, list(reader.data)))
        self._all_warm = self.batched and all(warm is not None for warm in self._warm)
        # Where the batch's PadCollate/TextCollate reads the sources' maps itself: each source's reader and row
        # map (None where rows are indices); None if a source's rows change meaning (a rotating share).
        self._direct: list[tuple[Any, Any]] | None = None
        readers = [source._ensure_open() for source in self.sources]
        if self.batched and self.pad is not None and same_storage(readers) and not any(
                source._rows.keyed for source in self.sources):
            self._direct = []
            for source, reader in zip(self.sources, readers):
                rows = source._rows
                identity = rows.total and rows.variants == 1 and rows.slot_index is None
                self._direct.append((reader, None if identity else rows))
        self._collate = self.sources[self.main]._ensure_open().collate
        self._alloc = alloc_shared if torch.utils.data.get_worker_info() is not None else buffers.empty
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        # The sources pickle as their paths; this process's maps stay here (a worker prepares its own).
        kept = {k: v for k, v in self.__dict__.items() if k not in ("_warm", "_collate", "_alloc", "_all_warm",
                                                                     "_direct")}
        return kept | {"_pid": -1}

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)


def _slices(out: list[Any], fixed: list[int], a: int, b: int) -> Callable[..., np.ndarray]:
    """A gather's ``alloc`` for one source's part (rows ``a`` to ``b``): its fixed fields, in field order (``fixed``:
    their numbers), into the batch's arrays; a field the batch holds ragged into a scratch array."""
    slots = iter(fixed)

    def into(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        target = out[next(slots)]
        return np.empty(shape, dtype) if target is None else target[a:b]
    return into


def _as_ragged(column: np.ndarray) -> RaggedColumn:
    """A fixed field's gathered values as a ragged column (each one value of its shape)."""
    shape = column.shape[1:]
    count = len(column)
    return RaggedColumn(np.ascontiguousarray(column).reshape(-1), np.full(count, math.prod(shape), np.int64),
                        np.tile(np.array(shape, np.int64), (count, 1)).reshape(count, len(shape)),
                        np.ones(count, bool))


def _joined(columns: list[RaggedColumn]) -> RaggedColumn:
    """Ragged columns of consecutive parts of a batch, as one."""
    if len(columns) == 1:
        return columns[0]
    joined = RaggedColumn(np.concatenate([c.flat for c in columns]), np.concatenate([c.counts for c in columns]),
                          np.concatenate([c.shapes for c in columns]), np.concatenate([c.valid for c in columns]))
    at = 0
    for column in columns:
        joined.patches.update({at + k: value for k, value in column.patches.items()})
        at += len(column.counts)
    return joined
