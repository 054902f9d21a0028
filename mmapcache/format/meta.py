"""``meta.json``: building it for a new cache, and validating what a reader finds (the schema is ``format.spec``).

Validation refuses anything a writer of this version would not have written (a field that contradicts itself,
counts no cache can have, files named twice), so that no reader acts on it; the caller turns the ``ValueError`` into
``CacheFormatError`` naming the file.
"""

from __future__ import annotations

import datetime as _dt
import json
import keyword
import os
import re
from typing import Any

from ..errors import CacheFormatError
from .fields import (
    BOOL,
    BYTE_KINDS,
    BYTES,
    FLOAT,
    INT,
    JSON,
    KINDS,
    MAX_DIMS,
    NDARRAY,
    NPBYTES,
    NPSCALAR,
    NPSTR,
    PYLIST,
    STR,
    TENSOR,
    narrower,
)
from .layout import Layout
from .spec import (
    CHANGES,
    FILLED,
    FORMAT_VERSION,
    FORMAT_VERSIONS_READ,
    HEAPS,
    KEYS,
    LOCK,
    MAGIC,
    META,
    MODES,
    NARROWED_SINCE,
    PRODUCERS,
    RING,
    SEQ,
    SLOT_INDEX,
    STALE,
    USERS,
)
from .tree import fold

__all__ = ["field_files", "make_meta", "parse_meta", "MAX_COUNT"]


_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,100}$")


def field_files(layout: Layout) -> list[dict[str, str | None]]:
    """The files of each field: ``file`` and ``shape_file`` (fixed fields), ``heap`` and ``index_file`` (ragged
    ones), named ``<name>.*`` when the name is a safe, unique file name, else ``field-<n>.*``."""
    taken = {SLOT_INDEX, KEYS, HEAPS, RING, PRODUCERS, CHANGES}
    files = []
    for n, field in enumerate(layout.fields):
        def names(stem: str, field: Any = field) -> dict[str, str | None]:
            if field.ragged:
                return {"file": None, "shape_file": None, "heap": f"{stem}.heap", "index_file": f"{stem}.index.npy"}
            return {"file": f"{stem}.npy", "shape_file": f"{stem}.shape.npy" if field.variable else None,
                    "heap": None, "index_file": None}
        chosen = names(field.name if _SAFE_NAME.match(field.name) else f"field-{n}")
        if any(name in taken for name in chosen.values() if name):
            chosen = names(f"field-{n}")
        taken.update(name for name in chosen.values() if name)
        files.append(chosen)
    return files


def make_meta(
    layout: Layout,
    *,
    length: int,
    slots: int,
    variants: int,
    has_slot_index: bool,
    fingerprint: str | None,
    delete_on_close: bool,
    library_version: str,
    heap_budget: int | None = None,
    share: dict[str, Any] | None = None,
    stream: dict[str, Any] | None = None,
    deterministic: bool = True,
) -> dict[str, Any]:
    fields = [{**field.to_json(), **files} for field, files in zip(layout.fields, field_files(layout))]
    return {
        "magic": MAGIC,
        # Format 3 only where a field is stored narrowed: every other cache stays readable by readers of format 2.
        "format_version": FORMAT_VERSION if any(f.stored is not None or f.ones for f in layout.fields)
        else NARROWED_SINCE - 1,
        "library_version": library_version,
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "mode": "cache" if stream is None else "stream",
        "share": share,
        "stream": stream,
        "length": length,
        "slots": slots,
        "variants": variants,
        "rows": slots * variants,
        "slot_index": SLOT_INDEX if has_slot_index else None,
        "fingerprint": fingerprint,
        "deterministic": deterministic,
        "delete_on_close": delete_on_close,
        "heap_budget": heap_budget,
        "structure": layout.structure,
        "fields": fields,
    }


