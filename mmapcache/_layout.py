"""Sample layout: flattening nested samples into typed leaf fields and rebuilding them.

A sample is a tree of containers (tuple, list, dict with str keys, namedtuple) whose leaves are tensors, numpy
arrays, Python scalars or numpy scalars. Flattening yields one *field* per leaf, named by its *field path*: the
dict keys and sequence positions joined with ``.`` (``"image"``, ``"0"``, ``"meta.2"``). The container tree (the
*structure*) and the list of fields (path, kind, dtype, shape) are the layout, stored in ``meta.json``.

A sample needs at least one leaf, containers nest at most ``MAX_DEPTH`` (64) deep, and no two leaves may share a
field path (a key ``"a.b"`` beside a key ``"a"`` holding ``{"b": ...}``). ``fold`` is the one walker over a
structure tree: the builders, the checker, the describer and the format's validation are callbacks passed to it.

This module speaks numpy only; torch is imported lazily, when a torch tensor is met or must be rebuilt, so that
``mmapcache inspect`` and unrelated numpy scripts never pay for importing torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .errors import LayoutError

# Kinds of leaf. A kind decides how a stored value is turned back into what the source returned.
TENSOR, NDARRAY, INT, FLOAT, BOOL, NPSCALAR = "tensor", "ndarray", "int", "float", "bool", "numpy_scalar"
KINDS = (TENSOR, NDARRAY, INT, FLOAT, BOOL, NPSCALAR)

# Containers may nest this deep (the outermost container is level 1). Far more than real samples use, and far
# less than Python's recursion limit, so every walker here and in ``_codec`` stays a plain recursion.
MAX_DEPTH = 64

# torch dtypes without a numpy equivalent are stored as an unsigned integer of the same width and viewed back.
_RAW_BY_ITEMSIZE = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}

_HINTS = {
    "str": "encode text as a tensor of token ids or bytes (numpy.frombuffer(s.encode(), numpy.uint8)) in the "
           "wrapped dataset",
    "bytes": "convert bytes with numpy.frombuffer(b, numpy.uint8) in the wrapped dataset",
    "NoneType": "return a tensor or a number instead of None (e.g. -1 or a mask field)",
    "Image": "convert PIL images with torchvision.transforms.PILToTensor() or numpy.asarray(img) in the wrapped "
             "dataset",
}


@dataclass(frozen=True)
class Field:
    """One leaf of the sample layout.

    Attributes:
        name: the field path, e.g. ``"0"`` or ``"meta.2"``.
        kind: one of ``KINDS``: what the leaf is rebuilt as.
        dtype: the numpy storage dtype, as ``numpy.dtype.str`` (``"<f4"``, ``"|u1"``).
        shape: the shape of one stored value; for a variable field, its declared maximum shape.
        torch_dtype: the torch dtype name for tensors (``"bfloat16"``), else None.
        variable: True if each sample's actual shape is stored beside the data (declared via ``max_shapes``).
    """

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    torch_dtype: str | None = None
    variable: bool = False

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.np_dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "torch_dtype": self.torch_dtype,
            "variable": self.variable,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Field:
        return cls(
            name=str(obj["name"]),
            kind=str(obj["kind"]),
            dtype=str(obj["dtype"]),
            shape=tuple(int(d) for d in obj["shape"]),
            torch_dtype=obj.get("torch_dtype"),
            variable=bool(obj.get("variable", False)),
        )

    def describe(self) -> str:
        shape = "x".join(str(d) for d in self.shape) or "scalar"
        dtype = self.torch_dtype or np.dtype(self.dtype).name
        prefix = "<=" if self.variable else ""
        return f"{self.kind} {dtype} {prefix}{shape}"


# --- flattening ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    """A flattened leaf: the field it would be stored as (shape = its actual shape) and its value as numpy."""

    field: Field
    value: np.ndarray


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def flatten(sample: Any) -> tuple[Any, list[Leaf]]:
    """Splits a sample into its structure (JSON-able) and its leaves, in field order.

    This walks the source's objects, not a structure tree, so it is the one walker ``fold`` does not express.

    Raises:
        LayoutError: a leaf of an unsupported type, or containers nested deeper than ``MAX_DEPTH``, naming the
            field path and a fix.
    """
    leaves: list[Leaf] = []
    structure = _flatten(sample, "", leaves, 0)
    return structure, leaves


def _flatten(obj: Any, path: str, leaves: list[Leaf], depth: int) -> Any:
    if isinstance(obj, (tuple, list, dict)):
        depth += 1
        if depth > MAX_DEPTH:
            raise LayoutError(_too_deep(path))
    if _is_namedtuple(obj):
        cls = type(obj)
        items = [_flatten(v, _join(path, str(i)), leaves, depth) for i, v in enumerate(obj)]
        return {"namedtuple": [cls.__module__, cls.__qualname__, list(cls._fields)], "items": items}
    if isinstance(obj, (tuple, list)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return {kind: [_flatten(v, _join(path, str(i)), leaves, depth) for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        items = []
        for key, value in obj.items():
            if not isinstance(key, str):
                raise LayoutError(
                    f"field {path or '<sample>'!r}: dict key {key!r} is a {type(key).__name__}, expected str; "
                    "use string keys in the samples of the wrapped dataset"
                )
            items.append([key, _flatten(value, _join(path, key), leaves, depth)])
        return {"dict": items}
    leaves.append(_leaf(obj, path or "<sample>"))
    return {"leaf": len(leaves) - 1}


def _too_deep(path: str) -> str:
    shown = path if len(path) <= 80 else path[:80] + "..."
    return (f"field {shown or '<sample>'!r}: containers nested deeper than {MAX_DEPTH} levels (the limit, which also "
            "stops a self-containing list); flatten the sample in the wrapped dataset, e.g. stack the innermost "
            "lists into a tensor or join keys into one dict level")


def _leaf(obj: Any, path: str) -> Leaf:
    if isinstance(obj, bool):
        return Leaf(Field(path, BOOL, "|b1", ()), np.asarray(obj, dtype=np.bool_))
    if isinstance(obj, int):
        if not -(2**63) <= obj < 2**63:
            raise LayoutError(f"field {path!r}: int {obj} does not fit in int64; store it as a float or split it")
        return Leaf(Field(path, INT, "<i8", ()), np.asarray(obj, dtype=np.int64))
    if isinstance(obj, float) and not isinstance(obj, np.generic):  # numpy.float64 subclasses float: keep its type
        return Leaf(Field(path, FLOAT, "<f8", ()), np.asarray(obj, dtype=np.float64))
    if isinstance(obj, np.ndarray):
        _check_numpy_dtype(obj.dtype, path, "numpy array")
        return Leaf(Field(path, NDARRAY, obj.dtype.str, obj.shape), obj)
    if isinstance(obj, np.generic):
        _check_numpy_dtype(obj.dtype, path, "numpy scalar")
        return Leaf(Field(path, NPSCALAR, obj.dtype.str, ()), np.asarray(obj))
    if "torch" in sys.modules:
        import torch

        if isinstance(obj, torch.Tensor):
            return _tensor_leaf(obj, path)
    name = type(obj).__name__
    hint = _HINTS.get(name, "return tensors, numpy arrays or numbers (nested in tuple, list, dict or namedtuple)")
    raise LayoutError(f"field {path!r}: unsupported leaf type {type(obj).__module__}.{name}; {hint}")


def _check_numpy_dtype(dtype: np.dtype, path: str, what: str) -> None:
    if dtype.kind not in "biufc" or dtype.fields is not None or dtype.subdtype is not None:
        raise LayoutError(
            f"field {path!r}: {what} of dtype {dtype} cannot be cached (only bool and numeric dtypes can); "
            "convert strings to token ids and objects to numeric arrays in the wrapped dataset"
        )


def _tensor_leaf(tensor: Any, path: str) -> Leaf:
    import torch

    if tensor.device.type != "cpu":
        raise LayoutError(
            f"field {path!r}: tensor on device {tensor.device}; the cache holds CPU data: return CPU tensors from "
            "the wrapped dataset and move batches to the GPU in the training loop"
        )
    if tensor.layout != torch.strided or tensor.is_quantized:
        # A quantized tensor is strided, and .to_dense() keeps it quantized: it needs .dequantize() instead.
        fix = ".dequantize()" if tensor.is_quantized else ".to_dense()"
        what = f"quantized ({tensor.dtype})" if tensor.is_quantized else str(tensor.layout)
        raise LayoutError(f"field {path!r}: {what} tensor cannot be cached; convert it with {fix}")
    tensor = tensor.detach().resolve_conj().resolve_neg()
    torch_dtype = str(tensor.dtype).removeprefix("torch.")
    try:
        value = tensor.numpy()
    except TypeError:
        raw = _RAW_BY_ITEMSIZE[tensor.element_size()]
        value = tensor.contiguous().view(getattr(torch, "uint" + str(8 * tensor.element_size()))).numpy()
        return Leaf(Field(path, TENSOR, raw, tuple(tensor.shape), torch_dtype), value)
    return Leaf(Field(path, TENSOR, value.dtype.str, tuple(tensor.shape), torch_dtype), value)


# --- the layout of a cache -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The structure and fields of every sample of one cache."""

    structure: Any
    fields: tuple[Field, ...]

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored sample (data only, at maximum shape)."""
        return sum(f.nbytes for f in self.fields)

    def to_json(self) -> dict[str, Any]:
        return {"structure": self.structure, "fields": [f.to_json() for f in self.fields]}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Layout:
        return cls(structure=obj["structure"], fields=tuple(Field.from_json(f) for f in obj["fields"]))

    @classmethod
    def from_sample(cls, sample: Any, max_shapes: dict[str, Sequence[int]] | None = None) -> Layout:
        """The layout of a first sample, with the fields named in ``max_shapes`` made variable.

        Raises:
            LayoutError: the sample has no leaves, two leaves share a field path, or as ``flatten``.
        """
        structure, leaves = flatten(sample)
        if not leaves:
            raise LayoutError(
                f"a sample needs at least one field (a tensor, array or number); the first sample is "
                f"{describe_structure(structure)} with none: return at least one value from the wrapped dataset"
            )
        _check_unique_names(structure, leaves)
        max_shapes = dict(max_shapes or {})
        fields = []
        for leaf in leaves:
            field = leaf.field
            if field.name in max_shapes:
                limit = tuple(int(d) for d in max_shapes.pop(field.name))
                _check_fits(field, limit, field.shape, None)
                field = Field(field.name, field.kind, field.dtype, limit, field.torch_dtype, variable=True)
            fields.append(field)
        if max_shapes:
            known = ", ".join(repr(leaf.field.name) for leaf in leaves)
            raise LayoutError(f"max_shapes names unknown field(s) {sorted(max_shapes)}; the sample's fields are "
                              f"{known}")
        return cls(structure, tuple(fields))

    def check(self, sample: Any, index: int) -> list[np.ndarray]:
        """Flattens a sample and checks it against this layout; returns its leaves' values in field order.

        Raises:
            LayoutError: naming the index, the field path, and what was expected versus found.
        """
        try:
            structure, leaves = flatten(sample)
        except LayoutError as exc:
            raise LayoutError(f"sample {index}: {exc}") from None
        if structure != self.structure:
            raise LayoutError(
                f"sample {index} has a different structure from the cache's first sample: expected "
                f"{describe_structure(self.structure)}, found {describe_structure(structure)}; every sample must "
                "have the same containers and field paths"
            )
        values = []
        for field, leaf in zip(self.fields, leaves):
            found = leaf.field
            if (found.kind, found.dtype, found.torch_dtype) != (field.kind, field.dtype, field.torch_dtype):
                raise LayoutError(
                    f"sample {index}, field {field.name!r}: expected {field.kind} of dtype "
                    f"{field.torch_dtype or field.dtype}, found {found.kind} of dtype "
                    f"{found.torch_dtype or found.dtype}; "
                    "make the wrapped dataset return the same types for every index"
                )
            if field.variable:
                _check_fits(field, field.shape, found.shape, index)
            elif found.shape != field.shape:
                largest = tuple(max(a, b) for a, b in zip(field.shape, found.shape))
                hint = (
                    "if this field's shape varies, declare its largest shape: "
                    f"max_shapes={{{field.name!r}: {largest}}} "
                    "(the largest seen so far)"
                    if len(found.shape) == len(field.shape)
                    else "every sample must have the same number of dimensions in each field"
                )
                raise LayoutError(
                    f"sample {index}, field {field.name!r}: expected shape {field.shape}, found {found.shape}; {hint}"
                )
            values.append(leaf.value)
        return values


def _check_unique_names(structure: Any, leaves: list[Leaf]) -> None:
    # A dict key holding the separator ("a.b") can name the same path as nested keys (a -> b); both fields would
    # be called "a.b", and max_shapes or an error message could only ever name the first. Refused rather than
    # escaped: escaping would rename fields of caches that exist today, and such keys are rare.
    seen: dict[str, int] = {}
    for number, leaf in enumerate(leaves):
        name = leaf.field.name
        if name in seen:
            first, second = (_route(structure, n) for n in (seen[name], number))
            raise LayoutError(
                f"two fields have the same path {name!r}: {first} and {second} (a dict key holding '.' names the "
                "same path as nested keys); rename a key in the wrapped dataset's samples (e.g. 'a_b' for 'a.b')"
            )
        seen[name] = number


def _route(structure: Any, number: int) -> str:
    """How to reach leaf ``number`` from the sample, unambiguously: ``sample['a.b']`` or ``sample['a']['b']``."""
    def leaf(index: int, *_: Any) -> list[str] | None:
        return [] if index == number else None

    def find(keys: Sequence[Any], parts: list[list[str] | None]) -> list[str] | None:
        for key, part in zip(keys, parts):
            if part is not None:
                return [f"[{key!r}]", *part]
        return None

    route = fold(structure, leaf=leaf,
                 sequence=lambda kind, parts, children: find(range(len(parts)), parts),
                 mapping=lambda keys, parts, children: find(keys, parts),
                 record=lambda spec, parts, children: find(range(len(parts)), parts))
    return "sample" + "".join(route or [])


def _check_fits(field: Field, limit: tuple[int, ...], shape: tuple[int, ...], index: int | None) -> None:
    where = f"sample {index}, field {field.name!r}" if index is not None else f"field {field.name!r}"
    if len(limit) != len(shape) or any(s > m for s, m in zip(shape, limit)):
        largest = tuple(max(a, b) for a, b in zip(limit, shape)) if len(limit) == len(shape) else shape
        raise LayoutError(
            f"{where}: shape {shape} does not fit the declared maximum shape {limit}; declare "
            f"max_shapes={{{field.name!r}: {largest}}} or larger (same number of dimensions) when creating the cache"
        )


def describe_structure(structure: Any) -> str:
    """A short human form of a structure: ``tuple(leaf, leaf)``, ``dict(image: leaf, label: leaf)``."""
    return fold(
        structure,
        leaf=lambda index: "leaf",
        sequence=lambda kind, parts, children: f"{kind}({', '.join(parts)})",
        mapping=lambda keys, parts, children: "dict(" + ", ".join(f"{k}: {p}" for k, p in zip(keys, parts)) + ")",
        record=lambda spec, parts, children: f"{spec[1]}({', '.join(spec[2])})",
    )


# --- the one walker over a structure tree ----------------------------------------------------------------------

T = TypeVar("T")


def fold(
    structure: Any,
    *,
    leaf: Callable[[int], T],
    sequence: Callable[[str, list[T], list[Any]], T],
    mapping: Callable[[list[str], list[T], list[Any]], T],
    record: Callable[[tuple[str, str, list[str]], list[T], list[Any]], T],
) -> T:
    """Folds a structure tree bottom-up: each node becomes what its kind's callback makes of its children's results.

    The tree is the one in ``meta.json`` (see ``_format``): ``{"leaf": n}``, ``{"tuple": [...]}``,
    ``{"list": [...]}``, ``{"dict": [[key, node], ...]}`` and ``{"namedtuple": [module, qualname, names],
    "items": [...]}``. Each container callback also receives its child nodes, so a builder can take a fast path
    for, say, a tuple of bare leaves.

    Args:
        structure: the root node.
        leaf: ``leaf(field_number)``.
        sequence: ``sequence(kind, parts, children)``, kind ``"tuple"`` or ``"list"``.
        mapping: ``mapping(keys, parts, children)`` for a dict, keys in order.
        record: ``record((module, qualname, names), parts, children)`` for a namedtuple.

    Raises:
        ValueError: a node of unknown shape (only a damaged ``meta.json`` has one).
        LayoutError: containers nested deeper than ``MAX_DEPTH``.
    """
    def visit(node: Any, depth: int) -> T:
        if type(node) is not dict:
            raise ValueError(f"structure node {node!r} is not an object")
        keys = node.keys()
        if keys == {"leaf"}:
            index = node["leaf"]
            if type(index) is not int:
                raise ValueError(f"leaf {index!r} is not a field number")
            return leaf(index)
        if depth >= MAX_DEPTH:
            raise LayoutError(f"a structure nests containers deeper than {MAX_DEPTH} levels, the limit")
        if keys == {"tuple"} or keys == {"list"}:
            kind = "tuple" if "tuple" in keys else "list"
            children = _children(node[kind], node)
            return sequence(kind, [visit(c, depth + 1) for c in children], children)
        if keys == {"dict"}:
            pairs = _children(node["dict"], node)
            if not all(type(p) is list and len(p) == 2 and type(p[0]) is str for p in pairs):
                raise ValueError("a dict node must list [key, node] pairs with string keys")
            children = [p[1] for p in pairs]
            return mapping([p[0] for p in pairs], [visit(c, depth + 1) for c in children], children)
        if keys == {"namedtuple", "items"}:
            spec = node["namedtuple"]
            if type(spec) is not list or len(spec) != 3:
                raise ValueError(f"bad namedtuple description {spec!r}")
            children = _children(node["items"], node)
            return record((spec[0], spec[1], spec[2]), [visit(c, depth + 1) for c in children], children)
        raise ValueError(f"unknown structure node with keys {sorted(keys)}")

    return visit(structure, 0)


def _children(children: Any, node: Any) -> list[Any]:
    if type(children) is not list:
        raise ValueError(f"structure node {node!r} does not list its children")
    return children
