"""The on-disk format of a cache: file names, the ``meta.json`` schema, magic and version.

Format version 1
================

A cache is a directory. Every file in it is created before the directory is renamed into place, so a
reader never sees a partial cache: it is built as ``<parent>/.mmapcache-new-PID-HEX/cache`` (a scratch directory
whose first file is the marker ``MMAPCACHE-SCRATCH``), and removed by renaming it to
``<parent>/.mmapcache-old-PID-HEX/cache`` first; only such marked scratch directories of dead processes are ever
swept. Every file of a cache is a regular file with one link (opened with ``O_NOFOLLOW``; see ``_files``).
Sizes are fixed at creation; nothing is ever appended or truncated.

Terms: ``N`` = ``length`` (samples in the source); ``S`` = ``slots`` (samples that can be cached, ``S <= N``);
``K`` = ``variants`` (stored versions of each sample); ``R = S * K`` rows. Sample ``i`` lives in slot
``s = i`` when ``slot_index`` is null and ``i < S`` (a cached prefix), else in slot ``s`` with
``slot_index.npy[s] == i``; its variant ``v`` is row ``r = s * K + v``.

``meta.json`` (UTF-8 JSON, written once at creation, never modified)::

    {"magic": "mmapcache", "format_version": 1, "library_version": "0.1.0",
     "created": "2026-11-22T03:00:00Z",      # UTC, ISO 8601
     "length": N, "slots": S, "variants": K, "rows": R,
     "slot_index": null | "slot_index.npy",  # which source index each slot holds, when not a prefix
     "fingerprint": null | "<str>",          # caller's identification of the source
     "delete_on_close": false,               # remove the cache when its last user detaches
     "structure": {...},                     # the container tree: {"tuple": [...]}, {"list": [...]},
                                             #   {"dict": [[key, node], ...]},
                                             #   {"namedtuple": [module, qualname, [names]], "items": [...]},
                                             #   {"leaf": field_number}
     "fields": [{"name": "0", "kind": "tensor", "dtype": "|u1", "torch_dtype": "uint8",
                 "shape": [3, 64, 64], "variable": false, "file": "0.npy",
                 "shape_file": null | "0.shape.npy"}, ...]}

``kind`` is one of tensor, ndarray, int, float, bool, numpy_scalar. ``dtype`` is ``numpy.dtype.str``; torch
dtypes without a numpy equivalent (bfloat16, complex32, float8) are stored as the unsigned integer of the same
width and ``torch_dtype`` names the real type.

``<field>.npy`` (one per field): a standard NumPy ``.npy`` file (format 1.0, C order) of shape ``(R, *shape)``,
so ``numpy.load(path + "/image.npy", mmap_mode="r")`` reads it. Row ``r`` holds the sample stored in row ``r``
if its filled bit is set; other rows are zero or stale. A *variable* field's row holds the sample's value
flattened (C order) in its first ``prod(actual_shape)`` elements; the actual shape is row ``r`` of
``<field>.shape.npy``, an int64 ``.npy`` of shape ``(R, ndim)``.

``slot_index.npy`` (only when ``slot_index`` is not null): int64, shape ``(S,)``: the source index in each slot.

``filled.bits``: ``ceil(R / 8)`` bytes; bit ``r`` (byte ``r // 8``, bit ``r % 8``, little-endian bit order as
``numpy.unpackbits(bits, bitorder="little")`` reads it) is 1 when row ``r`` holds a complete sample.

``stale.bits``: same size and order; bit ``r`` is 1 when row ``r`` was marked for recomputation (refresh).

``seq.u32``: ``R`` little-endian uint32 sequence counters. A writer makes ``seq[r]`` odd before touching row
``r``'s bytes and even (one higher) after. A reader copies a row only if its filled bit is set and ``seq[r]`` is
even, and keeps the copy only if ``seq[r]`` is unchanged after the copy (a seqlock). A filled row's counter is
at least 2. An odd counter seen by a writer holding the lock is a writer that died mid-write: the row is
treated as unfilled.

``lock``: empty. ``flock(LOCK_EX)`` on it is the writer lock: bitmaps and counters change, and rows are
written, only under it. POSIX byte-range locks (``fcntl``) on byte ``c`` of the same file are build workers'
claims on chunk ``c`` (Linux keeps the two kinds of lock independent); the kernel drops both when a holder dies.

``users``: empty. Every process using the cache holds ``flock(LOCK_SH)`` on it; a process that can take
``LOCK_EX`` is the last user (used by ``delete_on_close`` and by ``rm`` to refuse caches in use).

Format history
--------------
1: first version (this document).
"""

from __future__ import annotations

import datetime as _dt
import json
import keyword
import os
import re
from typing import Any

from ._files import open_file
from ._layout import KINDS, Layout, fold
from .errors import CacheFormatError

MAGIC = "mmapcache"
FORMAT_VERSION = 1

META = "meta.json"
FILLED = "filled.bits"
STALE = "stale.bits"
SEQ = "seq.u32"
LOCK = "lock"
USERS = "users"
SLOT_INDEX = "slot_index.npy"

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,100}$")