def parse_meta(text: str, directory: str) -> dict[str, Any]:
    """``meta.json``'s text, parsed and validated (the cache at ``directory`` is named in errors).

    Raises:
        CacheFormatError: unknown magic or version, or a malformed file; the message names the file, what was
            found and what was expected, and the fix.
    """
    path = os.path.join(directory, META)
    fix = f"remove the damaged cache with `mmapcache rm --force {directory}` and build it again"
    try:
        meta = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise CacheFormatError(f"{path} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(meta, dict) or meta.get("magic") != MAGIC:
        found = meta.get("magic") if isinstance(meta, dict) else type(meta).__name__
        raise CacheFormatError(f"{path}: magic is {found!r}, expected {MAGIC!r}: this is not an mmapcache cache; {fix}")
    version = meta.get("format_version")
    if version == 1:
        raise CacheFormatError(
            f"{path}: format version 1, written by an older mmapcache; this mmapcache reads versions 2 and 3. "
            f"A cache is derived data: rebuild it (`mmapcache rm --force {directory}`, then open it with its source "
            "dataset or run `mmapcache build`)"
        )
    if version not in FORMAT_VERSIONS_READ:
        raise CacheFormatError(
            f"{path}: format version {version!r}, this mmapcache reads versions 2 and 3; upgrade mmapcache to read it, "
            f"or remove it (`mmapcache rm --force {directory}`) and build it again"
        )
    try:
        _check_meta(meta)
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise CacheFormatError(f"{path} is malformed ({type(exc).__name__}: {exc}); {fix}") from None
    return meta




def _check_meta(meta: dict[str, Any]) -> None:
    version = meta["format_version"]
    if meta["mode"] not in MODES:
        raise ValueError(f"mode {meta['mode']!r} is not one of {MODES}")
    _check_share(meta)
    _check_stream(meta)
    if type(meta.setdefault("deterministic", True)) is not bool:  # absent: written before 0.3, which compared
        raise ValueError(f"deterministic must be true or false, found {meta['deterministic']!r}")
    if type(meta["delete_on_close"]) is not bool:  # a stray truthy value would remove the cache on a close
        raise ValueError(f"delete_on_close must be true or false, found {meta['delete_on_close']!r}")
    if meta["fingerprint"] is not None and not isinstance(meta["fingerprint"], str):
        raise ValueError(f"fingerprint must be null or a string, found {meta['fingerprint']!r}")
    for key in ("library_version", "created"):  # shown by inspect; every writer of format 2 wrote them
        if not isinstance(meta[key], str):
            raise ValueError(f"{key} must be a string, found {meta[key]!r}")
    if meta["heap_budget"] is not None and (not isinstance(meta["heap_budget"], int) or meta["heap_budget"] < 0):
        raise ValueError(f"heap_budget must be null or a non-negative integer, found {meta['heap_budget']!r}")
    for key in ("length", "slots", "variants", "rows"):
        if type(meta[key]) is not int or not 0 <= meta[key] <= MAX_COUNT:
            raise ValueError(f"{key!r} must be an integer in [0, 2**48], found {meta[key]!r}")
    if meta["rows"] != meta["slots"] * meta["variants"] or meta["slots"] > meta["length"] or meta["variants"] < 1:
        raise ValueError(f"inconsistent sizes: length {meta['length']}, slots {meta['slots']}, variants "
                         f"{meta['variants']}, rows {meta['rows']}")
    layout = Layout.from_json(meta)
    if len(layout.fields) != len(meta["fields"]) or not layout.fields:
        raise ValueError("no fields")
    metadata = [f.metadata for f in layout.fields if f.metadata is not None]
    for number, field in enumerate(layout.fields):
        # Readers rebuild samples from these: an unknown kind or an object dtype would fail later, mid-read.
        if field.kind not in KINDS or field.np_dtype.hasobject or any(d < (-1 if field.ragged else 0)
                                                                      for d in field.shape):
            raise ValueError(f"field {field.name!r}: bad kind {field.kind!r}, dtype {field.dtype!r} or shape "
                             f"{field.shape}")
        _check_field(field, meta["fields"][number])
        if (field.stored is not None or field.ones) and version < NARROWED_SINCE:
            raise ValueError(f"field {field.name!r} is stored narrowed ('stored'/'ones'), which format "
                             f"{NARROWED_SINCE} introduced, in a cache of format {version}")
        if field.metadata is not None and not (
                type(field.metadata) is int and 0 <= field.metadata < len(layout.fields)
                and layout.fields[field.metadata].kind == JSON and field.tensor_class is not None):
            raise ValueError(f"field {field.name!r}: bad metadata field {field.metadata!r}")
    leaves = _structure_leaves(meta["structure"])
    if sorted(leaves + metadata) != list(range(len(layout.fields))):
        raise ValueError(f"the structure's leaves {sorted(leaves)} and metadata fields {metadata} do not match the "
                         f"{len(layout.fields)} fields")
    used = dict.fromkeys((META, FILLED, STALE, SEQ, LOCK, USERS, KEYS, HEAPS, RING, PRODUCERS, CHANGES),
                         "a state file")
    if meta["slot_index"] is not None:
        if meta["slot_index"] != SLOT_INDEX:
            raise ValueError(f"slot_index names {meta['slot_index']!r}, expected {SLOT_INDEX!r}")
        used[SLOT_INDEX] = "the slot index"
    for field in meta["fields"]:
        for key in ("file", "shape_file", "heap", "index_file"):
            name = field[key]
            if name is not None and (not isinstance(name, str) or "/" in name or name.startswith(".")):
                raise ValueError(f"field {field['name']!r}: bad file name {name!r}")
            if name is not None and name in used:
                # Two writers of one file would overwrite each other's rows: every file has one owner.
                raise ValueError(f"field {field['name']!r}: its {key} {name!r} is also {used[name]}")
            if name is not None:
                used[name] = f"the {key} of field {field['name']!r}"


# What each kind of leaf is stored as (see above): its dtype, when it has one fixed dtype, and its dimensions.
_KIND_DTYPES = {INT: "<i8", FLOAT: "<f8", BOOL: "|b1", STR: "|u1", BYTES: "|u1", JSON: "|u1", NPSTR: "|u1",
                NPBYTES: "|u1"}
_SCALAR_KINDS = (INT, FLOAT, BOOL, NPSCALAR)
# torch dtypes and their item sizes: a tensor field's storage dtype has the same width.
_TORCH_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
                   "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4,
                   "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
                   "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1}
# Lengths, slots and rows above this are not a real cache's (and would make readers allocate without bound).
MAX_COUNT = 1 << 48


def _check_field(field: Any, spec: dict[str, Any]) -> None:
    """A field's entry describes what a writer of this version writes: a kind with its dtype and dimensions, one
    storage (fixed rows, ``max_shapes`` rows, or a heap) with the files it needs, and nothing contradictory."""
    problem = None
    files = {key: spec.get(key) for key in ("file", "shape_file", "heap", "index_file")}
    if field.ragged and field.variable:
        problem = "both ragged and variable"
    elif field.ragged != (files["file"] is None) or field.ragged != (files["heap"] is not None) or (
            field.ragged != (files["index_file"] is not None)) or field.variable != (files["shape_file"] is not None):
        problem = f"its files {files} do not match ragged={field.ragged}, variable={field.variable}"
    elif field.kind in _KIND_DTYPES and field.dtype != _KIND_DTYPES[field.kind]:
        problem = f"kind {field.kind!r} is stored as {_KIND_DTYPES[field.kind]!r}, not {field.dtype!r}"
    elif field.kind in BYTE_KINDS and (not field.ragged or len(field.shape) != 1):
        problem = f"kind {field.kind!r} is stored ragged with one dimension"
    elif field.kind in _SCALAR_KINDS and (field.shape or field.ragged or field.variable):
        problem = f"kind {field.kind!r} is a scalar, stored in fixed rows"
    elif field.torch_dtype is not None and _TORCH_ITEMSIZE.get(field.torch_dtype, field.np_dtype.itemsize) != (
            field.np_dtype.itemsize):
        problem = f"torch_dtype {field.torch_dtype!r} is not stored as {field.dtype!r}"
    elif field.np_dtype.kind not in "biufc" or len(field.shape) > MAX_DIMS:
        problem = f"dtype {field.dtype!r} or {len(field.shape)} dimensions cannot be stored"
    elif (field.stored is not None or field.ones) and not (field.ragged and field.kind in (TENSOR, NDARRAY, PYLIST)):
        problem = "stored narrowed ('stored' or 'ones'), which only ragged tensors, arrays and lists are"
    elif field.stored is not None and field.ones:
        problem = "both 'stored' and 'ones'"
    elif field.stored is not None and (not narrower(field.np_dtype, field.storage_dtype) or (
            field.torch_dtype not in (None, field.np_dtype.name))):
        problem = f"stored as {field.stored!r}, not a narrower type of its dtype {field.dtype!r}"
    if problem is not None:
        raise ValueError(f"field {field.name!r}: {problem}")


def _is_count(value: Any, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _check_share(meta: dict[str, Any]) -> None:
    share = meta["share"]
    if share is None:
        return
    if not isinstance(share, dict) or set(share) != {"node", "nodes", "seed", "rotate_every"}:
        raise ValueError(f"share must be null or {{node, nodes, seed, rotate_every}}, found {share!r}")
    node, nodes, rotate = share["node"], share["nodes"], share["rotate_every"]
    if not (_is_count(nodes, 1) and _is_count(node) and node < nodes and type(share["seed"]) is int
            and (rotate is None or _is_count(rotate, 1))):
        raise ValueError(f"bad share {share!r}")
    if meta["mode"] != "cache" or meta["slot_index"] is None:
        raise ValueError("a node share needs mode 'cache' and a slot index")


def _check_stream(meta: dict[str, Any]) -> None:
    stream = meta["stream"]
    if meta["mode"] != "stream":
        if stream is not None:
            raise ValueError("stream settings in a cache of mode 'cache'")
        return
    if not isinstance(stream, dict) or set(stream) - {"split"} != {"seed"} or type(stream["seed"]) is not int:
        raise ValueError(f"stream must be {{seed}} or {{seed, split}}, found {stream!r}")
    split = stream.get("split", {"node": 0, "nodes": 2, "ranks": 1})
    if not (isinstance(split, dict) and set(split) == {"node", "nodes", "ranks"} and _is_count(split["nodes"], 2)
            and _is_count(split["node"]) and split["node"] < split["nodes"] and _is_count(split["ranks"], 1)
            and split["nodes"] * split["ranks"] <= 1 << 20):
        raise ValueError(f"bad stream split {split!r}: need {{node, nodes, ranks}}, 0 <= node < nodes, nodes >= 2, "
                         "ranks >= 1")
    if meta["variants"] != 1 or meta["slot_index"] is not None or meta["share"] is not None or meta["slots"] < 1:
        raise ValueError("a stream has one variant, at least one slot, no slot index and no share")


def _structure_leaves(node: Any) -> list[int]:
    """The field numbers of a structure tree (see the format above); ValueError (or LayoutError, a TypeError, for
    nesting deeper than ``MAX_DEPTH``) if the tree is malformed."""
    def record(spec: tuple[Any, Any, Any], parts: list[list[int]], children: list[Any]) -> list[int]:
        module, qualname, names = spec
        # The names become a class's fields when a reader rebuilds the namedtuple: they must be valid ones.
        if not (isinstance(module, str) and isinstance(qualname, str) and isinstance(names, list)
                and all(isinstance(n, str) and n.isidentifier() and not keyword.iskeyword(n) and n[0] != "_"
                        for n in names) and len(set(names)) == len(names)
                and qualname.rsplit(".", 1)[-1].isidentifier()):
            raise ValueError(f"bad namedtuple description {list(spec)!r}")
        if len(children) != len(names):
            raise ValueError(f"namedtuple {qualname!r} has {len(names)} names but items {children!r}")
        return _concat(parts)

    return fold(node, leaf=lambda number: [number], record=record,
                sequence=lambda kind, parts, children: _concat(parts),
                mapping=lambda keys, parts, children: _concat(parts))


def _concat(parts: list[list[int]]) -> list[int]:
    return [number for part in parts for number in part]
