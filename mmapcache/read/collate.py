"""Collating batches with ragged values: ``PadCollate`` pads them into one tensor and says each one's length.

``DataLoader(ds, collate_fn=PadCollate(pad_value=0))`` works over any dataset. ``ds.loader(collate_fn=PadCollate(
...))`` over an ``MmapCachedDataset`` gives the same batches, but pads straight from the cache's heaps: a batch of
1-D values (token ids) is one vectorised scatter, with no per-sample Python.

What a padded leaf becomes is a ``Padded(data, lengths, mask)``: ``data`` of shape ``(B, *max_shape)`` filled with
``pad_value`` past each value's end, ``lengths`` each value's size (``(B,)`` for 1-D values, else ``(B, ndim)``, its
shape), and ``mask`` a boolean tensor of ``data``'s shape that is True on real elements (with ``mask=True``; else
None). Leaves that are not padded are collated as ``torch.utils.data.default_collate`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import default_collate

from ..format.layout import JSON, TEXT_KINDS
from . import arena
from .gather import buffers, in_dataloader_worker
from .heap_batch import Located, WarmRows, bits_of, copy_rows, mark_rows, mask_of, padded_tensor
from .ragged import RAGGED_MARK, torch_target

__all__ = ["PadCollate", "Padded"]


class Padded(NamedTuple):
    """A batch of ragged values padded to the largest (see the module docstring)."""

    data: torch.Tensor
    lengths: torch.Tensor
    mask: torch.Tensor | None


class PadCollate:
    """A ``collate_fn`` that pads ragged leaves (token ids, boxes, variable-size images) into ``Padded`` batches.

    Args:
        pad_value: the value written past each value's end.
        mask: also return a boolean mask of the real elements.
        fields: the field paths to pad (``"input_ids"``, ``"0"``, ``"meta.tokens"``, as ``mmapcache`` names fields),
            each a ``Padded`` in every batch, also where its values share one shape (a field a cache stores fixed:
            every length full, the mask all True). Default: over an ``MmapCachedDataset`` (``ds.loader``), its
            ragged array fields; over anything else, every tensor, array or list of numbers whose shapes differ
            within the batch (so a batch whose values happen to share one shape is stacked: pass ``fields`` for the
            same type in every batch).
    """

    def __init__(self, pad_value: int | float | bool = 0, *, mask: bool = False,
                 fields: Iterable[str] | None = None) -> None:
        if isinstance(pad_value, (np.generic,)):
            pad_value = pad_value.item()
        if isinstance(fields, str):
            raise TypeError(f"fields must be a list of field paths, got the str {fields!r}; write fields=[{fields!r}]")
        if not isinstance(pad_value, (int, float, bool)):
            raise TypeError(f"pad_value must be a number, got {type(pad_value).__name__}")
        if not isinstance(mask, bool):
            raise TypeError(f"mask must be True or False, got {type(mask).__name__}")
        self.pad_value = pad_value
        self.mask = mask
        self.fields = None if fields is None else frozenset(fields)
        if self.fields is not None and not all(isinstance(name, str) for name in self.fields):
            raise TypeError(f"fields must be field paths (str), got {sorted(map(repr, self.fields))}")
        self._targets: dict[tuple[Any, ...], torch.dtype] = {}  # (see ``_padded``)

    def __call__(self, batch: list[Any]) -> Any:
        seen: set[str] = set()
        out = self._collate(batch, "", seen)
        self.check_fields(seen)
        return out

    def check_fields(self, paths: set[str]) -> None:
        """A ValueError if ``fields`` names a path the samples do not have (a typo would silently not pad)."""
        if self.fields is not None and not self.fields <= paths:
            raise ValueError(f"PadCollate(fields=...) names {sorted(self.fields - paths)}, which the samples do not "
                             f"have; their fields are {sorted(paths)}")

    def _collate(self, values: list[Any], path: str, seen: set[str]) -> Any:
        first = values[0]
        if isinstance(first, Mapping):
            return {key: self._collate([v[key] for v in values], _join(path, key), seen) for key in first}
        if isinstance(first, tuple) and hasattr(type(first), "_fields"):
            return type(first)(*(self._collate([v[i] for v in values], _join(path, str(i)), seen)
                                 for i in range(len(first))))
        numbers = _number_lists(values)
        if isinstance(first, (tuple, list)) and not numbers:
            return [self._collate([v[i] for v in values], _join(path, str(i)), seen) for i in range(len(first))]
        seen.add(path or "<sample>")
        if (isinstance(first, (torch.Tensor, np.ndarray)) or numbers) and self._pads(path, values):
            # (a batch of empty lists is int64, as TextCollate makes it: token ids are the usual lists of numbers)
            arrays, dtype = typed_alike(values, torch.int64 if numbers else None)
            counts = np.array([a.size for a in arrays], np.int64)
            flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.empty(0)
            shapes = np.array([a.shape for a in arrays], np.int64).reshape(len(arrays), -1)
            return self.pad(flat, counts, shapes, dtype)
        return default_collate(values)

    def _pads(self, path: str, values: list[Any]) -> bool:
        if self.fields is not None:
            return (path or "<sample>") in self.fields
        shapes = {tuple(np.shape(v)) for v in values}
        return len(shapes) > 1

    def pad(self, flat: np.ndarray, counts: np.ndarray, shapes: np.ndarray, dtype: torch.dtype | None) -> Padded:
        """Pads values given back to back (``flat``, C order), ``counts`` elements each, of ``shapes`` ``(B, ndim)``.

        Raises:
            ValueError: ``pad_value`` does not fit the values' dtype (``-1`` for uint8 values).
        """
        pad_value = self.pad_value
        stored = torch.from_numpy(np.zeros(0, flat.dtype)).dtype
        if dtype is not None and stored != dtype and _element_size(dtype) == flat.dtype.itemsize:
            # A dtype numpy lacks (bfloat16, float8) travels as the bits of its width: pad with the value's bits.
            pad_value = torch.tensor([pad_value], dtype=dtype).view(stored).item()
        else:
            _check_pad_value(pad_value, flat.dtype)
        if shapes.shape[1] == 1:
            data, real = _pad_1d(flat, counts, pad_value, self.mask)
        else:
            data, real = pad_flat(flat, counts, shapes, pad_value), None
        tensor = torch.from_numpy(data)
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.view(dtype) if tensor.element_size() == _element_size(dtype) else tensor.to(dtype)
        lengths = torch.from_numpy(shapes[:, 0].copy() if shapes.shape[1] == 1 else shapes.copy())
        mask = None
        if self.mask:
            if real is None:
                real = pad_flat(np.ones(len(flat), np.bool_), counts, shapes, False)
            mask = torch.from_numpy(real)
        return Padded(tensor, lengths, mask)


    # --- straight from caches' maps -------------------------------------------------------------------------------

    def read_parts(self, parts: list[tuple[Any, np.ndarray]]) -> Any:
        """The batch of the cache rows of ``parts`` (``(RowReader, rows)``: one cache's, or a mixture's sources' in
        turn) as the checked path collates it, each padded 1-D field copied once, straight from the heaps into
        ``data`` (``read.heap_batch``); None where a row is not complete, a writer changed a cache meanwhile, or a
        padded field has values of more dimensions (the caller gathers with the checks and collates)."""
        warm = WarmRows(parts)
        if not warm.begin():
            return None
        located: dict[int, Any] = {}
        for k, field in enumerate(warm.fields):
            if field.kind != JSON and field.ragged and field.kind not in TEXT_KINDS and (
                    self.fields is None or field.name in self.fields):
                located[k] = warm.located(k) if warm.paddable(k) else None
                if located[k] is None:
                    return None
        if arena.active():  # (a worker's batch: its padded tensors and masks in one shared storage)
            arena.reserve(sum(len(v.lengths) * int(v.lengths.max(initial=0)) * (
                self._target(warm.fields[k]).itemsize + self.mask) for k, v in located.items()),
                len(located) * (1 + self.mask))
        leaves: list[Any] = []
        masks: list[tuple[np.ndarray, torch.Tensor]] = []  # (see ``_padded``)
        for k, field in enumerate(warm.fields):
            if field.kind == JSON:
                leaves.append(None)  # a tensor subclass's attributes: default_collate's stack drops them too
                continue
            leaf = self._padded(field, located[k], masks) if k in located else self.named(field, warm.other(k))
            if leaf is None:
                return None
            leaves.append(leaf)
        batch = warm.reader.build_batch(leaves)
        return batch if warm.unchanged() else None

    def named(self, field: Any, batch: Any) -> Any:
        """A fixed field's batch; a ``Padded`` one if ``fields`` names the field (values of one shape, each length
        full, the mask all True), as over samples, where every named field is padded."""
        if (self.fields is None or field.name not in self.fields or field.kind in TEXT_KINDS
                or type(batch) is not torch.Tensor or batch.dim() < 2):
            return batch
        try:
            values: np.dtype | None = batch.numpy().dtype
        except TypeError:  # (a dtype numpy lacks, bfloat16: any number's bits pad it, as in ``pad``)
            values = None
        if values is not None:  # (as ``pad`` refuses a pad value the values' dtype cannot hold)
            _check_pad_value(self.pad_value, values)
        full = torch.tensor(batch.shape[1:], dtype=torch.int64)  # (as ``pad``: a length per value, or a shape)
        lengths = full.repeat(len(batch)) if batch.dim() == 2 else full.repeat(len(batch), 1)
        return Padded(batch, lengths, torch.ones(batch.shape, dtype=torch.bool) if self.mask else None)

    def _target(self, field: Any) -> torch.dtype:
        """The dtype a field's padded batch is served in."""
        key = (field.kind, field.torch_dtype, field.np_dtype)
        target = self._targets.get(key)
        if target is None:  # (once per kind of field: asking torch and numpy costs microseconds a batch)
            target = torch_target(field) or torch.from_numpy(np.zeros(0, field.np_dtype)).dtype
            if target == torch.from_numpy(np.zeros(0, field.np_dtype)).dtype:
                _check_pad_value(self.pad_value, field.np_dtype)  # (a dtype numpy lacks takes any number's bits)
            self._targets[key] = target
        return target

    def _padded(self, field: Any, located: Any, masks: list[tuple[np.ndarray, torch.Tensor]]) -> Padded:
        """A field's located values padded as ``pad`` pads them. The mask of lengths an earlier field of the batch
        had (``masks``: ``input_ids`` and ``attention_mask`` share theirs) is copied, not built again: a third of
        the time. (A copy, not the same tensor: a mask changed in place stays its field's.)"""
        target = self._target(field)
        lengths = located.lengths
        width = int(lengths.max()) if len(lengths) else 0
        data = padded_tensor(located, self.pad_value, target, width)
        mask = None
        if self.mask:
            made = next((m for seen, m in masks if np.array_equal(seen, lengths)), None)
            if made is None:
                mask = mask_of(lengths, width, torch.bool)
                masks.append((lengths, mask))
            else:
                mask = arena.like(made).copy_(made)
        return Padded(data, torch.from_numpy(lengths.copy()), mask)


