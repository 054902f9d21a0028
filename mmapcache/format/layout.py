"""Sample layout: a sample's fields (what each leaf is) and its container structure, learnt from the first sample
(and the probes), and the check that a later sample has that layout.

A sample is a tree of containers (tuple, list, dict with str keys, namedtuple) whose leaves are tensors (tensor
subclasses such as torchvision's ``tv_tensors`` included), numpy arrays, Python or numpy scalars, ``str``,
``bytes``, and Python lists of numbers (nested or not: Hugging Face's default format), which are one leaf each.
Flattening yields one *field* per leaf, named by its *field path*: the dict keys and sequence positions joined
with ``.`` (``"image"``, ``"0"``, ``"meta.2"``). The container tree (the *structure*) and the list of fields (path,
kind, dtype, shape) are the layout, stored in ``meta.json``.

A field is *ragged* when its shape varies between samples (in any dimension; the number of dimensions is fixed):
its varying dimensions are ``-1`` in ``shape`` and its values live in a heap (``store.heap``). ``str`` and ``bytes``
fields are always ragged. A tensor subclass's per-sample attributes (``format``, ``canvas_size``) are a *metadata
field* of its own, kind ``json``, appended after the structure's fields and named ``<path>#meta``.

A sample needs at least one leaf, containers nest at most ``MAX_DEPTH`` (64) deep, and no two leaves may share a
field path (a key ``"a.b"`` beside a key ``"a"`` holding ``{"b": ...}``). Flattening a sample and walking a structure
tree (``fold``) are ``format.tree``.

This module speaks numpy only; torch is imported lazily, when a torch tensor is met or must be rebuilt, so that
``mmapcache inspect`` and unrelated numpy scripts never pay for importing torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import LayoutError
from .fields import (
    BOOL,
    BYTE_KINDS,
    BYTES,
    FLOAT,
    INT,
    JSON,
    KINDS,
    MAX_DEPTH,
    MAX_DIMS,
    MAX_FIELDS,
    NDARRAY,
    NPBYTES,
    NPSCALAR,
    NPSTR,
    PYLIST,
    STR,
    TENSOR,
    TEXT_ERRORS,
    TEXT_KINDS,
    Field,
    Leaf,
    class_path,
    encode_metadata,
    find_class,
    narrower,
    number_list,
)
from .tree import describe_structure, flatten, fold, route

# Re-exported: the modules that build, check and read samples take the field kinds from here.
__all__ = ["BOOL", "BYTE_KINDS", "BYTES", "FLOAT", "INT", "JSON", "KINDS", "MAX_DEPTH", "MAX_DIMS", "MAX_FIELDS",
           "NDARRAY", "NPBYTES", "NPSCALAR", "NPSTR", "PYLIST", "STR", "TENSOR", "TEXT_ERRORS", "TEXT_KINDS", "Field",
           "Layout", "Leaf", "class_path", "describe_structure", "encode_metadata", "find_class", "flatten", "fold",
           "number_list"]


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

    @property
    def ragged(self) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if f.ragged)

    @classmethod
    def from_sample(cls, sample: Any, max_shapes: dict[str, Sequence[int]] | None = None) -> Layout:
        """The layout of one sample (see ``from_samples``)."""
        return cls.from_samples([sample], max_shapes)

    @classmethod
    def from_samples(cls, samples: Sequence[Any], max_shapes: dict[str, Sequence[int]] | None = None,
                     ragged: Iterable[str] | None = None, store_as: Mapping[str, str] | None = None) -> Layout:
        """The layout of a first sample, with the shapes of the others (probes) deciding which fields are ragged.

        A field is ragged if it is named in ``ragged``, is ``str``/``bytes``, or its shape differs among the
        samples; fields named in ``max_shapes`` are instead stored in fixed rows of that maximum shape. Fields named
        in ``store_as`` are ragged, their values stored narrower (``{"input_ids": "int32"}``) or, for a field of
        ones (``"attention_mask": "ones"``), as their shapes alone (see ``Field.stored``). Probes
        whose structure differs from the first sample's are ignored here (storing them fails with the usual
        explanation).

        Raises:
            LayoutError: the sample has no leaves, two leaves share a field path, more than ``MAX_FIELDS``
                fields, an option names an unknown or unsuitable field, or as ``flatten``.
        """
        structure, leaves = flatten(samples[0])
        if not leaves:
            raise LayoutError(
                f"a sample needs at least one field (a tensor, array or number); the first sample is "
                f"{describe_structure(structure)} with none: return at least one value from the wrapped dataset"
            )
        if len(leaves) > MAX_FIELDS:
            raise LayoutError(
                f"the sample has {len(leaves)} fields (the limit is {MAX_FIELDS}; the first are "
                f"{', '.join(repr(leaf.field.name) for leaf in leaves[:4])}, ...): its arrays arrive as containers of "
                "many separate values. Return arrays or tensors instead: for a Hugging Face dataset of numbers, "
                "dataset.with_format('torch') or dataset.with_format('numpy'); a list of many strings, or of lists "
                "of different lengths, is one field per element in every format: join or flatten it (e.g. in "
                "dataset.map) into one str or one array; otherwise stack the values into a tensor in the wrapped "
                "dataset"
            )
        _check_unique_names(structure, leaves)
        seen: list[set[tuple[int, ...]]] = [{leaf.field.shape} for leaf in leaves]
        for other in samples[1:]:
            try:
                other_structure, other_leaves = flatten(other)
            except LayoutError:
                continue
            if other_structure == structure and len(other_leaves) == len(leaves):
                for shapes, leaf in zip(seen, other_leaves):
                    shapes.add(leaf.field.shape)
        max_shapes = dict(max_shapes or {})
        declared = set(ragged or ())
        store_as = dict(store_as or {})
        names = {leaf.field.name for leaf in leaves}
        unknown = sorted((set(max_shapes) | declared | set(store_as)) - names)
        if unknown:
            known = ", ".join(repr(leaf.field.name) for leaf in leaves)
            option = "max_shapes" if set(unknown) & set(max_shapes) else "store_as" if set(unknown) & set(
                store_as) else "ragged"
            raise LayoutError(f"{option} names unknown field(s) {unknown}; the sample's fields are {known}")
        both = sorted(set(store_as) & set(max_shapes))
        if both:
            raise LayoutError(f"field(s) {both} are named in both max_shapes and store_as; store_as narrows the values "
                              "of fields stored ragged: leave them out of max_shapes")
        declared |= {name for name in store_as if name in names}  # (narrowed values are stored packed: ragged)
        both = sorted(declared & set(max_shapes))
        if both:
            raise LayoutError(f"field(s) {both} are named in both max_shapes and ragged; choose one (ragged packs "
                              "values of any size; max_shapes reserves the maximum in every row)")
        fields = []
        for number, (leaf, shapes) in enumerate(zip(leaves, seen)):
            field = leaf.field
            if field.kind == PYLIST and leaf.value.size == 0:
                field = replace(field, dtype=_probed_list_dtype(samples[1:], structure, number, field.dtype))
            if field.name in store_as and field.kind not in (TENSOR, NDARRAY, PYLIST):
                raise LayoutError(f"store_as names field {field.name!r}, of kind {field.kind}: it narrows the values "
                                  "of tensors, arrays, lists of numbers (token ids, masks): leave it out of store_as")
            if field.name in max_shapes:
                if field.kind not in (TENSOR, NDARRAY, PYLIST) or not field.shape:
                    what = "always stored packed at its own size (ragged)" if field.kind in BYTE_KINDS else \
                        "of no shape"
                    article = "an" if field.kind[0] in "aeiou" else "a"
                    raise LayoutError(f"max_shapes names field {field.name!r}, {article} {field.kind} {what}; only "
                                      "arrays, "
                                      "tensors and lists of numbers have a maximum shape: remove it from max_shapes")
                limit = tuple(int(d) for d in max_shapes[field.name])
                _check_fits(field, limit, field.shape, None)
                field = replace(field, shape=limit, variable=True)
            elif field.name in declared or (len(shapes) > 1 and not field.ragged):
                field = _ragged_field(field, shapes, field.name in declared)
            elif field.kind == PYLIST and len(field.shape) == 1:
                field = _ragged_field(field, shapes, True)  # a list of numbers: token ids, as often as not
            if field.name in store_as:
                field = _stored_as(field, store_as[field.name])
            fields.append(field)
        return cls(structure, tuple(fields))

    def check(self, sample: Any, index: int, path: str = "PATH") -> list[np.ndarray]:
        """Flattens a sample and checks it against this layout; returns its leaves' values in field order.

        Raises:
            LayoutError: naming the index, the field path, and what was expected versus found (and ``path``, the
                cache's, in the fix).
        """
        try:
            structure, leaves = flatten(sample)
        except LayoutError as exc:
            raise LayoutError(f"sample {index}: {exc}") from None
        if structure != self.structure or len(leaves) != len(self.fields):
            raise LayoutError(
                f"sample {index} has a different structure from the cache's first sample: expected "
                f"{describe_structure(self.structure)}, found {describe_structure(structure)}; every sample must "
                "have the same containers and field paths (a list of strings or of tensors is one field per element, "
                "so its length cannot vary: join the strings into one str, stack the tensors, or pad to one length)"
            )
        values = []
        for field, leaf in zip(self.fields, leaves):
            found, value = leaf.field, leaf.value
            if field.kind == PYLIST and found.kind == PYLIST and value.size == 0 and len(found.shape) == len(
                    field.shape):
                value = value.astype(field.np_dtype)  # an empty list has no type of its own
                found = replace(found, dtype=field.dtype)
            if (found.kind, found.dtype, found.torch_dtype, found.tensor_class) != (
                    field.kind, field.dtype, field.torch_dtype, field.tensor_class):
                hint = ""
                if field.kind == PYLIST == found.kind:
                    hint = (" (a list of numbers takes its element type from the first sample, float64 if that list "
                            "was empty: remove this cache (`mmapcache rm` it) and create it again with "
                            "ragged='auto', which learns the type from more samples)")
                raise LayoutError(
                    f"sample {index}, field {field.name!r}: expected {_kind_of(field)}, found {_kind_of(found)}; "
                    f"make the wrapped dataset return the same types for every index{hint}"
                )
            if field.variable:
                _check_fits(field, field.shape, found.shape, index)
            elif not field.fits(found.shape):
                raise LayoutError(_shape_message(field, found.shape, index, path))
            values.append(value)
        return values


    def differences(self, sample: Any) -> list[tuple[str, str]]:
        """How ``sample`` differs from this layout, one ``(what the cache stores, what the sample has)`` per field
        that differs (or for the structure), in terms that do not name the sample: a report of many samples of a
        changed source groups them (``admin.verify``). Empty if the sample fits."""
        try:
            structure, leaves = flatten(sample)
        except LayoutError as exc:
            return [("a sample mmapcache can store", f"one it cannot ({exc})")]
        if structure != self.structure or len(leaves) != len(self.fields):
            return [(f"structure {describe_structure(self.structure)}", f"{describe_structure(structure)}")]
        out = []
        for field, leaf in zip(self.fields, leaves):
            found = leaf.field
            if (found.kind, found.dtype, found.torch_dtype, found.tensor_class) != (
                    field.kind, field.dtype, field.torch_dtype, field.tensor_class) and not (
                    field.kind == PYLIST == found.kind and leaf.value.size == 0):
                out.append((f"field {field.name!r} as {_kind_of(field)}", _kind_of(found)))
            elif not field.fits(found.shape):
                dims = ["*" if d < 0 else str(d) for d in field.shape]
                shown = f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"
                out.append((f"field {field.name!r} of shape {shown}", f"shape {found.shape}"))
        return out


def _stored_as(field: Field, how: Any) -> Field:
    """A ragged ``field`` stored as ``store_as`` asks: a narrower dtype of its kind, or ``"ones"`` (see ``Field``).

    Raises:
        LayoutError: not a dtype, or one that is not a narrower one of the field's kind; the message names the
            field and the fix.
    """
    bits = field.torch_dtype is not None and field.torch_dtype != field.np_dtype.name
    if how == "ones":
        if bits:  # (its 1.0 is no 1 in the bits it is stored as)
            raise LayoutError(f"store_as={{{field.name!r}: 'ones'}}: field {field.name!r} holds {field.torch_dtype}, "
                              "which numpy has no type for (it is stored as its bits): store it as it is (leave it "
                              "out), or give it as float32 or int64")
        return replace(field, ones=True)
    try:
        target = np.dtype(how).newbyteorder("=")  # ('>i4': the width asked for, stored in this machine's order)
    except TypeError:
        raise LayoutError(f"store_as={{{field.name!r}: {how!r}}}: not a numpy dtype name ('int32', 'uint8', "
                          "'float16'...) nor 'ones'") from None
    served = field.np_dtype
    if bits:
        raise LayoutError(f"store_as={{{field.name!r}: {how!r}}}: field {field.name!r} holds {field.torch_dtype}, "
                          "which numpy has no type for (it is stored as its bits): store it as it is (leave it out)")
    if not narrower(served, target):
        raise LayoutError(f"store_as={{{field.name!r}: {how!r}}}: field {field.name!r} holds {served.name}, and "
                          f"{target.name} is not a narrower type of its kind (an integer field in a narrower "
                          "integer, a float field in a narrower float); store it as it is (leave it out)")
    return replace(field, stored=target.str)


def _kind_of(field: Field) -> str:
    kind = f"{field.tensor_class[0]}.{field.tensor_class[1]}" if field.tensor_class else field.kind
    return f"{kind} of dtype {field.torch_dtype or field.dtype}"


def _probed_list_dtype(probes: Sequence[Any], structure: Any, number: int, default: str) -> str:
    """An empty list has no element type: take it from the first probe with a non-empty list there, else
    ``default`` (float64)."""
    for probe in probes:
        try:
            probe_structure, probe_leaves = flatten(probe)
        except LayoutError:
            continue
        if probe_structure == structure and number < len(probe_leaves):
            leaf = probe_leaves[number]
            if leaf.field.kind == PYLIST and leaf.value.size:
                return leaf.field.dtype
    return default


def _ragged_field(field: Field, shapes: set[tuple[int, ...]], declared: bool) -> Field:
    if not field.shape and field.kind not in (TENSOR, NDARRAY, PYLIST):
        raise LayoutError(f"field {field.name!r} is a {field.kind}, which has no shape; only arrays, tensors and "
                          "lists can be ragged: remove it from ragged=")
    if not field.shape and declared:  # (a heap's values have one dimension or more; found by review)
        raise LayoutError(f"field {field.name!r} is a 0-dim {field.kind} (one number a sample): only values with "
                          "dimensions are stored ragged or narrowed: remove it from ragged= and store_as (or give "
                          "it as a 1-element value)")
    ndims = {len(s) for s in shapes}
    if len(ndims) > 1:
        raise LayoutError(
            f"field {field.name!r} has shapes with different numbers of dimensions ({sorted(shapes)}); a ragged "
            "field may vary in size but not in number of dimensions: reshape its values in the wrapped dataset"
        )
    if declared or not field.shape:
        shape = tuple(-1 for _ in field.shape)
    else:
        shape = tuple(-1 if len({s[d] for s in shapes}) > 1 else field.shape[d] for d in range(len(field.shape)))
    return replace(field, shape=shape, ragged=True)


def _shape_message(field: Field, found: tuple[int, ...], index: int, path: str) -> str:
    if field.ragged and len(found) != len(field.shape):
        return (f"sample {index}, field {field.name!r}: {len(found)} dimensions {found}, where the field has "
                f"{len(field.shape)}; a ragged field may vary in size but not in number of dimensions: reshape its "
                "values in the wrapped dataset")
    if field.ragged:
        return (f"sample {index}, field {field.name!r}: shape {found} does not fit the field's shape "
                f"{tuple('*' if d < 0 else d for d in field.shape)} (* varies); its other dimensions and the number of "
                f"dimensions must stay the same: declare the field ragged=[{field.name!r}] (--ragged {field.name} on "
                f"the command line) in a new cache to let every dimension vary (overwrite=True replaces this one; or "
                f"`mmapcache rm {path}` first)")
    if len(found) != len(field.shape):
        return (f"sample {index}, field {field.name!r}: expected shape {field.shape}, found {found}; every sample "
                "must have the same number of dimensions in each field")
    return (f"sample {index}, field {field.name!r}: expected shape {field.shape}, found {found}: the field's shape "
            f"varies, and the cache stores it in fixed rows of one shape (the samples probed when it was created, "
            f"with ragged='auto', the default, all had that shape; or it was made with ragged=None). Declare it "
            f"ragged=[{field.name!r}] (values packed at their own size) or max_shapes={{{field.name!r}: ...}} (fixed "
            f"rows of a maximum shape; --ragged and --max-shapes on the command line) in a new cache: pass "
            f"overwrite=True with the option, or remove this cache (`mmapcache rm {path}`) first")


def _check_unique_names(structure: Any, leaves: list[Leaf]) -> None:
    # A dict key holding the separator ("a.b") can name the same path as nested keys (a -> b); both fields would
    # be called "a.b", and max_shapes or an error message could only ever name the first. Refused rather than
    # escaped: escaping would rename fields of caches that exist today, and such keys are rare.
    seen: dict[str, int] = {}
    for number, leaf in enumerate(leaves):
        name = leaf.field.name
        if name in seen:
            first, second = (route(structure, n) for n in (seen[name], number))
            raise LayoutError(
                f"two fields have the same path {name!r}: {first} and {second} (a dict key holding '.' names the "
                "same path as nested keys); rename a key in the wrapped dataset's samples (e.g. 'a_b' for 'a.b')"
            )
        seen[name] = number


def _check_fits(field: Field, limit: tuple[int, ...], shape: tuple[int, ...], index: int | None) -> None:
    where = f"sample {index}, field {field.name!r}" if index is not None else f"field {field.name!r}"
    if len(limit) != len(shape) or any(s > m for s, m in zip(shape, limit)):
        largest = tuple(max(a, b) for a, b in zip(limit, shape)) if len(limit) == len(shape) else shape
        raise LayoutError(
            f"{where}: shape {shape} does not fit the declared maximum shape {limit}; declare "
            f"max_shapes={{{field.name!r}: {largest}}} or larger (same number of dimensions) when creating the cache"
        )
