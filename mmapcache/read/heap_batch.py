"""A warm batch read straight from the maps of one or more caches: the fused path of ``TextCollate`` and
``PadCollate``, for one cache's batch (``ds.loader``) or a mixture's (a part per source).

Each 1-D ragged field's values are *located* in their heaps (``Located``: per part, the heap's elements, where each
value starts and its length), not copied: the collate copies them once, into the padded (or flat) tensors
(``fill_padded``), widening values stored narrower (``store_as``) on the way. Every other field is gathered as the
checked path gathers it. This holds only while every row asked for is complete and no writer changes a cache
(each cache's cache-wide counter, as ``RowReader.gather``'s warm path checks it: ``begin``, then ``unchanged``
after the copies); anything else (a miss, an uncached index, an index row that describes no value) makes the
caller take the checked path, which computes what is missing and reports damage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from . import arena
from .gather import alloc_shared, buffers
from .ragged import gather_ragged

__all__ = ["Located", "WarmRows", "bits_of", "copy_rows", "fill_padded", "filled", "flat_tensor", "joined",
           "mark_rows", "mask_of", "padded_tensor", "positions", "same_storage"]

# At or below this many elements per value on average, values are padded by one vectorised scatter; above, each is
# copied as a slice (a Python step per value, no index arrays as long as the batch's tokens).
_SCATTER_BELOW = 24
_TEXT = ("str", "bytes")
_SIGN = np.int64(-(1 << 63))  # an int64's sign bit
_NOT_PADDED = ("str", "bytes", "numpy_str", "numpy_bytes", "json")


class Located(NamedTuple):
    """A 1-D ragged field's values of a batch, in their heaps: per part ``(elements, starts, lengths)`` (value ``k``
    of the part is ``elements[starts[k]:starts[k] + lengths[k]]``), and every value's length in the batch's order."""

    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    lengths: np.ndarray


class WarmRows:
    """The rows of a batch in one or more caches (``parts``: ``(RowReader, rows)``, the batch their rows in turn),
    read in place. The first part's reader gives the batch's fields; the others must store each field the same
    way (ragged or not: ``matches``).

    Use: ``begin()`` (False: take the checked path), then ``located``/``fixed``/``texts``/``split`` (None: take
    the checked path), then ``unchanged()`` (False: discard what was read, take the checked path). The caller
    checks once that the parts' caches store their fields alike (``same_storage``).
    """

    def __init__(self, parts: Sequence[tuple[Any, np.ndarray]]) -> None:
        self.parts = list(parts)
        self.reader = self.parts[0][0]
        self.fields = self.reader.fields
        self.size = sum(len(rows) for _, rows in self.parts)
        self._counters: list[int] = []

    def begin(self) -> bool:
        """Whether every part's cache is complete with no writer in it now (each one's counter is kept)."""
        self._counters = [reader.state.all_complete() for reader, _ in self.parts]
        return min(self._counters) >= 0

    def unchanged(self) -> bool:
        """Whether no writer changed any part's cache since ``begin``: what was read is what is stored."""
        return all(reader.state.changes[0] == counter for (reader, _), counter in zip(self.parts, self._counters))

    def paddable(self, k: int) -> bool:
        """Whether field ``k`` is a 1-D field of numbers, ragged or in fixed rows (what ``located`` finds)."""
        return self.paddable_field(self.fields[k])

    @staticmethod
    def paddable_field(field: Any) -> bool:
        """``paddable`` of a field."""
        return len(field.shape) == 1 and field.kind not in _NOT_PADDED and not field.variable

    def located(self, k: int) -> Located | None:
        """Field ``k``'s values (a 1-D ragged field of numbers), in their heaps; None if an index row describes no
        value there (damage, or a row being rewritten: the checked path says which). The index rows of every part
        are checked at once (a mixture's batch: one check for all its sources)."""
        fields = [reader.fields[k] for reader, _ in self.parts]
        if not fields[0].ragged:  # fixed rows: value r is row r of the field's array, whole
            return self._located_fixed(k)
        entries = [reader.store.index[k].take(rows, 0) for reader, rows in self.parts]  # (take: 3x indexing's speed)
        every = entries[0] if len(entries) == 1 else np.concatenate(entries)
        lengths = every[:, 2]
        if any(field.ones for field in fields):
            if every[:, :2].any() or not all(field.ones for field in fields) or (len(lengths) and lengths.min() < 0):
                return None  # (a field of ones has only lengths: its index rows' extents are empty)
            longest = _constant(1, fields[0].np_dtype, int(lengths.max()) if len(lengths) else 0)
            return Located([(longest, np.zeros(len(e), np.int64), e[:, 2]) for e in entries], lengths)
        dtypes = [field.storage_dtype for field in fields]
        sizes = [len(rows) for _, rows in self.parts]
        heaps = [reader.store.heaps[k] for reader, _ in self.parts]
        # Each row's item size and what its value may reach (its heap's mapped bytes): scalars for one cache (an
        # item size also for sources stored alike), else set part by part (sources stored in other widths).
        itemsize: Any = dtypes[0].itemsize
        mapped: Any = heaps[0].size
        if len(heaps) > 1:
            mapped, a = np.empty(len(lengths), np.int64), 0
            wide = any(dtype != dtypes[0] for dtype in dtypes[1:])
            if wide:
                itemsize = np.empty(len(lengths), np.int64)
            for heap, size, dtype in zip(heaps, sizes, dtypes):
                mapped[a:a + size] = heap.size
                if wide:
                    itemsize[a:a + size] = dtype.itemsize
                a += size
        offsets = every[:, 0]
        nbytes = lengths * itemsize
        # Each sign bit (a negative offset or length, a length past the heap's size, so large its bytes would
        # overflow, a value past its extent or past the mapped heap) and each offset's bits below the item size.
        if len(lengths) and (((offsets | lengths | (mapped - lengths) | (every[:, 1] - nbytes) | (
                mapped - offsets - nbytes)) & _SIGN) | (offsets & (itemsize - 1))).any() and not self._remapped(
                heaps, offsets + nbytes, sizes, every, itemsize):
            return None
        starts, parts, a = offsets // itemsize, [], 0
        for heap, size, dtype in zip(heaps, sizes, dtypes):
            parts.append((heap.elements(dtype), starts[a:a + size], lengths[a:a + size]))
            a += size
        return Located(parts, lengths)

    def _located_fixed(self, k: int) -> Located:
        """``located`` for a 1-D field in fixed rows (its length the field's): each part's rows in its array."""
        parts, lengths = [], []
        for reader, rows in self.parts:
            data = reader.data[k]
            width = data.shape[1] if data.ndim > 1 else 1
            part = np.full(len(rows), width, np.int64)
            parts.append((data.reshape(-1), rows * width, part))
            lengths.append(part)
        return Located(parts, lengths[0] if len(lengths) == 1 else np.concatenate(lengths))

    @staticmethod
    def _remapped(heaps: list[Any], ends: np.ndarray, sizes: list[int], every: np.ndarray, itemsize: Any) -> bool:
        """After ``located``'s check failed: whether every value is sound once each heap is mapped as far as its
        values reach (a heap grown since this process mapped it), or None-worthy damage."""
        offsets, lengths = every[:, 0], every[:, 2]
        if ((offsets & (itemsize - 1 | _SIGN)) | (lengths & _SIGN)).any() or (
                lengths * itemsize > every[:, 1]).any():
            return False
        a = 0
        for heap, size in zip(heaps, sizes):
            end = int(ends[a:a + size].max()) if size else 0
            if end > heap.size and end > len(heap.covering(end)):
                return False
            a += size
        return True

    def fixed(self, k: int) -> Any:
        """Field ``k``'s values (a fixed field), taken into one array, converted as the batch holds them."""
        column = _alloc((self.size, *self.fields[k].shape), self.fields[k].np_dtype)
        a = 0
        for reader, rows in self.parts:
            reader.data[k].take(rows, 0, column[a:a + len(rows)], "clip")
            a += len(rows)
        return self.reader._batch_converters[k](column)

    def texts(self, k: int) -> list[Any] | None:
        """Field ``k``'s values (a ragged ``str`` or ``bytes`` field), each sliced out of its heap and decoded."""
        out: list[Any] = []
        for reader, rows in self.parts:
            store = reader.store
            values = _texts(reader.fields[k].kind, store.index[k], store.heaps[k], rows)
            if values is None:
                return None
            out += values
        return out

    def split(self, k: int) -> list[Any] | None:
        """Field ``k``'s values (any other ragged field: more dimensions, numpy strings), gathered and split as the
        checked path does."""
        out: list[Any] = []
        for reader, rows in self.parts:
            store = reader.store
            column = gather_ragged(reader.fields[k], store.index[k], store.heaps[k], rows, np.ones(len(rows), bool))
            if not column.valid.all():
                return None
            out += reader._splitters[k](column)
        return out

    def other(self, k: int) -> Any:
        """Field ``k`` read as the checked path collates a field it does not pad (None: take the checked path)."""
        field = self.fields[k]
        if field.variable or field.kind == "json":
            return None
        if not field.ragged:
            return self.fixed(k)
        return self.texts(k) if field.kind in _TEXT else self.split(k)


