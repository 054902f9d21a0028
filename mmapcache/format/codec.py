"""The codec of a layout: functions compiled once per cache that turn stored values back into samples and
batches (the other direction, a source's sample to the values to store, is ``format.check``).

``format.layout`` says what a sample's fields are; this module says how to convert between them and what the source
returned, as fast as Python allows (closures over the known structure, exact type tests, no per-call lookups).
Torch is imported only when a tensor field needs it.
"""

from __future__ import annotations

import json
import sys
from collections import namedtuple
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from ..errors import CacheFormatError, LayoutError
from .layout import (
    BOOL,
    BYTES,
    FLOAT,
    INT,
    JSON,
    NDARRAY,
    NPBYTES,
    NPSCALAR,
    NPSTR,
    PYLIST,
    STR,
    TENSOR,
    TEXT_ERRORS,
    Field,
    Layout,
    find_class,
    fold,
)

# --- rebuilding ------------------------------------------------------------------------------------------------


def namedtuple_class(module: str, qualname: str, names: list[str]) -> type:
    """The original namedtuple class if its module is already imported, else an equivalent one made from the
    stored field names. Never imports: ``meta.json`` must not be able to make a reader run a module's code."""
    try:
        obj: Any = sys.modules[module]
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if isinstance(obj, type) and list(getattr(obj, "_fields", ())) == names:
            return obj
    except Exception:
        pass
    return namedtuple(qualname.rsplit(".", 1)[-1], names)


def _leaf_numbers(children: list[Any]) -> list[int] | None:
    """The field numbers of ``children`` if every one is a bare leaf (the case worth a fast path), else None."""
    numbers = [c.get("leaf") for c in children]
    return numbers if None not in numbers else None


