"""What one leaf of a sample is: the kinds of field, ``Field``, and turning a source's value into a typed leaf.

Each leaf of a sample (a tensor, a tensor subclass, a numpy array or scalar, a Python number, ``str``, ``bytes``,
or a Python list of numbers) becomes one *field*: its kind (how a stored value is turned back into what the source
returned), its storage dtype and its shape. A tensor subclass's instance attributes travel as JSON in a metadata
field of their own (``encode_metadata``); its class is looked up by name among imported modules only
(``find_class``), never imported because a cache names it. ``format.layout`` assembles the fields of a whole sample.

Numpy only; torch is imported when a torch tensor is met.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import LayoutError

# Kinds of leaf. A kind decides how a stored value is turned back into what the source returned.
TENSOR, NDARRAY, INT, FLOAT, BOOL, NPSCALAR = "tensor", "ndarray", "int", "float", "bool", "numpy_scalar"
STR, BYTES, PYLIST, JSON = "str", "bytes", "pylist", "json"
NPSTR, NPBYTES = "numpy_str", "numpy_bytes"  # numpy.str_ / numpy.bytes_ (Hugging Face's numpy format gives them)
KINDS = (TENSOR, NDARRAY, INT, FLOAT, BOOL, NPSCALAR, STR, BYTES, PYLIST, JSON, NPSTR, NPBYTES)
# Kinds stored as UTF-8 / raw bytes in a heap, always ragged.
BYTE_KINDS = (STR, BYTES, JSON, NPSTR, NPBYTES)
TEXT_KINDS = (STR, BYTES, NPSTR, NPBYTES)
# str is stored as UTF-8, with lone surrogates (a file name os.fsdecode made of non-UTF-8 bytes) passed through as
# their 3-byte forms: any Python str comes back exactly.
TEXT_ERRORS = "surrogatepass"

# A layout of more fields than this is refused before anything is created: it is almost always a sample whose
# arrays arrived as Python containers of arrays (one file per field would exhaust open files).
MAX_FIELDS = 256

# Containers may nest this deep (the outermost container is level 1). Far more than real samples use, and far
# less than Python's recursion limit, so every walker here and in ``format.codec`` stays a plain recursion.
MAX_DEPTH = 64
# Arrays (and nested lists of numbers) may have at most this many dimensions (numpy arrays have at most 64, and a
# cache adds one for its rows).
MAX_DIMS = 32

# torch dtypes without a numpy equivalent are stored as an unsigned integer of the same width and viewed back.
_RAW_BY_ITEMSIZE = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}

_HINTS = {
    "NoneType": "return a tensor or a number instead of None (e.g. -1 or a mask field)",
    "Image": "convert PIL images with torchvision.transforms.PILToTensor() or numpy.asarray(img) in the wrapped "
             "dataset",
    "BatchEncoding": "a tokenizer's output is stored as a dict: return dict(tokenizer(text)) (without "
                     "return_tensors, or with its (1, n) values squeezed to 1-D)",
}


def narrower(served: np.dtype, stored: np.dtype) -> bool:
    """Whether values of dtype ``served`` may be stored as ``stored`` (``store_as``): a narrower integer for an
    integer (or bool), a narrower float for a float."""
    same_kind = (served.kind in "iub" and stored.kind in "iu") or (served.kind == "f" and stored.kind == "f")
    return same_kind and stored.itemsize < served.itemsize


@dataclass(frozen=True)
class Field:
    """One leaf of the sample layout.

    Attributes:
        name: the field path, e.g. ``"0"`` or ``"meta.2"``.
        kind: one of ``KINDS``: what the leaf is rebuilt as.
        dtype: the numpy dtype, as ``numpy.dtype.str`` (``"<f4"``, ``"|u1"``): what the source returns, and what is
            stored unless ``stored`` says otherwise.
        shape: the shape of one stored value; for a variable field, its declared maximum shape; for a ragged
            field, ``-1`` in each dimension that varies.
        torch_dtype: the torch dtype name for tensors (``"bfloat16"``), else None.
        variable: True if each sample's actual shape is stored beside the data (declared via ``max_shapes``).
        ragged: True if the values are packed in a heap with a per-row offset and shape (see ``store.heap``).
        tensor_class: ``(module, qualname)`` of a ``torch.Tensor`` subclass the value is rebuilt as, else None.
        metadata: the number of the field holding a tensor subclass's per-sample attributes, else None.
        stored: a ragged field's values stored narrower than ``dtype`` (``"<i4"`` for int64 token ids; ``store_as``),
            converted back to ``dtype`` when read; None: stored as ``dtype``.
        ones: a ragged field whose values are all ones (an attention mask), of which only the shapes are stored.
    """

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    torch_dtype: str | None = None
    variable: bool = False
    ragged: bool = False
    tensor_class: tuple[str, str] | None = None
    metadata: int | None = None
    stored: str | None = None
    ones: bool = False

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def storage_dtype(self) -> np.dtype:
        """The dtype of a ragged field's values in its heap (``dtype`` unless ``stored`` narrows it)."""
        return np.dtype(self.stored) if self.stored is not None else np.dtype(self.dtype)

    @property
    def value_itemsize(self) -> int:
        """Bytes an element of a ragged field's value takes in its heap (0: ``ones``, none stored)."""
        return 0 if self.ones else self.storage_dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of one value in a fixed-size row (0 for a ragged field, whose values are in its heap)."""
        return 0 if self.ragged else math.prod(self.shape) * self.np_dtype.itemsize

    def keeps_fixed(self, shapes: np.ndarray) -> np.ndarray:
        """Which of the value shapes ``(B, ndim)`` keep the dimensions this field records as fixed (a ragged
        field's others vary)."""
        fixed = np.array([d if d >= 0 else -1 for d in self.shape], np.int64)
        return ~((fixed >= 0) & (shapes != fixed)).any(axis=1)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "torch_dtype": self.torch_dtype,
            "variable": self.variable,
            "ragged": self.ragged,
            "class": None if self.tensor_class is None else list(self.tensor_class),
            "metadata": self.metadata,
            # (Since format 3, only where set: a cache of format 2 has neither.)
            **({"stored": self.stored} if self.stored is not None else {}),
            **({"ones": True} if self.ones else {}),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Field:
        tensor_class = obj.get("class")
        return cls(
            name=str(obj["name"]),
            kind=str(obj["kind"]),
            dtype=str(obj["dtype"]),
            shape=tuple(int(d) for d in obj["shape"]),
            torch_dtype=obj.get("torch_dtype"),
            variable=bool(obj.get("variable", False)),
            ragged=bool(obj.get("ragged", False)),
            tensor_class=None if tensor_class is None else (str(tensor_class[0]), str(tensor_class[1])),
            metadata=obj.get("metadata"),
            stored=None if obj.get("stored") is None else str(obj["stored"]),
            ones=obj.get("ones") is True,
        )

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a value of ``shape`` can be stored in this field."""
        if self.ragged:
            return len(shape) == len(self.shape) and all(m < 0 or s == m for s, m in zip(shape, self.shape))
        if self.variable:
            return len(shape) == len(self.shape) and all(s <= m for s, m in zip(shape, self.shape))
        return shape == self.shape

    def describe(self) -> str:
        shape = "x".join("*" if d < 0 else str(d) for d in self.shape) or "scalar"
        dtype = self.torch_dtype or np.dtype(self.dtype).name
        if self.kind in BYTE_KINDS:
            return f"{self.kind} (ragged)"
        prefix = "<=" if self.variable else ""
        kind = self.tensor_class[1] if self.tensor_class else self.kind
        stored = " (ragged, all ones: shapes stored)" if self.ones else \
            f" (ragged, stored as {self.storage_dtype.name})" if self.stored is not None else \
            " (ragged)" if self.ragged else ""
        return f"{kind} {dtype} {prefix}{shape}{stored}"


@dataclass(frozen=True)
class Leaf:
    """A flattened leaf: the field it would be stored as (shape = its actual shape) and its value as numpy.

    ``meta`` is a tensor subclass's per-sample attributes, JSON-encoded (``flatten`` turns it into a metadata
    field of its own)."""

    field: Field
    value: np.ndarray
    meta: np.ndarray | None = None



def number_list(obj: list) -> np.ndarray | None:
    """A regular (nested) list of Python numbers of one type as one array, else None (a container of fields).

    ``[]`` is an empty float64 array (its type cannot be known). Lists mixing types (ints and floats), big ints
    that do not fit int64, ragged nesting and anything but numbers are not arrays.
    """
    probe: Any = obj
    depth = 0
    while type(probe) is list and probe:
        probe, depth = probe[0], depth + 1
        if depth > MAX_DEPTH:
            return None  # containers, then: the depth limit explains it
    if type(probe) is list:
        numbers_type: Any = np.float64
    elif type(probe) in (int, float, bool):
        numbers_type = None
    else:
        return None
    try:
        array = np.asarray(obj, dtype=numbers_type)
    except (ValueError, TypeError, OverflowError):
        return None
    if array.dtype.kind not in "bif" or array.dtype.hasobject:
        return None
    if array.dtype.kind != "b" and array.size:
        # numpy promotes [1, 2.5, True] to floats: such a list would come back changed, so it stays a container.
        flat: Any = obj
        for _ in range(array.ndim - 1):
            flat = itertools.chain.from_iterable(flat)
        if len(set(map(type, flat))) != 1:
            return None
    return array


def typed_leaf(obj: Any, path: str) -> Leaf:
    """The typed leaf of one value at field path ``path``; a LayoutError names the path and a fix."""
    if isinstance(obj, bool):
        return Leaf(Field(path, BOOL, "|b1", ()), np.asarray(obj, dtype=np.bool_))
    if isinstance(obj, int):
        if not -(2**63) <= obj < 2**63:
            raise LayoutError(f"field {path!r}: int {obj} does not fit in int64; store it as a float or split it")
        return Leaf(Field(path, INT, "<i8", ()), np.asarray(obj, dtype=np.int64))
    if isinstance(obj, float) and not isinstance(obj, np.generic):  # numpy.float64 subclasses float: keep its type
        return Leaf(Field(path, FLOAT, "<f8", ()), np.asarray(obj, dtype=np.float64))
    if isinstance(obj, str):
        kind = NPSTR if isinstance(obj, np.str_) else STR
        return Leaf(Field(path, kind, "|u1", (-1,), ragged=True), np.frombuffer(obj.encode("utf-8", TEXT_ERRORS),
                                                                        np.uint8))
    if isinstance(obj, bytes):
        kind = NPBYTES if isinstance(obj, np.bytes_) else BYTES
        return Leaf(Field(path, kind, "|u1", (-1,), ragged=True), np.frombuffer(obj, np.uint8))
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
    hint = _HINTS.get(name, "return dict(value): a mapping is stored as a dict" if isinstance(obj, Mapping) else
                      "return tensors, numpy arrays, numbers, str or bytes (nested in tuple, list, dict or namedtuple)")
    raise LayoutError(f"field {path!r}: unsupported leaf type {type(obj).__module__}.{name}; {hint}")


# --- tensor subclasses -----------------------------------------------------------------------------------------


def class_path(cls: type) -> tuple[str, str]:
    """``(module, qualname)`` of a class that can be found again by name, else a LayoutError naming the fix."""
    module, qualname = cls.__module__, cls.__qualname__
    if find_class(module, qualname) is not cls:
        raise LayoutError(
            f"the tensor subclass {module}.{qualname} cannot be found by its name (defined inside a function, or "
            "replaced); define it at the top level of a module, or return a plain tensor "
            "(tensor.as_subclass(torch.Tensor))"
        )
    return module, qualname


def find_class(module: str, qualname: str) -> Any:
    """The object named ``module.qualname`` among already imported modules, else None. Never imports: a cache
    must not be able to make its reader run a module's code."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None or part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj


