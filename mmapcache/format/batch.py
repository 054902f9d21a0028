"""A batch of a source's samples checked at once, straight into the batch's columns, and the memory the samples'
arrays lie in (a source that refills one buffer must not be trusted with a batch).

The per-sample check (``format.check``) is the reference: a batch filler accepts exactly what it accepts, and
declines a batch it cannot take whole, which the caller then checks one sample at a time.

A fixed field's column is an array with a leading batch axis. A ragged field's column is an object (the reader's
``RaggedColumn``) that takes a batch's values back to back: ``column.put_values(flat, counts, shapes, positions)``,
``flat`` the values' elements in C order (a new array the column keeps), ``counts`` each value's element count and
``shapes`` each one's shape ``(B, ndim)``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from .check import Slow, compile_walk, narrow_problem
from .codec import torch_dtype
from .layout import BOOL, BYTES, FLOAT, INT, NDARRAY, NPSCALAR, STR, TENSOR, TEXT_ERRORS, Field, Layout

# What a batch filler did with a batch (see compile_batch_filler).
FILLED, UNUSUAL, SHARED = "filled", "unusual", "shared"

# Fills a batch's columns at ``positions`` (None: every position, in order) from the samples computed for them.
BatchFiller = Callable[[list[Any], list[np.ndarray], "np.ndarray | None"], str]


def compile_batch_filler(layout: Layout) -> BatchFiller | None:
    """For a layout of plain fields (tensors, numpy arrays, Python and numpy scalars, and ragged tensors, arrays,
    ``str`` and ``bytes``: no list, tensor subclass or ``max_shapes`` field), a function that checks a batch of a
    source's samples at once and writes their values straight into the batch's columns: one stack per fixed field,
    and one concatenation per ragged one (its values copied once, back to back), instead of a conversion and an
    assignment per sample and field. None for other layouts, whose misses take ``compile_checker`` one by one.

    It returns ``FILLED``; or, having written nothing that matters (the caller overwrites it): ``UNUSUAL`` when a
    sample needs the per-sample check, ``SHARED`` when the memory of two samples' arrays overlaps (a source that
    refills one output buffer, whole or at shifting offsets: the earlier samples' values may be gone, they must be
    computed again one at a time; checked too when a sample does not have the layout's structure).

    It accepts exactly what ``compile_checker`` accepts, with one exception: tensors with the conjugate or
    negative bit set are stacked with the bit resolved, as ``Layout.check`` would convert them.
    """
    fillers = [_column_filler(f) for f in layout.fields]
    if not fillers or any(f is None for f in fillers):
        return None
    walk = compile_walk(layout.structure)
    count = len(fillers)
    by_field = list(enumerate(fillers))
    arrays = [n for n, f in enumerate(layout.fields) if f.kind in (TENSOR, NDARRAY) and (f.nbytes or f.ragged)]
    extents = [(n, _extents(layout.fields[n])) for n in arrays]

    def fill(samples: list[Any], columns: list[np.ndarray], positions: np.ndarray | None) -> str:
        leaves: list[Any] = []  # sample-major: sample j's field n is leaves[j * count + n]
        try:
            for sample in samples:
                walk(sample, leaves)
        except Slow:  # (the per-sample check explains; the samples' arrays, wherever they are, may still overlap)
            return SHARED if overlaps([arrays_of(sample) for sample in samples]) else UNUSUAL
        if not all(filler(leaves[n::count], columns[n], positions)  # type: ignore[misc]
                   for n, filler in by_field):
            return SHARED if arrays and overlaps([[leaves[j * count + n] for n in arrays]
                                                  for j in range(len(samples))]) else UNUSUAL
        if extents:
            # Every value has its field's type, dtype and shape here: each field's extents in a few C-level passes.
            parts = [extent(leaves[n::count]) for n, extent in extents]
            starts = np.concatenate([p[0] for p in parts])
            ends = np.concatenate([p[1] for p in parts])
            owners = np.tile(np.arange(len(samples), dtype=np.int64), len(parts))
            if ranges_overlap(starts, ends, owners):
                return SHARED
        return FILLED

    return fill


def _extents(field: Field) -> Callable[[list[Any]], tuple[np.ndarray, np.ndarray]]:
    """For values of a tensor or ndarray field (their type and dtype checked, and a fixed field's shape), the first
    and one past the last byte address of the memory each value spans, as two int64 arrays."""
    nbytes = field.nbytes
    address: Callable[[Any], int]
    contiguous: Callable[[Any], bool]
    if field.kind == NDARRAY:
        def address(x: Any) -> int:
            return x.__array_interface__["data"][0]
        contiguous = operator.attrgetter("flags.c_contiguous")
    else:
        import torch

        address, contiguous = torch.Tensor.data_ptr, torch.Tensor.is_contiguous
    sizes = operator.attrgetter("nbytes")  # (a ragged field's values: each its own; ndarray and Tensor both say)

    def extents(values: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        if all(map(contiguous, values)):
            starts = np.fromiter(map(address, values), np.int64, count=len(values))
            return starts, starts + (nbytes or np.fromiter(map(sizes, values), np.int64, count=len(values)))
        spans = np.array([span(x) for x in values], np.int64).reshape(-1, 2)
        return spans[:, 0], spans[:, 1]
    return extents


def span(x: Any) -> tuple[int, int]:
    """The first and one past the last byte address of the memory an array or tensor's elements lie in (for a
    strided view, everything between its lowest and highest element: a superset of the bytes it reads). ``(0, 0)``
    for an empty one, or for anything else."""
    strides: list[int]
    if isinstance(x, np.ndarray):
        if not x.size:
            return 0, 0
        start, itemsize, strides = x.__array_interface__["data"][0], x.itemsize, list(x.strides)
    elif hasattr(x, "data_ptr") and hasattr(x, "stride"):
        if not x.numel() or x.device.type != "cpu":
            return 0, 0
        itemsize = x.element_size()
        start, strides = x.data_ptr(), [s * itemsize for s in x.stride()]
    else:
        return 0, 0
    low = high = start
    for size, stride in zip(x.shape, strides):
        if stride >= 0:
            high += (size - 1) * stride
        else:
            low += (size - 1) * stride
    return low, high + itemsize


def arrays_of(sample: Any, out: list[Any] | None = None) -> list[Any]:
    """The tensors and arrays in a sample (found through dicts, lists and tuples), appended to ``out``."""
    out = [] if out is None else out
    if isinstance(sample, dict):
        for value in sample.values():
            arrays_of(value, out)
    elif isinstance(sample, (list, tuple)):
        for value in sample:
            arrays_of(value, out)
    elif hasattr(sample, "data_ptr") or isinstance(sample, np.ndarray):
        out.append(sample)
    return out


def overlaps(arrays_by_sample: list[list[Any]]) -> bool:
    """Whether the memory of two different samples' arrays or tensors overlaps (``arrays_by_sample[j]``: sample
    ``j``'s). Such a source refills one buffer: a sample computed earlier may already hold a later one's bytes.
    Views of one big read-only array (``data[i]``) lie apart; views of a buffer at shifting offsets
    (``buf[k:k + n]``) overlap, wherever they start."""
    spans = [(*span(x), j) for j, arrays in enumerate(arrays_by_sample) for x in arrays]
    if len(spans) < 2:
        return False
    table = np.array(spans, np.int64)
    return ranges_overlap(table[:, 0], table[:, 1], table[:, 2])


def ranges_overlap(starts: np.ndarray, ends: np.ndarray, owners: np.ndarray) -> bool:
    """Whether two byte ranges ``[start, end)`` of different owners share a byte (empty ranges never do).

    One sweep in address order: a range overlaps an earlier-starting one iff it starts before the furthest end
    reached so far; it is enough to compare its owner with the owner of that furthest-reaching range (if they are
    the same, that range and the other earlier one overlap, and that pair was found first)."""
    keep = ends > starts
    if int(np.count_nonzero(keep)) < 2:
        return False
    starts, ends, owners = starts[keep], ends[keep], owners[keep]
    order = np.argsort(starts, kind="stable")
    starts, ends, owners = starts[order], ends[order], owners[order]
    reach = np.maximum.accumulate(ends)
    # The position of the range that reached ``reach[k]`` (the last one to raise it).
    reacher = np.maximum.accumulate(np.where(ends == reach, np.arange(len(ends)), 0))
    return bool(np.any((starts[1:] < reach[:-1]) & (owners[1:] != owners[reacher[:-1]])))


def stack_runs(stack: Callable[..., Any], values: list[Any], out: Any, positions: np.ndarray | None) -> None:
    """``out[positions] = stack(values)`` (``positions`` None: all of ``out``), stacking each run of consecutive
    positions straight into its slice of ``out``: an indexed assignment of a stacked copy costs several times a
    contiguous stack (torch's ``index_put_`` moves 1-2 GB/s), and a batch's misses are usually all of its positions
    but a few already filled."""
    if positions is None:
        stack(values, out=out)
        return
    breaks = (np.flatnonzero(np.diff(positions) != 1) + 1).tolist()
    for first, end in zip([0, *breaks], [*breaks, len(positions)]):
        start = int(positions[first])
        stack(values[first:end], out=out[start:start + end - first])


def _column_filler(field: Field) -> Callable[[list[Any], Any, np.ndarray | None], bool] | None:
    """Checks one field's values of a batch and writes them into its column, or says False."""
    if field.variable or field.tensor_class is not None or field.metadata is not None:
        return None
    if field.ragged:
        return _ragged_filler(field)
    if field.kind in (INT, FLOAT, BOOL):
        expected: type = {INT: int, FLOAT: float, BOOL: bool}[field.kind]

        def fill_scalars(values: list[Any], column: np.ndarray, positions: np.ndarray | None) -> bool:
            if not all(type(x) is expected for x in values):
                return False
            try:
                column[slice(None) if positions is None else positions] = values
            except OverflowError:  # an int beyond int64: the per-sample check explains
                return False
            return True
        return fill_scalars
    dtype, shape = field.np_dtype, field.shape
    if field.kind in (NDARRAY, NPSCALAR):
        array = field.kind == NDARRAY

        def fill_arrays(values: list[Any], column: np.ndarray, positions: np.ndarray | None) -> bool:
            if array and not all(type(x) is np.ndarray and x.dtype == dtype and x.shape == shape for x in values):
                return False
            if not array and not all(isinstance(x, np.generic) and x.dtype == dtype for x in values):
                return False
            stack_runs(np.stack, values, column, positions)
            return True
        return fill_arrays
    if field.kind != TENSOR:
        return None
    import torch

    plain, target = torch.Tensor, torch_dtype(field)
    stack, from_numpy = torch.stack, torch.from_numpy
    stored_as_target = from_numpy(np.zeros(0, dtype)).dtype == target  # else stored as the uint of its width

    def fill_tensors(values: list[Any], column: np.ndarray, positions: np.ndarray | None) -> bool:
        # stack() refuses values of unequal shapes, so checking the first one's is enough; the dtype must be
        # checked on each, since stack() would cast.
        if not all(type(x) is plain and x.dtype == target for x in values) or values[0].shape != shape:
            return False
        out = from_numpy(column) if stored_as_target else from_numpy(column).view(target)
        try:
            # stack() also refuses what the cache must not take as is: a tensor that requires grad, or is on
            # another device.
            stack_runs(stack, values, out, positions)
        except (RuntimeError, TypeError):
            return False
        return True
    return fill_tensors


_dtype = operator.attrgetter("dtype")


def _ragged_filler(field: Field) -> Callable[[list[Any], Any, np.ndarray | None], bool] | None:
    """``_column_filler`` for a ragged field: its values checked as ``compile_checker`` checks them (type, dtype, the
    number of dimensions and the fixed ones, a narrowed field's values fitting its stored type), then copied once,
    back to back, into a new array the column keeps (``put_values``). Text is encoded as the per-sample check
    encodes it. Lists of numbers and json values take the per-sample check (None)."""
    ndim = len(field.shape)
    any_size = all(d < 0 for d in field.shape)
    fits = field.fits
    narrowed = field.stored is not None or field.ones

    def shapes_of(shapes: list[Any]) -> np.ndarray | None:
        """The values' shapes ``(B, ndim)``, or None where one is not the field's."""
        if any_size:
            if not all(len(shape) == ndim for shape in shapes):
                return None
        elif not all(fits(tuple(shape)) for shape in shapes):
            return None
        return np.array(shapes, np.int64).reshape(len(shapes), ndim)

    def counts_of(shapes: np.ndarray) -> np.ndarray:
        return shapes[:, 0].copy() if ndim == 1 else np.prod(shapes, axis=1, dtype=np.int64)

    def keep(column: Any, flat: np.ndarray, counts: np.ndarray, shapes: np.ndarray,
             positions: np.ndarray | None) -> bool:
        if narrowed and narrow_problem(field, flat) is not None:
            return False  # (the per-sample check names the sample and what does not fit)
        column.put_values(flat, counts, shapes, positions)
        return True

    if field.kind in (STR, BYTES):
        expected: type = str if field.kind == STR else bytes
        text = field.kind == STR

        def fill_text(values: list[Any], column: Any, positions: np.ndarray | None) -> bool:
            if not all(type(x) is expected for x in values):
                return False
            data = [x.encode("utf-8", TEXT_ERRORS) for x in values] if text else values
            counts = np.fromiter(map(len, data), np.int64, count=len(data))
            # (read-only: it lies in the joined bytes, which nobody can change)
            return keep(column, np.frombuffer(b"".join(data), np.uint8), counts, counts[:, None], positions)
        return fill_text
    dtype = field.np_dtype
    if field.kind == NDARRAY:
        def fill_arrays(values: list[Any], column: Any, positions: np.ndarray | None) -> bool:
            if not all(type(x) is np.ndarray and x.dtype == dtype for x in values):
                return False
            shapes = shapes_of([x.shape for x in values])
            if shapes is None:
                return False
            counts = counts_of(shapes)
            flat = np.empty(int(counts.sum()), dtype)
            np.concatenate(values, axis=None, out=flat)
            return keep(column, flat, counts, shapes, positions)
        return fill_arrays
    if field.kind != TENSOR:
        return None
    import torch

    plain, target = torch.Tensor, torch_dtype(field)
    cat, from_numpy = torch.cat, torch.from_numpy
    stored_as_target = from_numpy(np.zeros(0, dtype)).dtype == target  # else stored as the uint of its width

    dim, numel, types, dtypes = torch.Tensor.dim, torch.Tensor.numel, {plain}, {target}

    def fill_tensors(values: list[Any], column: Any, positions: np.ndarray | None) -> bool:
        # (sets of what map() finds: no Python frame per value)
        if set(map(type, values)) != types or set(map(_dtype, values)) != dtypes:
            return False
        if any_size and ndim == 1:  # (token ids: the sizes are the shapes, without a torch.Size each)
            if set(map(dim, values)) != {1}:
                return False
            counts = np.array(list(map(numel, values)), np.int64)
            shapes = counts[:, None]
        else:
            found = shapes_of([x.shape for x in values])
            if found is None:
                return False
            shapes, counts = found, counts_of(found)
        flat = np.empty(int(counts.sum()), dtype)
        out = from_numpy(flat) if stored_as_target else from_numpy(flat).view(target)
        try:
            # cat() also refuses what the cache must not take as is: a tensor that requires grad, or is on another
            # device (and resolves a conjugate or negative bit, as Layout.check converts such a tensor).
            cat(values if ndim == 1 else [x.reshape(-1) for x in values], out=out)
        except (RuntimeError, TypeError):
            return False
        return keep(column, flat, counts, shapes, positions)
    return fill_tensors