def same_storage(readers: Sequence[Any]) -> bool:
    """Whether every reader's cache stores each field as the first one does (ragged, fixed or ``max_shapes``): what
    ``WarmRows`` needs of a mixture's sources."""
    first = [(f.ragged, f.variable) for f in readers[0].fields]
    return all([(f.ragged, f.variable) for f in reader.fields] == first for reader in readers[1:])


def _alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return alloc_shared(shape, dtype) if torch.utils.data.get_worker_info() is not None else np.empty(shape, dtype)


def _texts(kind: str, index: np.ndarray, heap: Any, rows: np.ndarray) -> list[Any] | None:
    entries = index.take(rows, 0)
    offsets, lengths = entries[:, 0], entries[:, 2]
    end = int((offsets + lengths).max()) if len(rows) else 0
    buf = heap.buf if end <= heap.size else heap.covering(end)
    if len(rows) and (int(offsets.min()) < 0 or int(lengths.min()) < 0 or end > len(buf)):
        return None
    data = buf.data
    if kind == "bytes":
        return [data[o:o + n].tobytes() for o, n in zip(offsets.tolist(), lengths.tolist())]
    return [str(data[o:o + n], "utf-8", "surrogatepass") for o, n in zip(offsets.tolist(), lengths.tolist())]


# --- filling the batch's tensors --------------------------------------------------------------------------------

_BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def bits_of(dtype: torch.dtype) -> torch.dtype | None:
    """For a dtype numpy has no type for (bfloat16, float8, complex32), the unsigned integer of its width, whose bits
    stand in for it (as a cache stores it); None for any other."""
    return _storage(dtype)[0]


_storages: dict[torch.dtype, tuple[torch.dtype | None, np.dtype]] = {}


def _storage(dtype: torch.dtype) -> tuple[torch.dtype | None, np.dtype]:
    """``bits_of(dtype)``, and the numpy dtype a tensor of ``dtype`` is filled as (its bits' for one numpy lacks);
    kept per dtype (asking torch costs microseconds, a batch asks several times)."""
    known = _storages.get(dtype)
    if known is None:
        try:
            known = (None, torch.empty(0, dtype=dtype).numpy().dtype)
        except TypeError:
            bits = _BITS[torch.empty(0, dtype=dtype).element_size()]
            known = (bits, torch.empty(0, dtype=bits).numpy().dtype)
        _storages[dtype] = known
    return known


def padded_tensor(located: Located, pad: Any, dtype: torch.dtype, width: int) -> torch.Tensor:
    """A ``(B, width)`` tensor of ``dtype``: each located value from column 0, then ``pad``; copied once, converted
    on the way (a narrower stored dtype). A dtype numpy lacks is filled as its bits (the located values are)."""
    bits = _storage(dtype)[0]
    if bits is not None:
        pad = torch.tensor([pad], dtype=dtype).view(bits).item()
    out = filled((len(located.lengths), width), pad, bits or dtype)
    copy_rows(out.numpy(), located)
    return out if bits is None else out.view(dtype)