def encode_metadata(attrs: dict[str, Any], path: str, cls: type) -> np.ndarray:
    """A tensor subclass's instance attributes as compact JSON bytes (see ``format.spec`` for the tags)."""
    def encode(value: Any, attr: str) -> Any:
        if value is None or type(value) in (bool, int, float, str):
            return value
        if isinstance(value, enum.Enum):
            kind = type(value)
            return {"enum": [*class_path(kind), value.name]}
        if isinstance(value, tuple):
            return {"tuple": [encode(v, attr) for v in value]}
        if type(value) is list:
            return [encode(v, attr) for v in value]
        if type(value) is dict and all(type(k) is str for k in value):
            return {"dict": {k: encode(v, attr) for k, v in value.items()}}
        raise LayoutError(
            f"field {path!r}: attribute {attr!r} of the {cls.__qualname__} tensor is a {type(value).__module__}."
            f"{type(value).__qualname__}, which the cache cannot store (it keeps tensor attributes as JSON: None, "
            "bool, int, float, str, tuple, list, dict with str keys, Enum members; nothing is pickled); convert it "
            "in the wrapped dataset, or return a plain tensor (tensor.as_subclass(torch.Tensor))"
        )

    encoded = {name: encode(value, name) for name, value in attrs.items()}
    return np.frombuffer(json.dumps(encoded, separators=(",", ":")).encode(), np.uint8)