def _getter(numbers: list[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``leaves -> tuple(leaves[n] for n in numbers)``, in C where it can be (itemgetter of two or more)."""
    if len(numbers) >= 2:
        return itemgetter(*numbers)
    if numbers:
        n = numbers[0]
        return lambda leaves: (leaves[n],)
    return lambda leaves: ()


def _leaf_getter(index: int) -> Callable[[Sequence[Any]], Any]:
    """A builder's leaf: the converted value of field ``index``."""
    return itemgetter(index)


def sample_builder(structure: Any) -> Callable[[Sequence[Any]], Any]:
    """A function rebuilding one sample from its converted leaves (compiled once per cache, not per access)."""
    def sequence(kind: str, parts: list[Callable], children: list[Any]) -> Callable:
        numbers = _leaf_numbers(children)
        if kind == "tuple":
            if numbers is not None:
                return _getter(numbers)  # the common (input, target) pair: one C call, no generator
            return lambda leaves: tuple([p(leaves) for p in parts])
        return lambda leaves: [p(leaves) for p in parts]

    def mapping(keys: list[str], parts: list[Callable], children: list[Any]) -> Callable:
        numbers = _leaf_numbers(children)
        if numbers is not None:
            get = _getter(numbers)
            return lambda leaves: dict(zip(keys, get(leaves)))
        keyed = list(zip(keys, parts))
        return lambda leaves: {k: p(leaves) for k, p in keyed}

    def record(spec: tuple[str, str, list[str]], parts: list[Callable], children: list[Any]) -> Callable:
        cls = namedtuple_class(*spec)
        return lambda leaves: cls(*[p(leaves) for p in parts])

    built: Callable[[Sequence[Any]], Any] = fold(structure, leaf=_leaf_getter, sequence=sequence, mapping=mapping,
                                                 record=record)
    return built


def batch_builder(structure: Any) -> Callable[[Sequence[Any]], Any]:
    """A function building what torch's ``default_collate`` returns from already-batched leaves.

    ``default_collate`` turns a tuple of fields into a list (torch keeps this for backwards compatibility),
    keeps lists, dicts and namedtuples, and makes every leaf a batched tensor.
    """
    def mapping(keys: list[str], parts: list[Callable], children: list[Any]) -> Callable:
        keyed = list(zip(keys, parts))
        return lambda leaves: {k: p(leaves) for k, p in keyed}

    def record(spec: tuple[str, str, list[str]], parts: list[Callable], children: list[Any]) -> Callable:
        cls = namedtuple_class(*spec)
        return lambda leaves: cls(*[p(leaves) for p in parts])

    def sequence(kind: str, parts: list[Callable], children: list[Any]) -> Callable:
        return lambda leaves: [p(leaves) for p in parts]

    built: Callable[[Sequence[Any]], Any] = fold(structure, leaf=_leaf_getter, mapping=mapping, record=record,
                                                 sequence=sequence)
    return built


def leaf_converter(field: Field) -> Callable[[np.ndarray], Any]:
    """A function turning a stored value (a fresh, writable numpy array) into what the source returned (a tensor
    subclass's field gives the plain tensor: ``subclass_wrapper`` makes the subclass). A value stored narrower
    (``Field.stored``) comes back in the source's dtype."""
    served = field.np_dtype
    if field.kind == NDARRAY:
        return (lambda a: a.astype(served)) if field.stored is not None else (lambda a: a)
    if field.kind == STR:
        return lambda a: a.tobytes().decode("utf-8", TEXT_ERRORS)
    if field.kind == BYTES:
        return lambda a: a.tobytes()
    if field.kind == NPSTR:
        return lambda a: np.str_(a.tobytes().decode("utf-8", TEXT_ERRORS))
    if field.kind == NPBYTES:
        return lambda a: np.bytes_(a.tobytes())
    if field.kind == PYLIST:
        return lambda a: a.tolist()
    if field.kind == JSON:
        return lambda a: decode_metadata(a.tobytes(), field.name)
    if field.kind == INT:
        return lambda a: int(a)
    if field.kind == FLOAT:
        return lambda a: float(a)
    if field.kind == BOOL:
        return lambda a: bool(a)
    if field.kind == NPSCALAR:
        return lambda a: a[()]
    import torch

    from_numpy = torch.from_numpy
    target = torch_dtype(field)
    if field.stored is not None:
        wide = field.np_dtype
        if from_numpy(np.zeros(0, wide)).dtype == target:  # widened by numpy, as batches are (torch's float16 to
            return lambda a: from_numpy(a.astype(wide))  # float32 drops a NaN's sign bit)
        return lambda a: from_numpy(a).to(target)
    if from_numpy(np.zeros(0, field.np_dtype)).dtype == target:
        return from_numpy
    return lambda a: from_numpy(a).view(target)


def torch_dtype(field: Field) -> Any:
    import torch

    target = getattr(torch, field.torch_dtype or "", None)
    if not isinstance(target, torch.dtype):  # a damaged meta.json: refuse it here, not on every read
        raise CacheFormatError(f"field {field.name!r}: torch_dtype {field.torch_dtype!r} in meta.json is not a torch "
                               "dtype; the cache is damaged: remove it and build it again")
    return target


def batch_converter(field: Field) -> Callable[[np.ndarray], Any]:
    """A function turning a batch of stored values (leading batch axis, a fixed field) into what
    ``default_collate`` makes of them: a tensor; for a list of numbers, its transposition (nested lists of
    tensors of one element per sample, as ``default_collate`` builds from lists)."""
    from_numpy = shared_from_numpy()
    if field.kind == PYLIST:
        def transpose(batch: np.ndarray) -> Any:
            if batch.ndim == 1:
                return from_numpy(batch)
            return [transpose(batch[:, i]) for i in range(batch.shape[1])]
        return transpose
    if field.kind == TENSOR:
        target = torch_dtype(field)
        if from_numpy(np.zeros(0, field.np_dtype)).dtype != target:
            return lambda a: from_numpy(a).view(target)
    return from_numpy


def shared_from_numpy() -> Callable[[np.ndarray], Any]:
    """``torch.from_numpy``, except for an array that is a whole shared-memory tensor's numpy view (a DataLoader
    worker's batch column, ``read.gather.alloc_shared``): that tensor itself. ``torch.from_numpy`` would wrap the
    memory in a tensor torch does not know is shared, which the worker then copies into new shared memory to send
    it (the batch copied twice)."""
    import torch

    from_numpy, tensor = torch.from_numpy, torch.Tensor

    def convert(a: np.ndarray) -> Any:
        base = a.base
        if type(base) is tensor and base.shape == a.shape and base.is_shared() and (
                base.data_ptr() == a.__array_interface__["data"][0]):
            return base
        return from_numpy(a)
    return convert


# --- tensor subclasses -------------------------------------------------------------------------------------------


def subclass_wrapper(layout: Layout) -> Callable[[list[Any]], list[Any]] | None:
    """A function turning a row's converted leaves' plain tensors into their subclasses, with their attributes
    (from the metadata fields); None when the layout has no tensor subclass.

    Raises:
        LayoutError: a class the cache names is not among the imported modules (it is never imported because
            ``meta.json`` names it); the message names the module to import.
    """
    import torch

    wraps = []
    for number, field in enumerate(layout.fields):
        if field.tensor_class is None or field.metadata is None:
            continue
        module, qualname = field.tensor_class
        cls = find_class(module, qualname)
        if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
            raise LayoutError(
                f"field {field.name!r} holds {module}.{qualname} tensors, and that class is not loaded in this process "
                f"(mmapcache never imports a module because a cache names it); import {module.split('._')[0]} before "
                "opening the cache (in a DataLoader worker: in the module that defines the source or transform)"
            )
        wraps.append((number, field.metadata, cls))

    if not wraps:
        return None

    def wrap(leaves: list[Any]) -> list[Any]:
        for number, meta, cls in wraps:
            tensor = leaves[number].as_subclass(cls)
            tensor.__dict__.update(leaves[meta])
            leaves[number] = tensor
        return leaves
    return wrap


def decode_metadata(text: bytes, name: str) -> dict[str, Any]:
    """The attributes ``encode_metadata`` wrote (see ``format.spec`` for the tags)."""
    def decode(value: Any) -> Any:
        if type(value) is list:
            return [decode(v) for v in value]
        if type(value) is not dict:
            return value
        if "tuple" in value:
            return tuple(decode(v) for v in value["tuple"])
        if "dict" in value:
            return {k: decode(v) for k, v in value["dict"].items()}
        module, qualname, member = value["enum"]
        cls = find_class(module, qualname)
        if cls is None:
            raise LayoutError(f"field {name!r}: an attribute is a member of {module}.{qualname}, which is not loaded "
                              f"in this process (never imported by mmapcache); import {module} first")
        return cls[member]

    return {k: decode(v) for k, v in json.loads(text).items()}


def float_drift(layout: Layout, stored: list[Any], fresh: list[Any]) -> float | None:
    """If every field that differs is floating point and differs by at most a few parts in a million (the largest
    relative difference, returned), what a float pipeline computes differently with another number of threads or
    on other hardware; else None."""
    drift = 0.0
    for field, a, b in zip(layout.fields, stored, fresh):
        a, b = np.asarray(a, dtype=field.np_dtype), np.asarray(b, dtype=field.np_dtype)
        if a.shape == b.shape and a.tobytes() == b.tobytes():
            continue
        if a.shape != b.shape or a.dtype.kind not in "fc" or field.torch_dtype not in (None, "float32", "float64"):
            return None
        with np.errstate(all="ignore"):
            scale = np.maximum(np.abs(a), np.abs(b)).astype(np.float64)
            diff = np.abs(a.astype(np.complex128 if a.dtype.kind == "c" else np.float64) - b)
            if not (np.isfinite(diff).all() and (diff <= 1e-5 * scale + 1e-12).all()):
                return None
            drift = max(drift, float((diff / np.where(scale > 0, scale, 1)).max()))
    return drift


def differing_field(layout: Layout, stored: list[Any], fresh: list[Any]) -> str | None:
    """The name of the first field whose stored value differs from a freshly checked one (bytes and shape)."""
    for field, a, b in zip(layout.fields, stored, fresh):
        a = np.asarray(a, dtype=field.np_dtype)
        b = np.asarray(b, dtype=field.np_dtype)
        if a.shape != b.shape or a.tobytes() != b.tobytes():
            return field.name
    return None
