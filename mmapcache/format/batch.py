"""A batch of a source's samples checked at once, straight into the batch's columns, and the memory the samples'
arrays lie in (a source that refills one buffer must not be trusted with a batch).

The per-sample check (``format.check``) is the reference: a batch filler accepts exactly what it accepts, and
declines a batch it cannot take whole, which the caller then checks one sample at a time.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from .check import Slow, compile_walk
from .codec import torch_dtype
from .layout import BOOL, FLOAT, INT, NDARRAY, NPSCALAR, TENSOR, Field, Layout

# What a batch filler did with a batch (see compile_batch_filler).
FILLED, UNUSUAL, SHARED = "filled", "unusual", "shared"

# Fills a batch's columns at ``positions`` (None: every position, in order) from the samples computed for them.
BatchFiller = Callable[[list[Any], list[np.ndarray], "np.ndarray | None"], str]


def compile_batch_filler(layout: Layout) -> BatchFiller | None:
    """For a layout of fixed-size plain fields (tensors, numpy arrays, Python and numpy scalars: no text, list,
    tensor subclass, ragged or ``max_shapes`` field), a function that checks a batch of a source's samples at once
    and writes their values straight into the batch's columns: one stack per field instead of a conversion and an
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
    arrays = [n for n, f in enumerate(layout.fields) if f.kind in (TENSOR, NDARRAY) and f.nbytes]
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
    """For values of a fixed tensor or ndarray field (its type, dtype and shape checked), the first and one past the
    last byte address of the memory each value spans, as two int64 arrays."""
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

    def extents(values: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        if all(map(contiguous, values)):
            starts = np.fromiter(map(address, values), np.int64, count=len(values))
            return starts, starts + nbytes
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


def _column_filler(field: Field) -> Callable[[list[Any], np.ndarray, np.ndarray | None], bool] | None:
    """Checks one field's values of a batch and writes them into its column, or says False."""
    if field.ragged or field.variable or field.tensor_class is not None or field.metadata is not None:
        return None
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
