"""Reading ragged fields out of their heaps (``store.heap``): one value at a time, or a batch in one vectorised step.

A ragged field's row holds ``[offset, extent_bytes, *shape]`` in ``<field>.index.npy`` (see ``format.spec``); its value
is the first ``prod(shape) * itemsize`` bytes of the extent. A reader copies it under the row's seqlock (the caller,
``RowReader``, owns the loop): an index row being rewritten can describe bytes that are not a value yet, so every
reader here checks the extent lies inside the heap (``_Torn`` otherwise, and the caller retries). A batch is gathered
into one flat array with per-value counts and shapes (``RaggedColumn``), which the padding collate pads straight
from, and the splitters cut into per-sample values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import CacheFormatError
from ..format.codec import leaf_converter
from ..format.layout import BYTES, STR, TENSOR, TEXT_ERRORS, TEXT_KINDS, Field
from ..store.heap import Heap

__all__ = ["RAGGED_MARK", "RaggedColumn", "Torn", "gather_ragged", "mark_ragged", "ragged_reader", "ragged_splitter",
           "str_reader",
           "torch_target"]

RAGGED_MARK = "_mmapcache_ragged"  # on a ragged field's tensor values: default_collate lists them (read.collate)


def _words(index: np.ndarray) -> memoryview:
    """The index's int64 words as a flat memoryview (indexing one is ~3x faster than indexing numpy)."""
    if not index.size:
        return memoryview(b"").cast("q")
    return memoryview(index.reshape(-1)).cast("B").cast("q")  # type: ignore[arg-type]


# No value's shape may describe this many bytes or more, even an empty one's (its other dimensions): beyond what a
# heap can hold, and what numpy can shape.
_MAX_VALUE = 2**52


class Torn(Exception):
    """A ragged value's index row does not describe a value in the heap: a writer is rewriting it (the caller's
    seqlock then says so, and it reads again), or the index is damaged (``RowReader`` then raises
    ``CacheFormatError``). Never reaches a user."""


def ragged_reader(index: np.ndarray, heap: Heap, dtype: np.dtype) -> Callable[[int], np.ndarray]:
    """A function copying a ragged field's value of a row out of its heap, as numpy at its shape. Closes over the
    index's memoryview and the heap (never a store or reader: see ``RowReader.__init__``)."""
    width = index.shape[1]
    ndim = width - 2
    words = _words(index)

    itemsize = dtype.itemsize

    def read(row: int) -> np.ndarray:
        base = row * width
        offset, capacity = words[base], words[base + 1]
        if ndim == 1:
            shape: tuple[int, ...] = (words[base + 2],)
            end = offset + shape[0] * itemsize
            shaped = True
        else:
            shape = tuple(words[base + 2:base + width])
            end = offset + math.prod(shape) * itemsize
            # An empty value's other dimensions still make its shape: one numpy cannot make (0 x 2**63) is damage.
            shaped = math.prod(max(d, 1) for d in shape) * itemsize < _MAX_VALUE
        buf = heap.buf if end <= heap.size else heap.covering(end)
        if offset < 0 or end > offset + capacity or end > len(buf) or min(shape) < 0 or offset % itemsize or (
                not shaped):
            raise Torn(f"its index row [offset, extent, *shape] = {[offset, capacity, *shape]} describes no value "
                       f"inside the heap's {len(buf)} bytes")
        return buf[offset:end].view(dtype).reshape(shape).copy()
    return read


def ones_reader(index: np.ndarray, dtype: np.dtype) -> Callable[[int], np.ndarray]:
    """``ragged_reader`` for a field stored as ``"ones"``: the row's value is all ones of its recorded shape (nothing
    in the heap: its extent is empty)."""
    width = index.shape[1]
    words = _words(index)

    def read(row: int) -> np.ndarray:
        base = row * width
        shape = tuple(words[base + 2:base + width])
        if words[base] != 0 or words[base + 1] != 0 or min(shape) < 0 or math.prod(shape) >= _MAX_VALUE:
            raise Torn(f"its index row [offset, extent, *shape] = {[words[base], words[base + 1], *shape]} is not an "
                       "all-ones value's (no bytes, a shape)")
        return np.ones(shape, dtype)
    return read


