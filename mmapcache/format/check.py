"""The fast checks on the publish path: a source's sample, or a batch of them, to the values to store.

``Layout.check`` (in ``format.layout``) is the reference: it accepts every form a leaf may take and explains every
refusal. The functions here are compiled once per cache from its layout and accept only the usual forms (exact
types, the stored dtype and shape), much faster; on anything else they defer to ``Layout.check``, so that they never
accept what it would refuse and never explain anything themselves.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import LayoutError
from .codec import torch_dtype
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
    TEXT_ERRORS,
    Field,
    Layout,
    encode_metadata,
    find_class,
    fold,
    number_list,
)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _call(function: Callable[..., Any], *args: Any) -> Any:
    return function(*args)


# ``call(f, x)`` is ``f(x)``: with ``map``, a list of results without a comprehension's frame (Python 3.11+ in C).
call: Callable[..., Any] = getattr(operator, "call", _call)


class Slow(Exception):
    """Internal: the fast check met something unusual; ``Layout.check`` decides (and explains)."""


def compile_checker(layout: Layout, path: str = "PATH", refused: Callable[[LayoutError, int], Exception] | None = None,
                    *, narrow: bool = True) -> Callable[[Any, int], list[Any]]:
    """A function equivalent to ``layout.check`` for well-formed samples, about 10x faster.

    It walks the known structure with exact type tests and compares each leaf's dtype and shape directly; on
    anything unexpected it defers to ``layout.check``, which raises the explanatory error (or accepts a rarer
    form, such as a tensor that requires grad). Scalar fields yield Python or numpy scalars, array fields numpy
    arrays (possibly views of the source's tensors). ``refused(error, index)``, if given, says what to raise
    instead of a ``LayoutError`` (the error itself, or another raised from it: a cache whose own layout is damaged).
    ``narrow=False`` leaves out whether narrowed fields' values fit their stored type (a sample served, not stored).
    """
    walk = compile_walk(layout.structure)
    leaf_checks = [_compile_leaf(f) for f in layout.fields if f.kind != JSON]
    narrowed = [(number, f) for number, f in enumerate(layout.fields) if narrow and (f.stored is not None or f.ones)]
    # A tensor subclass's attributes become the value of its metadata field (they follow the structure's fields).
    described = [(number, f.name) for number, f in enumerate(layout.fields) if f.metadata is not None]

    def slow(sample: Any, index: int, leaves: list[Any], values: list[Any] | None) -> list[Any]:
        try:
            if values is None:
                return layout.check(sample, index, path)
            for number, name in described:
                leaf = leaves[number]
                values.append(encode_metadata(dict(vars(leaf)), name, type(leaf)))
            return values
        except LayoutError as exc:
            error = exc if refused is None else refused(exc, index)
            if error is exc:
                raise
            raise error from exc

    def check(sample: Any, index: int) -> list[Any]:
        leaves: list[Any] = []
        try:
            walk(sample, leaves)
            values = list(map(call, leaf_checks, leaves))  # (map: no comprehension frame on a single miss's path)
        except Slow:
            values = None  # decided outside the handler: an error raised there must not chain onto Slow
        if values is None or described:
            values = slow(sample, index, leaves, values)
        if narrowed:
            for number, field in narrowed:
                problem = narrow_problem(field, values[number])
                if problem is not None:
                    error = LayoutError(f"sample {index}, field {field.name!r}: {problem}")
                    raise error if refused is None else refused(error, index)
        return values

    return check


# (A cache's storage is fixed when it is made: another store_as takes a new one.)
_NEW_CACHE = " (in a new cache: overwrite=True, or another path)"


def narrow_problem(field: Field, value: Any) -> str | None:
    """Why ``value`` cannot be stored as ``field`` narrows it (``store_as``), or None: an integer that does not fit
    the narrower type, a float it would round, a value of a ``"ones"`` field that is not 1. Never a silent wrap."""
    array = np.asarray(value)
    if not array.size:
        return None
    if field.ones:
        bad = np.flatnonzero(array.reshape(-1) != 1)
        if len(bad):
            return (f"store_as='ones' keeps only values that are all ones, and this one holds "
                    f"{array.reshape(-1)[bad[0]].item()!r} at position {int(bad[0])}: leave the field out of "
                    f"store_as (a 0/1 mask fits 'uint8'){_NEW_CACHE}")
        return None
    target = field.storage_dtype
    if target.kind in "iu" and array.dtype.kind in "iub":
        info = np.iinfo(target)
        low, high = array.min().item(), array.max().item()
        if low < info.min or high > info.max:
            found = low if low < info.min else high
            return (f"the value {found} does not fit {target.name} (store_as; {info.min}..{info.max}): store the "
                    f"field as a wider type, or leave it out of store_as{_NEW_CACHE}")
        return None
    # Bit for bit, so a NaN whose payload the narrower type cannot hold is refused too (it would read back as
    # another NaN, which the cache's own checks then call a changed source).
    wide = np.ascontiguousarray(array).reshape(-1)
    back = wide.astype(target).astype(wide.dtype)
    differs = (back.view(np.uint8).reshape(len(wide), -1) != wide.view(np.uint8).reshape(len(wide), -1)).any(1)
    if differs.any():
        at = int(np.flatnonzero(differs)[0])
        value = wide[at].item()
        what = f"value {value!r}" if value == value else \
            f"NaN 0x{int.from_bytes(wide[at:at + 1].tobytes(), sys.byteorder):x} (its payload)"
        return (f"the {what} is not exactly a {target.name} (store_as would round it): store the field as a wider "
                f"type, or leave it out of store_as{_NEW_CACHE}")
    return None


def compile_walk(structure: Any) -> Callable[[Any, list[Any]], None]:
    """A function appending a sample's leaves to a list, raising ``Slow`` where the sample leaves the structure."""
    def leaf(number: int) -> Callable[[Any, list[Any]], None]:
        return lambda obj, out: out.append(obj)

    def sequence(kind: str, parts: list[Callable], children: list[Any]) -> Callable[[Any, list[Any]], None]:
        container = tuple if kind == "tuple" else list
        n = len(parts)
        if all(c.get("leaf") is not None for c in children):  # a flat tuple of leaves (input, target): one step
            def walk_flat_sequence(obj: Any, out: list[Any]) -> None:
                if type(obj) is not container or len(obj) != n:
                    raise Slow
                out.extend(obj)
            return walk_flat_sequence

        def walk_sequence(obj: Any, out: list[Any]) -> None:
            if type(obj) is not container or len(obj) != n:
                raise Slow
            for part, value in zip(parts, obj):
                part(value, out)
        return walk_sequence

    def mapping(keys: list[str], parts: list[Callable], children: list[Any]) -> Callable[[Any, list[Any]], None]:
        key_tuple = tuple(keys)
        if all(c.get("leaf") is not None for c in children):  # a flat dict of leaves: its values, in one step
            def walk_flat_dict(obj: Any, out: list[Any]) -> None:
                if type(obj) is not dict or tuple(obj) != key_tuple:
                    raise Slow
                out.extend(obj.values())
            return walk_flat_dict

        def walk_dict(obj: Any, out: list[Any]) -> None:
            if type(obj) is not dict or tuple(obj) != key_tuple:
                raise Slow
            for part, value in zip(parts, obj.values()):
                part(value, out)
        return walk_dict

    def record(spec: tuple[str, str, list[str]], parts: list[Callable],
               children: list[Any]) -> Callable[[Any, list[Any]], None]:
        names = tuple(spec[2])

        def walk_namedtuple(obj: Any, out: list[Any]) -> None:
            if getattr(type(obj), "_fields", None) != names:
                raise Slow
            for part, value in zip(parts, obj):
                part(value, out)
        return walk_namedtuple

    return fold(structure, leaf=leaf, sequence=sequence, mapping=mapping, record=record)


def _compile_leaf(field: Field) -> Callable[[Any], Any]:
    shape_ok = field.fits
    if field.ragged and all(d < 0 for d in field.shape):  # any size: only the number of dimensions is checked
        ndim = len(field.shape)

        def shape_ok(shape: tuple[int, ...]) -> bool:
            return len(shape) == ndim
    if field.kind in (STR, BYTES, NPSTR, NPBYTES):
        expected_type: type = {STR: str, BYTES: bytes, NPSTR: np.str_, NPBYTES: np.bytes_}[field.kind]
        text = field.kind in (STR, NPSTR)

        def check_text(x: Any) -> Any:
            found = type(x)  # compared apart from x, so type checkers keep x as Any
            if found is not expected_type:
                raise Slow
            data: Any = x.encode("utf-8", TEXT_ERRORS) if text else x
            return np.frombuffer(data, np.uint8)
        return check_text
    if field.kind == PYLIST:
        list_dtype = field.np_dtype

        def check_list(x: Any) -> Any:
            array = number_list(x) if type(x) is list and x else None
            if array is None or array.dtype != list_dtype or not shape_ok(array.shape):
                raise Slow
            return array
        return check_list

    if field.kind == INT:
        def check_int(x: Any) -> Any:
            if type(x) is not int or not _INT64_MIN <= x <= _INT64_MAX:
                raise Slow
            return x
        return check_int
    if field.kind in (FLOAT, BOOL):
        expected = float if field.kind == FLOAT else bool

        def check_scalar(x: Any) -> Any:
            if type(x) is not expected:
                raise Slow
            return x
        return check_scalar
    dtype = field.np_dtype
    if field.kind == NPSCALAR:
        def check_npscalar(x: Any) -> Any:
            if not isinstance(x, np.generic) or x.dtype != dtype:
                raise Slow
            return x
        return check_npscalar
    if field.kind == NDARRAY:
        def check_ndarray(x: Any) -> Any:
            if type(x) is not np.ndarray or x.dtype != dtype or not shape_ok(x.shape):
                raise Slow
            return x
        return check_ndarray
    import torch

    tensor_type: type = torch.Tensor
    target = torch_dtype(field)
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
            raise Slow
        if x.dtype != target or (x.shape != fixed_shape if fixed_shape is not None else not shape_ok(tuple(x.shape))):
            raise Slow
        try:
            # numpy() itself refuses what the cache must not take as is: a tensor that requires grad, is on another
            # device, or has its conjugate or negative bit set; the slow path then explains or converts.
            return (x.view(raw) if raw is not None else x).numpy()
        except (RuntimeError, TypeError):
            raise Slow from None
    return check_tensor
