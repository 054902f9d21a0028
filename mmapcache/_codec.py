"""The codec of a layout: functions compiled once per cache that turn stored values back into samples and
batches, and the fast check that turns a source's sample into the values to store.

``_layout`` says what a sample's fields are; this module says how to convert between them and what the source
returned, as fast as Python allows (closures over the known structure, exact type tests, no per-call lookups).
Torch is imported only when a tensor field needs it.
"""

from __future__ import annotations

import sys
from collections import namedtuple
from typing import Any, Callable, Sequence

import numpy as np

from ._layout import BOOL, FLOAT, INT, NDARRAY, NPSCALAR, TENSOR, Field, Layout
from .errors import CacheFormatError

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
    except Exception:  # noqa: BLE001 - any import failure falls back to an equivalent class
        pass
    return namedtuple(qualname.rsplit(".", 1)[-1], names)  # type: ignore[misc]


def sample_builder(structure: Any) -> Callable[[Sequence[Any]], Any]:
    """A function rebuilding one sample from its converted leaves (compiled once per cache, not per access)."""
    if "leaf" in structure:
        i = structure["leaf"]
        return lambda leaves: leaves[i]
    if "namedtuple" in structure:
        cls = _namedtuple_class(*structure["namedtuple"])
        parts = [sample_builder(s) for s in structure["items"]]
        return lambda leaves: cls(*[p(leaves) for p in parts])
    if "dict" in structure:
        keyed = [(k, sample_builder(s)) for k, s in structure["dict"]]
        return lambda leaves: {k: p(leaves) for k, p in keyed}
    kind = "tuple" if "tuple" in structure else "list"
    parts = [sample_builder(s) for s in structure[kind]]
    if kind == "tuple":
        if len(parts) == 2 and all("leaf" in s for s in structure["tuple"]):
            a, b = structure["tuple"][0]["leaf"], structure["tuple"][1]["leaf"]
            return lambda leaves: (leaves[a], leaves[b])  # the common (input, target) pair, without a generator
        return lambda leaves: tuple([p(leaves) for p in parts])
    return lambda leaves: [p(leaves) for p in parts]


def batch_builder(structure: Any) -> Callable[[Sequence[Any]], Any]:
    """A function building what torch's ``default_collate`` returns from already-batched leaves.

    ``default_collate`` turns a tuple of fields into a list (torch keeps this for backwards compatibility),
    keeps lists, dicts and namedtuples, and makes every leaf a batched tensor.
    """
    if "leaf" in structure:
        i = structure["leaf"]
        return lambda leaves: leaves[i]
    if "namedtuple" in structure:
        cls = _namedtuple_class(*structure["namedtuple"])
        parts = [batch_builder(s) for s in structure["items"]]
        return lambda leaves: cls(*[p(leaves) for p in parts])
    if "dict" in structure:
        keyed = [(k, batch_builder(s)) for k, s in structure["dict"]]
        return lambda leaves: {k: p(leaves) for k, p in keyed}
    kind = "tuple" if "tuple" in structure else "list"
    parts = [batch_builder(s) for s in structure[kind]]
    return lambda leaves: [p(leaves) for p in parts]


def leaf_converter(field: Field) -> Callable[[np.ndarray], Any]:
    """A function turning a stored value (a fresh, writable numpy array) into what the source returned."""
    if field.kind == NDARRAY:
        return lambda a: a
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
    """A function turning a batch of stored values (leading batch axis) into the collated tensor."""
    import torch

    from_numpy = torch.from_numpy
    if field.kind == TENSOR:
        target = _torch_dtype(field)
        if from_numpy(np.zeros(0, field.np_dtype)).dtype != target:
            return lambda a: from_numpy(a).view(target)
    return from_numpy


# --- the fast check on the publish path ------------------------------------------------------------------------


class _Slow(Exception):
    """Internal: the fast check met something unusual; ``Layout.check`` decides (and explains)."""


def compile_checker(layout: Layout) -> Callable[[Any, int], list[Any]]:
    """A function equivalent to ``layout.check`` for well-formed samples, about 10x faster.

    It walks the known structure with exact type tests and compares each leaf's dtype and shape directly; on
    anything unexpected it defers to ``layout.check``, which raises the explanatory error (or accepts a rarer
    form, such as a tensor that requires grad). Scalar fields yield Python or numpy scalars, array fields numpy
    arrays (possibly views of the source's tensors).
    """
    walk = _compile_walk(layout.structure)
    leaf_checks = [_compile_leaf(f) for f in layout.fields]

    def check(sample: Any, index: int) -> list[Any]:
        leaves: list[Any] = []
        try:
            walk(sample, leaves)
            return [c(x) for c, x in zip(leaf_checks, leaves)]
        except _Slow:
            return layout.check(sample, index)

    return check


def _compile_walk(structure: Any) -> Callable[[Any, list[Any]], None]:
    if "leaf" in structure:
        return lambda obj, out: out.append(obj)
    if "namedtuple" in structure:
        names = tuple(structure["namedtuple"][2])
        parts = [_compile_walk(s) for s in structure["items"]]

        def walk_namedtuple(obj: Any, out: list[Any]) -> None:
            if getattr(type(obj), "_fields", None) != names:
                raise _Slow
            for part, value in zip(parts, obj):
                part(value, out)
        return walk_namedtuple
    if "dict" in structure:
        keys = [k for k, _ in structure["dict"]]
        parts = [_compile_walk(s) for _, s in structure["dict"]]

        def walk_dict(obj: Any, out: list[Any]) -> None:
            if type(obj) is not dict or list(obj) != keys:
                raise _Slow
            for part, value in zip(parts, obj.values()):
                part(value, out)
        return walk_dict
    kind = "tuple" if "tuple" in structure else "list"
    container = tuple if kind == "tuple" else list
    parts = [_compile_walk(s) for s in structure[kind]]
    n = len(parts)

    def walk_sequence(obj: Any, out: list[Any]) -> None:
        if type(obj) is not container or len(obj) != n:
            raise _Slow
        for part, value in zip(parts, obj):
            part(value, out)
    return walk_sequence


def _compile_leaf(field: Field) -> Callable[[Any], Any]:
    shape = field.shape
    variable = field.variable

    def shape_ok(found: tuple[int, ...]) -> bool:
        if not variable:
            return found == shape
        return len(found) == len(shape) and all(s <= m for s, m in zip(found, shape))

    if field.kind in (INT, FLOAT, BOOL):
        expected = {INT: int, FLOAT: float, BOOL: bool}[field.kind]

        def check_scalar(x: Any) -> Any:
            if type(x) is not expected or (expected is int and not -(2**63) <= x < 2**63):
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

    tensor_type, target = torch.Tensor, _torch_dtype(field)
    # Types numpy lacks (bfloat16, complex32, float8) are stored as the unsigned int of their width.
    raw = getattr(torch, "uint" + str(8 * dtype.itemsize)) if field.torch_dtype and \
        torch.from_numpy(np.zeros(0, dtype)).dtype != target else None

    def check_tensor(x: Any) -> Any:
        if type(x) is not tensor_type or x.dtype != target or x.requires_grad or x.is_conj() or x.is_neg() \
                or x.device.type != "cpu" or not shape_ok(tuple(x.shape)):
            raise _Slow
        return (x.view(raw) if raw is not None else x).numpy()
    return check_tensor
