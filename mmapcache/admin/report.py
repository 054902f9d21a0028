"""What ``mmapcache inspect`` and ``mmapcache ls`` show: a cache's description, its fill map, cache listings.

Numpy only (``store.store``, ``format.spec``, ``store.state``, ``format.layout``): inspecting a cache never imports
torch.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import MmapCacheError
from ..format.sizes import format_size
from ..store.admin import users_of
from ..store.create import free_bytes
from ..store.files import is_cache
from ..store.paths import cache_root, resolve_path
from ..store.ring import MAX_RANKS, Ring, producers_of
from ..store.rows import RowMap
from ..store.share import Share
from ..store.store import Store

__all__ = ["describe", "fill_map", "disk_bytes", "list_caches"]

# Density ramp of the fill map: a cell's character says how full its range of indices is (empty ... full).
_RAMP = " .:-=+*#%@"
_CELLS = 64


def disk_bytes(path: str) -> int:
    """Bytes the files of a cache directory occupy (allocated blocks, not apparent sizes)."""
    total = 0
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def fill_map(length: int, indices: np.ndarray, shares: np.ndarray, cells: int = _CELLS) -> str:
    """One character per range of the ``length`` source indices, from ``_RAMP`` by the share of that range that is
    filled. ``indices`` are the indices the cache can hold (its slots'), ``shares`` the fraction of each one's rows
    (variants) that are filled. A cell holding none of ``indices`` is ``_``; otherwise an empty cell is ``' '``, a
    full one ``'@'``, and any filled row at all shows at least ``'.'``. Memory in the slots, never in ``length``."""
    if length == 0:
        return ""
    cells = min(cells, length)
    edges = np.linspace(0, length, cells + 1).astype(np.int64)
    cell = np.searchsorted(edges, indices, side="right") - 1
    counts = np.bincount(cell, minlength=cells)
    sums = np.bincount(cell, weights=shares, minlength=cells)
    out = []
    for count, total in zip(counts.tolist(), sums.tolist()):
        if count == 0:
            out.append("_")
            continue
        share = total / count
        if share <= 0:
            out.append(_RAMP[0])
        elif share >= 1:
            out.append(_RAMP[-1])
        else:
            out.append(_RAMP[1 + int(share * (len(_RAMP) - 2))])
    return "".join(out)


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything ``mmapcache inspect`` reports about the cache at ``path`` (a bare name resolves under
    ``$MMAPCACHE_DIR``), as a JSON-able dict. Opened read-only, not registered as a user. Safe across processes.

    Raises:
        CacheNotFoundError, CacheFormatError: no cache there, or a damaged one.
    """
    path = resolve_path(path)
    store = Store(path, writable=False)
    try:
        meta, state = store.meta, store.state
        rows = np.arange(store.rows, dtype=np.int64)
        filled = state.filled_rows(rows) if store.rows else np.zeros(0, bool)
        stale = state.stale_rows(rows) & filled if store.rows else np.zeros(0, bool)
        rowmap = RowMap.of(store) if store.rows and meta["mode"] == "cache" else None
        held_rows = np.flatnonzero(filled)
        if rowmap is not None and rowmap.keyed and np.any(
                state.keys_np[held_rows] != rowmap.index_and_variant(held_rows)[0]):
            # A rotating share whose rows hold a later generation's samples (each row's key names its sample). The
            # map shows the indices the filled rows hold; which generation is being filled, and so its indices not
            # yet filled, are not the files' to say (`_` there).
            keys = state.keys_np[held_rows]
            keys = keys[(keys >= 0) & (keys < store.length)]
            held, counts = np.unique(keys, return_counts=True)
            mapped = fill_map(store.length, held, counts / store.variants)
        elif rowmap is not None:  # a stream's rows hold positions, not indices: no fill map
            shares = filled.reshape(store.slots, store.variants).mean(axis=1)
            mapped = fill_map(store.length, rowmap.cacheable(), shares)
        else:
            mapped = fill_map(store.length, np.zeros(0, np.int64), np.zeros(0))
        fields: list[dict[str, Any]] = []
        ragged_number = 0
        for field, spec in zip(store.layout.fields, meta["fields"]):
            entry: dict[str, Any] = {
                "name": field.name, "kind": field.kind, "dtype": field.torch_dtype or np.dtype(field.dtype).name,
                "shape": list(field.shape), "variable": field.variable, "ragged": field.ragged,
                "file": spec["file"] or spec["heap"], "heap": None,
            }
            if field.ragged:
                entry["heap"] = _heap_report(store.heap_counters[ragged_number])
                ragged_number += 1
                # How the values are stored (store_as) and how many elements (tokens) the filled rows hold.
                entry["stored"] = "ones" if field.ones else field.storage_dtype.name if field.stored else None
                index = store.index[len(fields)]
                shapes = index[held_rows, 2:] if index is not None else np.zeros((0, 1), np.int64)
                entry["elements"] = int(np.prod(np.maximum(shapes, 0), axis=1).sum())
            fields.append(entry)
        n_filled = int(filled.sum())
        return {
            "path": path,
            "format_version": meta["format_version"],
            "library_version": meta.get("library_version"),
            "length": store.length,
            "slots": store.slots,
            "slot_fraction": store.slots / store.length if store.length else 0.0,
            "variants": store.variants,
            "rows": store.rows,
            "filled": n_filled,
            "fraction": n_filled / store.rows if store.rows else 0.0,
            "stale": int(stale.sum()),
            "bytes": disk_bytes(path),
            "free_bytes": free_bytes(path),
            "size": format_size(disk_bytes(path)),
            "free": format_size(free_bytes(path)),
            "fingerprint": meta["fingerprint"],
            "share": None if meta["share"] is None else {
                **meta["share"], "size": Share.from_json(meta["share"]).size(store.length),
                "text": Share.from_json(meta["share"]).describe(store.length)},
            "mode": meta["mode"],
            "stream": _stream_report(store) if meta["mode"] == "stream" else None,
            "delete_on_close": bool(meta.get("delete_on_close")),
            "created": meta.get("created"),
            "fields": fields,
            "users": users_of(path),
            "fill_map": mapped,
        }
    finally:
        store.close()


def _stream_report(store: Store) -> dict[str, Any]:
    """A stream's ring (``store.ring``): its seed and size, the counters, what is ready ahead, the producers."""
    ring = Ring(store)
    try:
        stats: dict[str, Any] = ring.stats()
        cursors = {rank: ring.progress(rank) for rank in range(MAX_RANKS)}
    finally:
        ring.close()
    stats.update(seed=ring.seed, slots=ring.slots, producers=producers_of(store.path),
                 readers={rank: list(p) for rank, p in cursors.items() if p is not None},
                 split=ring.split.to_json(), split_text=ring.split.describe(store.length))
    stats["waited"] = stats.pop("waited_ns") / 1e9
    return stats


def _heap_report(counters: np.ndarray) -> dict[str, Any]:
    """A ragged field's heap counters (see ``store.heap``): bytes used (values and their rows' slack), free for reuse,
    abandoned, reserved on the file system, and how many times a sample passed through uncached for lack of room
    (every access counts, not distinct samples)."""
    end, capacity, abandoned, uncached, free = (int(x) for x in counters[:5])
    used = end - free - abandoned
    text = (f"{format_size(used)} used, {format_size(free)} free for reuse, {format_size(abandoned)} abandoned, "
            f"{format_size(capacity)} reserved")
    if uncached:
        text += f"; no room for a value {uncached} times (every access counts): served uncached"
    return {"used": used, "free": free, "abandoned": abandoned, "end": end, "reserved": capacity,
            "uncached": uncached, "text": text}


def list_caches(directory: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """One entry per cache directly under ``directory`` (default ``$MMAPCACHE_DIR``), sorted by name; damaged
    caches carry ``error``. Safe across processes."""
    directory = os.path.realpath(os.fspath(directory) if directory is not None else cache_root())
    if not os.path.isdir(directory):
        return []
    entries = []
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if name.startswith(".") or os.path.islink(full) or not is_cache(full):
            continue
        entry: dict[str, Any] = {"name": name, "path": full, "users": users_of(full)}
        try:
            store = Store(full, writable=False)
        except (MmapCacheError, OSError) as exc:
            entry["error"] = str(exc)
            entry["bytes"] = disk_bytes(full)
            entry["size"] = format_size(entry["bytes"])
            entries.append(entry)
            continue
        try:
            filled = store.state.count_filled()
            entry.update(length=store.length, variants=store.variants, rows=store.rows, filled=filled,
                         fraction=filled / store.rows if store.rows else 0.0, bytes=disk_bytes(full),
                         cacheable=store.slots / store.length if store.length else 0.0, mode=store.meta["mode"],
                         slots=store.slots)
            entry["size"] = format_size(entry["bytes"])
        finally:
            store.close()
        entries.append(entry)
    return entries
