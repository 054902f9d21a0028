"""Sample layout: flattening nested samples into typed leaf fields and rebuilding them.

A sample is a tree of containers (tuple, list, dict with str keys, namedtuple) whose leaves are tensors, numpy
arrays, Python scalars or numpy scalars. Flattening yields one *field* per leaf, named by its *field path*: the
dict keys and sequence positions joined with ``.`` (``"image"``, ``"0"``, ``"meta.2"``). The container tree (the
*structure*) and the list of fields (path, kind, dtype, shape) are the layout, stored in ``meta.json``.

This module speaks numpy only; torch is imported lazily, when a torch tensor is met or must be rebuilt, so that
``mmapcache inspect`` and unrelated numpy scripts never pay for importing torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import LayoutError

# Kinds of leaf. A kind decides how a stored value is turned back into what the source returned.
TENSOR, NDARRAY, INT, FLOAT, BOOL, NPSCALAR = "tensor", "ndarray", "int", "float", "bool", "numpy_scalar"
KINDS = (TENSOR, NDARRAY, INT, FLOAT, BOOL, NPSCALAR)

# torch dtypes without a numpy equivalent are stored as an unsigned integer of the same width and viewed back.
_RAW_BY_ITEMSIZE = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}

_HINTS = {
    "str": "encode text as a tensor of token ids or bytes (numpy.frombuffer(s.encode(), numpy.uint8)) in the wrapped dataset",
    "bytes": "convert bytes with numpy.frombuffer(b, numpy.uint8) in the wrapped dataset",
    "NoneType": "return a tensor or a number instead of None (e.g. -1 or a mask field)",
    "Image": "convert PIL images with torchvision.transforms.PILToTensor() or numpy.asarray(img) in the wrapped dataset",
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

    Raises:
        LayoutError: a leaf of an unsupported type, naming its field path and a hint.
    """
    leaves: list[Leaf] = []
    structure = _flatten(sample, "", leaves)
    return structure, leaves


def _flatten(obj: Any, path: str, leaves: list[Leaf]) -> Any:
    if _is_namedtuple(obj):
        cls = type(obj)
        items = [_flatten(v, _join(path, str(i)), leaves) for i, v in enumerate(obj)]
        return {"namedtuple": [cls.__module__, cls.__qualname__, list(cls._fields)], "items": items}
    if isinstance(obj, (tuple, list)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return {kind: [_flatten(v, _join(path, str(i)), leaves) for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        items = []
        for key, value in obj.items():
            if not isinstance(key, str):
                raise LayoutError(
                    f"field {path or '<sample>'!r}: dict key {key!r} is a {type(key).__name__}, expected str; "
                    "use string keys in the samples of the wrapped dataset"
                )
            items.append([key, _flatten(value, _join(path, key), leaves)])
        return {"dict": items}
    leaves.append(_leaf(obj, path or "<sample>"))
    return {"leaf": len(leaves) - 1}


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
        raise LayoutError(f"field {path!r}: {tensor.layout} tensor cannot be cached; convert it with .to_dense()")
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
        """The layout of a first sample, with the fields named in ``max_shapes`` made variable."""
        structure, leaves = flatten(sample)
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
            raise LayoutError(f"max_shapes names unknown field(s) {sorted(max_shapes)}; the sample's fields are {known}")
        return cls(structure, tuple(fields))

    def check(self, sample: Any, index: int) -> list[np.ndarray]:
        """Flattens a sample and checks it against this layout; returns its leaves' values in field order.

        Raises:
            LayoutError: naming the index, the field path, and what was expected versus found.
        """
        structure, leaves = flatten(sample)
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
                    f"{field.torch_dtype or field.dtype}, found {found.kind} of dtype {found.torch_dtype or found.dtype}; "
                    "make the wrapped dataset return the same types for every index"
                )
            if field.variable:
                _check_fits(field, field.shape, found.shape, index)
            elif found.shape != field.shape:
                largest = tuple(max(a, b) for a, b in zip(field.shape, found.shape))
                hint = (
                    f"if this field's shape varies, declare its largest shape: max_shapes={{{field.name!r}: {largest}}} "
                    "(the largest seen so far)"
                    if len(found.shape) == len(field.shape)
                    else "every sample must have the same number of dimensions in each field"
                )
                raise LayoutError(
                    f"sample {index}, field {field.name!r}: expected shape {field.shape}, found {found.shape}; {hint}"
                )
            values.append(leaf.value)
        return values


def _check_fits(field: Field, limit: tuple[int, ...], shape: tuple[int, ...], index: int | None) -> None:
    where = f"sample {index}, field {field.name!r}" if index is not None else f"field {field.name!r}"
    if len(limit) != len(shape) or any(s > m for s, m in zip(shape, limit)):
        largest = tuple(max(a, b) for a, b in zip(limit, shape)) if len(limit) == len(shape) else shape
        raise LayoutError(
            f"{where}: shape {shape} does not fit the declared maximum shape {limit}; declare "
            f"max_shapes={{{field.name!r}: {largest}}} or larger (same number of dimensions) when creating the cache"
        )


def describe_structure(structure: Any) -> str:
    """A short human form of a structure: ``tuple(0, 1)``, ``dict(image, label)``."""
    if "leaf" in structure:
        return "leaf"
    if "namedtuple" in structure:
        _, name, names = structure["namedtuple"]
        return f"{name}({', '.join(names)})"
    if "dict" in structure:
        return "dict(" + ", ".join(f"{k}: {describe_structure(v)}" for k, v in structure["dict"]) + ")"
    kind = "tuple" if "tuple" in structure else "list"
    return f"{kind}(" + ", ".join(describe_structure(v) for v in structure[kind]) + ")"