def str_reader(index: np.ndarray, heap: Heap) -> Callable[[int], str]:
    """``_ragged_reader`` for a str field, straight to ``str`` (one copy, into the decoded string)."""
    words = _words(index)

    def read(row: int) -> str:
        offset, capacity, nbytes = words[row * 3], words[row * 3 + 1], words[row * 3 + 2]
        end = offset + nbytes
        buf = heap.buf if end <= heap.size else heap.covering(end)
        if offset < 0 or nbytes < 0 or nbytes > capacity or end > len(buf):
            raise Torn(f"its index row [offset, extent, length] = {[offset, capacity, nbytes]} describes no value "
                       f"inside the heap's {len(buf)} bytes")
        return buf.data[offset:end].tobytes().decode("utf-8", TEXT_ERRORS)
    return read


class RaggedColumn:
    """A batch of one ragged field's values, gathered back to back: ``flat`` (C order), ``counts`` elements each,
    ``shapes`` ``(B, ndim)``. Positions filled after the gather (misses) are ``patches``. ``valid`` marks the
    positions whose index row described a value (the others were being rewritten: the caller fills them)."""

    __slots__ = ("counts", "flat", "patches", "shapes", "valid")

    def __init__(self, flat: np.ndarray, counts: np.ndarray, shapes: np.ndarray, valid: np.ndarray) -> None:
        self.flat, self.counts, self.shapes, self.valid = flat, counts, shapes, valid
        self.patches: dict[int, np.ndarray] = {}

    @classmethod
    def empty(cls, count: int, ndim: int, dtype: np.dtype) -> RaggedColumn:
        """A column of ``count`` positions none of which was read (each to be filled by the caller)."""
        return cls(np.empty(0, dtype), np.zeros(count, np.int64), np.zeros((count, ndim), np.int64),
                   np.ones(count, bool))

    def __setitem__(self, position: int, value: np.ndarray) -> None:
        """Puts a miss's value at ``position``, as it is: the caller passes an array of its own (``Misses.fill``
        copies a computed value out of the source's memory once, before the next sample is computed, and a value
        read from the cache is a fresh copy), which the batch then holds."""
        self.patches[position] = value

    def put_values(self, flat: np.ndarray, counts: np.ndarray, shapes: np.ndarray,
                   positions: np.ndarray | None) -> None:
        """Puts misses' values at ``positions`` (None: every position, in order), given back to back in ``flat`` (an
        array of the caller's that the batch then holds: ``format.batch``'s fillers), ``counts`` elements each, of
        ``shapes``. Filling every position makes them the column's own values (nothing gathered is kept)."""
        if positions is None:
            self.flat, self.counts, self.shapes = flat, counts, shapes
            self.patches.clear()
            self.valid = np.ones(len(counts), bool)
            return
        ends = np.cumsum(counts).tolist()
        if shapes.shape[1] == 1:
            parts = [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]
        else:
            parts = [flat[a:b].reshape(shape) for a, b, shape in zip([0, *ends[:-1]], ends, shapes.tolist())]
        self.patches.update(zip(positions.tolist(), parts))

    def parts(self) -> list[np.ndarray]:
        """Each position's value (views into ``flat``; patches as given)."""
        flat, ends = self.flat, np.cumsum(self.counts).tolist()
        starts = [0, *ends[:-1]]
        if self.shapes.shape[1] == 1:
            parts = [flat[a:b] for a, b in zip(starts, ends)]
        else:
            parts = [flat[a:b].reshape(shape) for a, b, shape in zip(starts, ends, self.shapes.tolist())]
        for position, value in self.patches.items():
            parts[position] = value
        return parts

    def merged(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(flat, counts, shapes)`` with the patches folded in."""
        if not self.patches:
            return self.flat, self.counts, self.shapes
        patches = self.patches
        # A cold batch: every position a miss, nothing gathered (in any order the misses were put).
        parts = [patches[k] for k in range(len(self.counts))] if len(patches) == len(self.counts) else self.parts()
        flat = np.concatenate(parts, axis=None).astype(self.flat.dtype, copy=False)
        shapes = np.array([p.shape for p in parts], np.int64).reshape(len(parts), -1)
        return flat, np.array([p.size for p in parts], np.int64), shapes


# Values larger than this are copied slice by slice; smaller ones through one vectorised gather of their elements.
_SLICE_BYTES = 1 << 16


def shapeable(shapes: np.ndarray, itemsize: int) -> np.ndarray:
    """Which index rows' shapes ``(B, ndim)`` an array can have: an empty value's other dimensions still make its
    shape, and one numpy cannot make (``0 x 2**63``) is damage."""
    return np.prod(np.maximum(shapes, 1), axis=1, dtype=np.float64) * itemsize < _MAX_VALUE


def gather_ragged(field: Field, index: np.ndarray, heap: Heap, rows: np.ndarray,
                   readable: np.ndarray) -> RaggedColumn:
    """The values of ``rows`` (where ``readable``) of a ragged field, copied out of its heap in one step (for a field
    stored as ``"ones"``, made from the shapes alone), in the field's dtype: values stored narrower (``store_as``)
    are widened, so that every consumer of a column (splitters, padding, a mixture's joins) sees one dtype."""
    if field.ones:
        return _gather_ones(field, index, rows, readable)
    dtype = field.storage_dtype
    itemsize = dtype.itemsize
    entries = index.take(rows, 0)  # (take: 3x the speed of indexing)
    offsets, capacities, shapes = entries[:, 0], entries[:, 1], entries[:, 2:]
    # Sizes in float64 first: a damaged (or torn) index row must not overflow int64 into a valid-looking extent.
    nbytes = np.prod(shapes, axis=1, dtype=np.float64) * itemsize
    ends = offsets + nbytes
    sane = (offsets >= 0) & (shapes >= 0).all(axis=1) & (nbytes <= capacities) & (ends < _MAX_VALUE) & shapeable(
        shapes, itemsize)
    buf = heap.covering(int(ends[sane].max()) if sane.any() else 0)
    valid = sane & (ends <= len(buf)) & (offsets % itemsize == 0)
    use = readable & valid
    shapes = np.where(use[:, None], shapes, 0)
    counts = shapes[:, 0] if shapes.shape[1] == 1 else np.prod(shapes, axis=1)
    total = int(counts.sum())
    elements = buf[:len(buf) - len(buf) % itemsize].view(dtype)
    first = np.where(use, offsets // itemsize, 0)
    if total == 0:
        flat = np.empty(0, dtype)
    elif total * itemsize <= _SLICE_BYTES * max(1, int(use.sum())):
        starts = np.cumsum(counts) - counts
        flat = elements[np.repeat(first - starts, counts) + np.arange(total)]
    else:
        flat = np.concatenate([elements[a:a + c] for a, c in zip(first.tolist(), counts.tolist()) if c])
    if field.stored is not None:
        flat = flat.astype(field.np_dtype)
    return RaggedColumn(flat, counts, shapes, valid | ~readable)


def _gather_ones(field: Field, index: np.ndarray, rows: np.ndarray, readable: np.ndarray) -> RaggedColumn:
    entries = index.take(rows, 0)
    shapes = entries[:, 2:]
    valid = (entries[:, 0] == 0) & (entries[:, 1] == 0) & (shapes >= 0).all(axis=1) & shapeable(shapes, 1)
    shapes = np.where((readable & valid)[:, None], shapes, 0)
    counts = shapes[:, 0] if shapes.shape[1] == 1 else np.prod(shapes, axis=1)
    return RaggedColumn(np.ones(int(counts.sum()), field.np_dtype), counts, shapes, valid | ~readable)


def torch_target(field: Field) -> Any:
    if field.kind != TENSOR or field.torch_dtype is None:
        return None
    import torch

    return getattr(torch, field.torch_dtype)


def ragged_splitter(field: Field, path: str = "PATH") -> Callable[[RaggedColumn], list[Any]]:
    if field.kind in TEXT_KINDS:
        decode = field.kind == STR
        make = None if field.kind in (STR, BYTES) else leaf_converter(field)

        def split_text(column: RaggedColumn) -> list[Any]:
            data, ends = column.flat.tobytes(), np.cumsum(column.counts).tolist()
            out: list[Any] = [data[a:b] for a, b in zip([0, *ends[:-1]], ends)]
            for position, value in column.patches.items():
                out[position] = value.tobytes()
            if make is not None:
                return [make(np.frombuffer(b, np.uint8)) for b in out]
            if not decode:
                return out
            try:
                return [b.decode("utf-8", TEXT_ERRORS) for b in out]
            except UnicodeDecodeError as exc:  # copied under the seqlock, so stable: damage
                raise CacheFormatError(f"{path}: field {field.name!r}: a stored value is not UTF-8 ({exc}); the "
                                       f"cache is damaged: remove it (`mmapcache rm --force {path}`) and build it "
                                       f"again (`mmapcache verify {path}` lists the damage)") from None
        return split_text
    convert = leaf_converter(field)
    if field.kind == TENSOR:
        import torch

        target = torch_target(field)

        def split_tensors(column: RaggedColumn) -> list[Any]:
            flat = torch.from_numpy(column.flat)
            if flat.dtype != target:
                flat = flat.view(target)  # (a dtype numpy lacks: stored as the bits of its width)
            parts = list(flat.split(column.counts.tolist()))
            if column.shapes.shape[1] != 1:
                parts = [p.view(shape) for p, shape in zip(parts, column.shapes.tolist())]
            for position, value in column.patches.items():
                parts[position] = convert(value)
            for part in parts:  # (default_collate returns them as a list: read.collate)
                setattr(part, RAGGED_MARK, True)
            return parts
        return split_tensors
    return lambda column: [convert(p) for p in column.parts()]


def mark_ragged(sample: Any, fields: Sequence[Field]) -> None:
    """Marks the tensors of ``sample``'s ragged fields (found by their paths, ``"meta.ids"``, ``"0"``) as a gathered
    batch's values are marked (``ragged_splitter``): a batch read sample by sample (a cache with a ``max_shapes``
    field) is then collated as a gathered one, its ragged values listed."""
    import torch

    for field in fields:
        if not field.ragged or field.kind != TENSOR:
            continue
        value = sample if field.name == "<sample>" else _at(sample, field.name.split("."))
        if type(value) is torch.Tensor:  # (a subclass's attributes are its metadata, which a sample carries)
            setattr(value, RAGGED_MARK, True)


def _at(value: Any, parts: list[str]) -> Any:
    """The value at a field's path (its parts), or None: a dict's key may itself hold dots (``{"tok.ids": ...}`` is
    named as ``{"tok": {"ids": ...}}`` is), so the longest key that matches is tried first."""
    if not parts:
        return value
    if isinstance(value, Mapping):
        for n in range(len(parts), 0, -1):
            key = ".".join(parts[:n])
            if key in value:
                found = _at(value[key], parts[n:])
                if found is not None:
                    return found
        return None
    if isinstance(value, (tuple, list)) and parts[0].isdigit() and int(parts[0]) < len(value):
        return _at(value[int(parts[0])], parts[1:])
    return None
