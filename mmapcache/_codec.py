"""The codec of a layout: functions compiled once per cache that turn stored values back into samples and
batches, and the fast check that turns a source's sample into the values to store.

``_layout`` says what a sample's fields are; this module says how to convert between them and what the source
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

from ._layout import (
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
    encode_metadata,
    find_class,
    fold,
    number_list,
)
from .errors import CacheFormatError, LayoutError

# --- rebuilding ------------------------------------------------------------------------------------------------


def _namedtuple_class(module: str, qualname: str, names: list[str]) -> type:
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


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


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
        cls = _namedtuple_class(*spec)
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
        cls = _namedtuple_class(*spec)
        return lambda leaves: cls(*[p(leaves) for p in parts])

    def sequence(kind: str, parts: list[Callable], children: list[Any]) -> Callable:
        return lambda leaves: [p(leaves) for p in parts]

    built: Callable[[Sequence[Any]], Any] = fold(structure, leaf=_leaf_getter, mapping=mapping, record=record,
                                                 sequence=sequence)
    return built


def leaf_converter(field: Field) -> Callable[[np.ndarray], Any]:
    """A function turning a stored value (a fresh, writable numpy array) into what the source returned (a tensor
    subclass's field gives the plain tensor: ``subclass_wrapper`` makes the subclass)."""
    if field.kind == NDARRAY:
        return lambda a: a
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
    target = _torch_dtype(field)
    if from_numpy(np.zeros(0, field.np_dtype)).dtype == target:
        return from_numpy
    return lambda a: from_numpy(a).view(target)


def _torch_dtype(field: Field) -> Any:
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
    import torch

    from_numpy = torch.from_numpy
    if field.kind == PYLIST:
        def transpose(batch: np.ndarray) -> Any:
            if batch.ndim == 1:
                return from_numpy(batch)
            return [transpose(batch[:, i]) for i in range(batch.shape[1])]
        return transpose
    if field.kind == TENSOR:
        target = _torch_dtype(field)
        if from_numpy(np.zeros(0, field.np_dtype)).dtype != target:
            return lambda a: from_numpy(a).view(target)
    return from_numpy


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
    """The attributes ``encode_metadata`` wrote (see ``_format`` for the tags)."""
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


# --- the fast check on the publish path ------------------------------------------------------------------------


class _Slow(Exception):
    """Internal: the fast check met something unusual; ``Layout.check`` decides (and explains)."""


def compile_checker(layout: Layout, path: str = "PATH") -> Callable[[Any, int], list[Any]]:
    """A function equivalent to ``layout.check`` for well-formed samples, about 10x faster.

    It walks the known structure with exact type tests and compares each leaf's dtype and shape directly; on
    anything unexpected it defers to ``layout.check``, which raises the explanatory error (or accepts a rarer
    form, such as a tensor that requires grad). Scalar fields yield Python or numpy scalars, array fields numpy
    arrays (possibly views of the source's tensors).
    """
    walk = _compile_walk(layout.structure)
    leaf_checks = [_compile_leaf(f) for f in layout.fields if f.kind != JSON]
    # A tensor subclass's attributes become the value of its metadata field (they follow the structure's fields).
    described = [(number, f.name) for number, f in enumerate(layout.fields) if f.metadata is not None]

    def check(sample: Any, index: int) -> list[Any]:
        leaves: list[Any] = []
        try:
            walk(sample, leaves)
            values = [c(x) for c, x in zip(leaf_checks, leaves)]
        except _Slow:
            values = None  # decided outside the handler: an error raised there must not chain onto _Slow
        if values is None:
            return layout.check(sample, index, path)
        for number, name in described:
            leaf = leaves[number]
            values.append(encode_metadata(dict(vars(leaf)), name, type(leaf)))
        return values

    return check


def _compile_walk(structure: Any) -> Callable[[Any, list[Any]], None]:
    """A function appending a sample's leaves to a list, raising ``_Slow`` where the sample leaves the structure."""
    def leaf(number: int) -> Callable[[Any, list[Any]], None]:
        return lambda obj, out: out.append(obj)

    def sequence(kind: str, parts: list[Callable], children: list[Any]) -> Callable[[Any, list[Any]], None]:
        container = tuple if kind == "tuple" else list
        n = len(parts)

        def walk_sequence(obj: Any, out: list[Any]) -> None:
            if type(obj) is not container or len(obj) != n:
                raise _Slow
            for part, value in zip(parts, obj):
                part(value, out)
        return walk_sequence

    def mapping(keys: list[str], parts: list[Callable], children: list[Any]) -> Callable[[Any, list[Any]], None]:
        key_tuple = tuple(keys)
        if all(c.get("leaf") is not None for c in children):  # a flat dict of leaves: its values, in one step
            def walk_flat_dict(obj: Any, out: list[Any]) -> None:
                if type(obj) is not dict or tuple(obj) != key_tuple:
                    raise _Slow
                out.extend(obj.values())
            return walk_flat_dict

        def walk_dict(obj: Any, out: list[Any]) -> None:
            if type(obj) is not dict or tuple(obj) != key_tuple:
                raise _Slow
            for part, value in zip(parts, obj.values()):
                part(value, out)
        return walk_dict

    def record(spec: tuple[str, str, list[str]], parts: list[Callable],
               children: list[Any]) -> Callable[[Any, list[Any]], None]:
        names = tuple(spec[2])

        def walk_namedtuple(obj: Any, out: list[Any]) -> None:
            if getattr(type(obj), "_fields", None) != names:
                raise _Slow
            for part, value in zip(parts, obj):
                part(value, out)
        return walk_namedtuple

    return fold(structure, leaf=leaf, sequence=sequence, mapping=mapping, record=record)


def _compile_leaf(field: Field) -> Callable[[Any], Any]:
    shape_ok = field.fits
    if field.kind in (STR, BYTES, NPSTR, NPBYTES):
        expected_type: type = {STR: str, BYTES: bytes, NPSTR: np.str_, NPBYTES: np.bytes_}[field.kind]
        text = field.kind in (STR, NPSTR)

        def check_text(x: Any) -> Any:
            found = type(x)  # compared apart from x, so type checkers keep x as Any
            if found is not expected_type:
                raise _Slow
            data: Any = x.encode("utf-8", TEXT_ERRORS) if text else x
            return np.frombuffer(data, np.uint8)
        return check_text
    if field.kind == PYLIST:
        list_dtype = field.np_dtype

        def check_list(x: Any) -> Any:
            array = number_list(x) if type(x) is list and x else None
            if array is None or array.dtype != list_dtype or not shape_ok(array.shape):
                raise _Slow
            return array
        return check_list

    if field.kind == INT:
        def check_int(x: Any) -> Any:
            if type(x) is not int or not _INT64_MIN <= x <= _INT64_MAX:
                raise _Slow
            return x
        return check_int
    if field.kind in (FLOAT, BOOL):
        expected = float if field.kind == FLOAT else bool

        def check_scalar(x: Any) -> Any:
            if type(x) is not expected:
                raise _Slow
            return x
        return check_scalar
    dtype = field.np_dtype
    if field.kind == NPSCALAR:
        def check_npscalar(x: Any) -> Any:
            if not isinstance(x, np.generic) or x.dtype != dtype:
                raise _Slow
            return x
        return check_npscalar
    if field.kind == NDARRAY:
        def check_ndarray(x: Any) -> Any:
            if type(x) is not np.ndarray or x.dtype != dtype or not shape_ok(x.shape):
                raise _Slow
            return x
        return check_ndarray
    import torch

    tensor_type: type = torch.Tensor
    target = _torch_dtype(field)
    if field.tensor_class is not None:
        found = find_class(*field.tensor_class)
        tensor_type = found if isinstance(found, type) else type(None)  # unknown: the slow path explains
    # Types numpy lacks (bfloat16, complex32, float8) are stored as the unsigned int of their width.
    raw = getattr(torch, "uint" + str(8 * dtype.itemsize)) if field.torch_dtype and \
        torch.from_numpy(np.zeros(0, dtype)).dtype != target else None

    plain = torch.Tensor
    subclass = field.tensor_class is not None
    fixed_shape = None if field.ragged or field.variable else field.shape

    def check_tensor(x: Any) -> Any:
        found = type(x)  # compared apart from x, so type checkers keep x as Any
        if subclass and found is tensor_type:
            x = x.as_subclass(plain)
        elif found is not tensor_type or subclass:
            raise _Slow
        if x.dtype != target or (x.shape != fixed_shape if fixed_shape is not None else not shape_ok(tuple(x.shape))):
            raise _Slow
        try:
            # numpy() itself refuses what the cache must not take as is: a tensor that requires grad, is on another
            # device, or has its conjugate or negative bit set; the slow path then explains or converts.
            return (x.view(raw) if raw is not None else x).numpy()
        except (RuntimeError, TypeError):
            raise _Slow from None
    return check_tensor


def differing_field(layout: Layout, stored: list[Any], fresh: list[Any]) -> str | None:
    """The name of the first field whose stored value differs from a freshly checked one (bytes and shape)."""
    for field, a, b in zip(layout.fields, stored, fresh):
        a = np.asarray(a, dtype=field.np_dtype)
        b = np.asarray(b, dtype=field.np_dtype)
        if a.shape != b.shape or a.tobytes() != b.tobytes():
            return field.name
    return None