def copy_rows(target: np.ndarray, located: Located) -> None:
    """Copies the located values into the rows of ``target`` (``(B, width)``, C-contiguous, already padded), each
    from column 0, converted to ``target``'s dtype on the way: long values as they are stored, each value's bytes
    into its row through memoryviews (a slice costs a third of a numpy slice; 0.6x the time of one boolean-mask
    assignment at (64, 1400) int64); short ones in one scatter, and values stored narrower widened row by row (faster
    than a masked scatter)."""
    count = len(located.lengths)
    if not target.size:
        return
    if int(located.lengths.sum()) > _SCATTER_BELOW * count and _as_stored(located, target.dtype):
        raw, row, r = target.data.cast("B"), target.strides[0], 0
        for elements, starts, lengths in located.parts:
            for piece in _pieces(elements, starts, lengths):
                raw[r:r + len(piece)] = piece
                r += row
    else:
        fill_padded(target, located)


def _as_stored(located: Located, np_dtype: np.dtype) -> bool:
    """Whether every part holds ``np_dtype`` values, contiguous: their bytes are the batch's, copied as they are."""
    return all(elements.dtype == np_dtype and elements.flags.c_contiguous for elements, _, _ in located.parts)


def _stored_flat(elements: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A part's located values back to back, in their stored dtype (``elements``, 1-D, contiguous)."""
    return np.frombuffer(bytearray().join(_pieces(elements, starts, lengths)) or bytearray(0), elements.dtype)


_kept: dict[tuple[Any, ...], np.ndarray] = {}


def _constant(value: Any, dtype: np.dtype, length: int) -> np.ndarray:
    """At least ``length`` elements of ``value`` (``value`` None: the ramp 0, 1, 2, ...), kept per value and dtype
    and grown as batches widen: the rows the warm path copies pads, ones and positions from."""
    key = (value, dtype)
    held = _kept.get(key)
    if held is None or len(held) < length:
        if len(_kept) > 64:
            _kept.clear()
        size = max(length, 4096)
        held = _kept[key] = np.arange(size, dtype=dtype) if value is None else np.full(size, value, dtype)
    return held


def filled(shape: tuple[int, ...], value: Any, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``value``; in a DataLoader worker over shared memory, so that the batch crosses to the main
    process without the copy sending an ordinary tensor costs (``read.gather.alloc_shared``'s way). Elsewhere in a
    recycled buffer (``read.gather.BufferPool.bytes``: one no batch references any more), refilled: a new padded
    batch's array of a megabyte was page-faulted in on its first writes (np.zeros: fresh pages), which cost more
    than copying the tokens into it."""
    if torch.utils.data.get_worker_info() is None:
        np_dtype = _storage(dtype)[1]
        out = buffers.bytes(math.prod(shape) * np_dtype.itemsize).view(np_dtype).reshape(shape)
        out.fill(value)
        return torch.from_numpy(out)
    np.empty(1, _storage(dtype)[1]).fill(value)  # (refuses what does not fit, as numpy's fill above; torch's wraps)
    return arena.tensor(shape, dtype).fill_(value)


def fill_padded(target: np.ndarray, located: Located) -> None:
    """Copies the located values into the rows of ``target`` (``(B, width)``, already padded), each from column 0;
    converted to ``target``'s dtype on the way."""
    a = 0
    for elements, starts, lengths in located.parts:
        _fill_rows(target[a:a + len(lengths)], elements, starts, lengths)
        a += len(lengths)


def _fill_rows(target: np.ndarray, elements: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
    total = int(lengths.sum())
    if not total:
        return
    if total <= _SCATTER_BELOW * len(lengths):
        rows = np.repeat(np.arange(len(lengths)), lengths)
        first = np.repeat(np.cumsum(lengths) - lengths, lengths)
        column = np.arange(total) - first
        target[rows, column] = elements[np.repeat(starts, lengths) + column]
        return
    for k, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
        target[k, :length] = elements[start:start + length]


def flat_tensor(located: Located, dtype: torch.dtype) -> torch.Tensor:
    """A ``(T,)`` tensor of ``dtype``: the located values back to back, copied once (converted on the way: a
    narrower stored dtype). A dtype numpy lacks is filled as its bits."""
    bits, np_dtype = _storage(dtype)
    if _as_stored(located, np_dtype):
        out = joined([piece for elements, starts, lengths in located.parts
                      for piece in _pieces(elements, starts, lengths)], bits or dtype)
        return out if bits is None else out.view(dtype)
    total = int(located.lengths.sum())
    out = filled((total,), 0, bits or dtype) if torch.utils.data.get_worker_info() is not None else torch.empty(
        total, dtype=bits or dtype)
    target, at = out.numpy(), 0
    for elements, starts, lengths in located.parts:
        if elements.flags.c_contiguous:  # stored narrower: joined as stored, widened in one copy
            size = int(lengths.sum())
            target[at:at + size] = _stored_flat(elements, starts, lengths)
            at += size
            continue
        for start, length in zip(starts.tolist(), lengths.tolist()):
            target[at:at + length] = elements[start:start + length]
            at += length
    return out if bits is None else out.view(dtype)


def joined(pieces: list[memoryview], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` (one numpy has) of the pieces' bytes back to back: one ``bytearray.join`` (sized
    once, then filled; a memoryview slice per value costs a third of a numpy slice), which the tensor owns. In a
    DataLoader worker, in shared memory (see ``filled``)."""
    if torch.utils.data.get_worker_info() is None:
        data = bytearray().join(pieces)
        return torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    nbytes = sum(len(piece) for piece in pieces)
    out = filled((nbytes,), 0, torch.uint8)
    target, at = out.numpy().data, 0
    for piece in pieces:
        target[at:at + len(piece)] = piece
        at += len(piece)
    return out.view(dtype)


def _pieces(elements: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> list[memoryview]:
    """Each located value's bytes, as a memoryview of ``elements`` (1-D, contiguous)."""
    raw, size = elements.data.cast("B"), elements.itemsize
    return [raw[a:b] for a, b in zip((starts * size).tolist(), ((starts + lengths) * size).tolist())]


def positions(lengths: np.ndarray) -> torch.Tensor:
    """Each value's positions ``0 .. length - 1``, value after value (int64): the front of one ramp per value,
    joined as ``flat_tensor`` joins values."""
    ramp = _constant(None, np.dtype(np.int64), int(lengths.max()) if len(lengths) else 0)
    raw = ramp.data.cast("B")
    return joined([raw[:n] for n in (lengths * ramp.itemsize).tolist()], torch.int64)


def mask_of(lengths: np.ndarray, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, width)``: 1 (True) where position ``j < lengths[k]``, else 0. A dtype numpy lacks (bfloat16) is filled
    as its bits, 1.0's."""
    bits = bits_of(dtype)
    out = filled((len(lengths), width), 0, bits or dtype)
    mark_rows(out.numpy(), lengths, 1 if bits is None else torch.ones(1, dtype=dtype).view(bits).item())
    return out if bits is None else out.view(dtype)


def mark_rows(target: np.ndarray, lengths: np.ndarray, one: Any = 1) -> None:
    """Sets ``target[k, :lengths[k]]`` to ``one`` (1, True) in ``target`` (``(B, width)``, C-contiguous, zeroed), row
    by row: a third of one broadcast comparison's time."""
    if not target.size:
        return  # (no row or no column: a memoryview of it cannot be cast)
    raw, row, r = target.data.cast("B"), target.strides[0], 0
    ones = _constant(one, target.dtype, target.shape[1]).data.cast("B")
    for n in (lengths * target.itemsize).tolist():
        raw[r:r + n] = ones[:n]
        r += row