def pad_flat(flat: np.ndarray, counts: np.ndarray, shapes: np.ndarray, pad_value: Any) -> np.ndarray:
    """A ``(B, *max_shape)`` array of the values given back to back, padded with ``pad_value``.

    1-D values take one vectorised scatter (no Python per sample); others are copied one by one.
    """
    batch, ndim = shapes.shape
    if ndim == 1:
        return _pad_1d(flat, counts, pad_value, False)[0]
    largest = tuple(int(d) for d in shapes.max(axis=0)) if batch else (0,) * ndim
    out = np.full((batch, *largest), pad_value, dtype=flat.dtype)
    start = 0
    for k, (count, shape) in enumerate(zip(counts.tolist(), shapes.tolist())):
        out[(k, *(slice(0, d) for d in shape))] = flat[start:start + count].reshape(shape)  # type: ignore[index]
        start += count
    return out


def _pad_1d(flat: np.ndarray, counts: np.ndarray, pad_value: Any,
            mask: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """1-D values given back to back, ``counts`` elements each, padded: ``(B, longest)`` of ``flat``'s dtype, and
    (``mask``) the boolean mask of the real elements; each copied row by row (``heap_batch.copy_rows``,
    ``mark_rows``: 0.75x the time of one boolean-mask assignment at (64, 1400) int64, its mask included). The
    padded array is made in a recycled buffer (``read.gather.BufferPool.bytes``) outside DataLoader workers."""
    width = int(counts.max()) if len(counts) else 0
    shape = (len(counts), width)
    if in_dataloader_worker():  # (its batch is sent to the main process: a buffer of its own)
        out = np.empty(shape, flat.dtype)
    else:
        out = buffers.bytes(len(counts) * width * flat.dtype.itemsize).view(flat.dtype).reshape(shape)
    out.fill(pad_value)
    flat = np.ascontiguousarray(flat)
    if len(flat) != int(counts.sum()):
        raise ValueError(f"{len(flat)} elements given for values of {int(counts.sum())}")
    copy_rows(out, Located([(flat, np.cumsum(counts) - counts, counts)], counts))
    real = None
    if mask:
        real = np.zeros(shape, np.bool_)
        mark_rows(real, counts)
    return out, real


def _check_pad_value(value: int | float | bool, dtype: np.dtype) -> None:
    """A ValueError unless ``value`` is exactly representable in ``dtype`` (the padded batch's)."""
    try:
        fits = np.array(value).astype(dtype).item() == value
    except (OverflowError, ValueError):
        fits = False
    if dtype.kind == "f" and isinstance(value, (int, float)):
        fits = True  # any number pads a float batch (rounded, as assignment rounds)
    if not fits:
        limits = f" ({np.iinfo(dtype).min}..{np.iinfo(dtype).max})" if dtype.kind in "iu" else ""
        raise ValueError(f"PadCollate(pad_value={value!r}) does not fit the values' dtype {dtype}{limits}; pass a "
                         "pad_value in its range, e.g. PadCollate(0)")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _number_lists(values: list[Any]) -> bool:
    """Whether a batch's values are lists of Python numbers (token ids), some of them possibly empty ``[]``, and
    maybe tensors or arrays among them (sources that give ids in both forms; one first is padded as tensors are)."""
    if not values or type(values[0]) is not list:
        return False
    found = False
    for value in values:
        if type(value) is not list:
            if isinstance(value, (torch.Tensor, np.ndarray)):
                continue
            return False
        probe = value
        while type(probe) is list and probe:
            probe = probe[0]
        if type(probe) in (int, float, bool):
            found = True
        elif value:
            return False
    return found or all(type(v) is list and not v for v in values)  # (every one []: no number to see, no other kind)


def typed_alike(values: list[Any], empty: torch.dtype | None = None) -> tuple[list[np.ndarray], torch.dtype]:
    """A batch's values of one field (tensors, arrays, lists of numbers) as numpy arrays of one dtype, and the torch
    dtype the batch holds them in: the non-empty values' dtype, or where those differ, the one ``torch.cat`` promotes
    them to (uint8 and int8: int16; int32 and int64: int64; bfloat16 and float16: float32), so that no value wraps
    or is read as another type's bits. An empty value has no type of its own (numpy makes an empty list float64,
    torch an empty tensor float32); where every one is empty, ``empty`` (None: the first value's own). A dtype
    numpy lacks (bfloat16) is given as its bits."""
    arrays = [_as_numpy(v) for v in values]
    if arrays:  # (the usual batch: every value of one type and dtype, decided without a step per value)
        first = values[0]
        if isinstance(first, torch.Tensor):
            if all(isinstance(v, torch.Tensor) and v.dtype == first.dtype for v in values):
                return arrays, first.dtype
        elif arrays[0].size and all(a.dtype == arrays[0].dtype for a in arrays) and not any(
                isinstance(v, torch.Tensor) for v in values):  # (an empty list's float64 is no dtype of its own)
            return arrays, torch_of(arrays[0].dtype)
    dtypes = [_dtype_of(v, a) for v, a in zip(values, arrays)]
    full = [dtype for dtype, a in zip(dtypes, arrays) if a.size]
    if full:
        target = full[0]
        for dtype in full[1:]:
            if dtype != target:
                target = torch.promote_types(target, dtype)
    else:
        target = empty if empty is not None else dtypes[0]
    if all(dtype == target for dtype in dtypes):
        return arrays, target
    return [a if dtype == target else _as_numpy((v if isinstance(v, torch.Tensor) else torch.from_numpy(a)).to(
        target)) for v, a, dtype in zip(values, arrays, dtypes)], target


def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        tensor = value.detach() if type(value) is torch.Tensor else value.as_subclass(torch.Tensor).detach()
        bits = bits_of(tensor.dtype)  # (bfloat16 and other dtypes numpy lacks: their bits, viewed back after padding)
        return (tensor if bits is None else tensor.view(bits)).numpy()
    array = np.asarray(value)
    # (another byte order, as np.load gives a foreign file's: torch takes only this machine's)
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _dtype_of(value: Any, array: np.ndarray) -> torch.dtype:
    """The torch dtype of a value (``array``, ``_as_numpy(value)``): a tensor's own, else its array's."""
    return value.dtype if isinstance(value, torch.Tensor) else torch_of(array.dtype)


_torch_dtypes: dict[np.dtype, torch.dtype] = {}


def torch_of(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy one (of this machine's byte order), kept per dtype (asking torch costs a
    microsecond or two)."""
    known = _torch_dtypes.get(dtype)
    if known is None:
        known = _torch_dtypes[dtype] = torch.from_numpy(np.empty(0, dtype)).dtype
    return known


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


# --- default collation of what MmapCachedDataset.__getitems__ returns ------------------------------------------------
#
# ``DataLoader(ds, batch_size=B)`` calls ``default_collate(ds.__getitems__(indices))``. ``__getitems__`` gathers each
# field into one batch tensor and hands out its rows as views; stacking them again would copy every byte a second
# time. So the views remember their batch (the ids of the views, in order, on the batch tensor), and a collate
# function registered for ``torch.Tensor`` in ``default_collate_fn_map`` (torch's documented way to extend
# ``default_collate``) returns that batch tensor when it is given exactly those views, in that order: one copy, the
# gather's. Anything else (other tensors, a subset, another order) is stacked as before. A ragged field's values
# (marked as such) are returned as a list, as ``ds.loader`` returns them, where ``torch.stack`` would fail.

_VIEWS = "_mmapcache_views"  # on a batch tensor: the ids of the row views split_rows handed out


def split_rows(batch: torch.Tensor) -> list[torch.Tensor]:
    """The rows of a gathered batch tensor as views, marked so that ``default_collate`` gives back ``batch``."""
    rows = list(batch.unbind(0))
    setattr(_root(batch), _VIEWS, tuple(map(id, rows)))
    return rows


def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor views of ``tensor`` name as their ``_base`` (itself, or the one it is a view of)."""
    return tensor if tensor._base is None else tensor._base


def _collate_tensors(batch: Any, *, collate_fn_map: Any = None) -> Any:
    first = batch[0]
    base = first._base
    views = getattr(base, _VIEWS, None) if base is not None else None
    if views is not None and len(views) == len(batch) and tuple(map(id, batch)) == views:
        return base if base.shape[0] == len(batch) else base.view(len(batch), *first.shape)
    if getattr(first, RAGGED_MARK, False) and all(getattr(t, RAGGED_MARK, False) for t in batch):
        return list(batch)
    return _stack(batch, collate_fn_map=collate_fn_map)


def _register() -> Any:
    from torch.utils.data._utils import collate as torch_collate

    table = torch_collate.default_collate_fn_map
    previous = table.get(torch.Tensor, torch_collate.collate_tensor_fn)
    if previous is not _collate_tensors:
        table[torch.Tensor] = _collate_tensors
    return previous if previous is not _collate_tensors else torch_collate.collate_tensor_fn


_stack = _register()