def is_cache(path: str) -> bool:
    """Whether ``path`` is a directory holding a ``meta.json`` (a complete cache: it is written last)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META))


def field_files(layout: Layout) -> list[tuple[str, str | None]]:
    """The data file and shape file name of each field: ``<name>.npy`` when the name is a safe, unique file
    name, else ``field-<n>.npy``."""
    taken = {SLOT_INDEX}
    files = []
    for n, field in enumerate(layout.fields):
        stem = field.name if _SAFE_NAME.match(field.name) else f"field-{n}"
        if f"{stem}.npy" in taken or f"{stem}.shape.npy" in taken:
            stem = f"field-{n}"
        data, shape = f"{stem}.npy", f"{stem}.shape.npy" if field.variable else None
        taken.update({data, shape or data})
        files.append((data, shape))
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
) -> dict[str, Any]:
    fields = []
    for field, (data, shape) in zip(layout.fields, field_files(layout)):
        fields.append({**field.to_json(), "file": data, "shape_file": shape})
    return {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "library_version": library_version,
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "length": length,
        "slots": slots,
        "variants": variants,
        "rows": slots * variants,
        "slot_index": SLOT_INDEX if has_slot_index else None,
        "fingerprint": fingerprint,
        "delete_on_close": delete_on_close,
        "structure": layout.structure,
        "fields": fields,
    }


def write_meta(directory: str, meta: dict[str, Any]) -> None:
    # 0o664 minus the umask, never writable by others (see _create.FILE_MODE).
    fd = os.open(os.path.join(directory, META), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o664)
    with open(fd, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


def read_meta(directory: str) -> dict[str, Any]:
    """Reads and validates ``meta.json``.

    Raises:
        CacheFormatError: not a cache, unknown magic or version, or a malformed file; the message names the
            file, what was found and what was expected, and the fix.
    """
    path = os.path.join(directory, META)
    fix = f"remove the damaged cache with `mmapcache rm --force {directory}` and build it again"
    try:
        with open(open_file(directory, META, os.O_RDONLY), encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise CacheFormatError(
            f"{directory} is not an mmapcache cache (it has no {META}); pass the path of a cache (`mmapcache ls` "
            "lists them) or a path that does not exist yet"
        ) from None
    except (PermissionError, UnicodeDecodeError) as exc:
        raise CacheFormatError(f"{path} cannot be read ({exc}); {fix}") from None
    try:
        meta = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise CacheFormatError(f"{path} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(meta, dict) or meta.get("magic") != MAGIC:
        found = meta.get("magic") if isinstance(meta, dict) else type(meta).__name__
        raise CacheFormatError(f"{path}: magic is {found!r}, expected {MAGIC!r}: this is not an mmapcache cache; {fix}")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CacheFormatError(
            f"{path}: format version {version!r}, this mmapcache reads version {FORMAT_VERSION}; upgrade mmapcache "
            f"to read it, or remove it (`mmapcache rm --force {directory}`) and build it again"
        )
    try:
        _check_meta(meta)
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise CacheFormatError(f"{path} is malformed ({type(exc).__name__}: {exc}); {fix}") from None
    return meta


def _check_meta(meta: dict[str, Any]) -> None:
    for key in ("length", "slots", "variants", "rows"):
        if not isinstance(meta[key], int) or meta[key] < 0:
            raise ValueError(f"{key!r} must be a non-negative integer, found {meta[key]!r}")
    if meta["rows"] != meta["slots"] * meta["variants"] or meta["slots"] > meta["length"] or meta["variants"] < 1:
        raise ValueError(f"inconsistent sizes: length {meta['length']}, slots {meta['slots']}, variants "
                         f"{meta['variants']}, rows {meta['rows']}")
    layout = Layout.from_json(meta)
    if len(layout.fields) != len(meta["fields"]) or not layout.fields:
        raise ValueError("no fields")
    for field in layout.fields:
        # Readers rebuild samples from these: an unknown kind or an object dtype would fail later, mid-read.
        if field.kind not in KINDS or field.np_dtype.hasobject or any(d < 0 for d in field.shape):
            raise ValueError(f"field {field.name!r}: bad kind {field.kind!r}, dtype {field.dtype!r} or shape "
                             f"{field.shape}")
    leaves = _structure_leaves(meta["structure"])
    if sorted(leaves) != list(range(len(layout.fields))):
        raise ValueError(f"the structure's leaves {sorted(leaves)} do not match the {len(layout.fields)} fields")
    used = dict.fromkeys((META, FILLED, STALE, SEQ, LOCK, USERS), "a state file")
    if meta["slot_index"] is not None:
        if meta["slot_index"] != SLOT_INDEX:
            raise ValueError(f"slot_index names {meta['slot_index']!r}, expected {SLOT_INDEX!r}")
        used[SLOT_INDEX] = "the slot index"
    for field in meta["fields"]:
        for key in ("file", "shape_file"):
            name = field[key]
            if name is not None and (not isinstance(name, str) or "/" in name or name.startswith(".")):
                raise ValueError(f"field {field['name']!r}: bad file name {name!r}")
            if name is not None and name in used:
                # Two writers of one file would overwrite each other's rows: every file has one owner.
                raise ValueError(f"field {field['name']!r}: its {key} {name!r} is also {used[name]}")
            if name is not None:
                used[name] = f"the {key} of field {field['name']!r}"


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