def _check_numpy_dtype(dtype: np.dtype, path: str, what: str) -> None:
    if dtype.kind not in "biufc" or dtype.fields is not None or dtype.subdtype is not None:
        raise LayoutError(
            f"field {path!r}: {what} of dtype {dtype} cannot be cached (only bool and numeric dtypes can); "
            "return text as one str (join an array of strings, or convert it to token ids) and objects as numeric "
            "arrays in the wrapped dataset"
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
    tensor_class, meta = None, None
    cls = type(tensor)
    if cls is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        tensor_class = class_path(cls)
        meta = encode_metadata(dict(vars(tensor)), path, cls)
        tensor = tensor.as_subclass(torch.Tensor)
    tensor = tensor.detach().resolve_conj().resolve_neg()
    torch_dtype = str(tensor.dtype).removeprefix("torch.")
    try:
        value = tensor.numpy()
    except TypeError:
        raw = _RAW_BY_ITEMSIZE[tensor.element_size()]
        value = tensor.contiguous().view(getattr(torch, "uint" + str(8 * tensor.element_size()))).numpy()
        return Leaf(Field(path, TENSOR, raw, tuple(tensor.shape), torch_dtype, tensor_class=tensor_class), value,
                    meta)
    return Leaf(Field(path, TENSOR, value.dtype.str, tuple(tensor.shape), torch_dtype, tensor_class=tensor_class),
                value, meta)
