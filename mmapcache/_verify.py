"""``mmapcache verify``: checking a cache's files and state, and comparing stored samples with a fresh source.

Opening a ``Store`` already checks ``meta.json``, every ``.npy`` header and size, the state files' sizes, bits past
the end and filled rows never written, and refuses files that are links or not regular. This module first scans
the directory's entries (so a link or a foreign file is reported as damage, by name, rather than failing the open),
then adds the checks that need a scan of the state (stale bits without filled bits, stored shapes outside their
field's maximum) and the recomputation of filled samples.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from . import _format as fmt
from ._codec import differing_field
from ._files import check_entry
from ._paths import resolve_path
from ._rows import RowMap
from ._specs import DatasetSpec
from ._store import Store

__all__ = ["VerifyResult", "verify"]


@dataclasses.dataclass
class VerifyResult:
    """``problems``: damage found in the files; ``differences``: stored samples unequal to the source's;
    ``mismatch``: why the given source cannot be the cache's (another length: not damage, another source);
    ``compared``: rows compared with the source; ``interrupted``: rows a dead writer left mid-write (they count
    as unfilled and will be written again: not damage)."""

    path: str
    rows: int = 0
    filled: int = 0
    compared: int = 0
    interrupted: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    differences: list[str] = dataclasses.field(default_factory=list)
    mismatch: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems and not self.differences and self.mismatch is None


def verify(path: str | os.PathLike[str], dataset: Any = None, *, kwargs: dict[str, Any] | None = None,
           samples: int | None = 100, seed: int | None = None) -> VerifyResult:
    """Checks the cache at ``path``; with ``dataset``, recomputes filled samples and compares them byte for byte.
    Safe across processes: it registers as a user of the cache while it reads.

    Args:
        path: the cache directory (a bare name resolves under ``$MMAPCACHE_DIR``).
        dataset: the source (deterministic: a source with random augmentation always differs), or a spec string
            (``package.module:name``, ``path/to/file.py:name``) called with ``kwargs``.
        kwargs: keyword arguments for a spec string.
        samples: how many filled samples (source indices) to recompute, chosen at random; None: all of them.
        seed: seed of that choice (None: a fresh one).

    Raises:
        CacheNotFoundError, CacheFormatError: no cache, or damage found while opening it.
    """
    path = resolve_path(path)
    if isinstance(dataset, str):
        dataset = DatasetSpec(dataset, kwargs)()
    entries = _check_entries(path)
    if entries:
        return VerifyResult(path, problems=entries)
    store = Store(path, writable=False)
    result = VerifyResult(path, rows=store.rows)
    try:
        store.attach()  # a user while it reads: `mmapcache rm` without --force refuses to remove it meanwhile
        _check_state(store, result)
        if dataset is not None:
            if len(dataset) != store.length:
                result.mismatch = (f"the source has {len(dataset)} samples, the cache {store.length}: the cache was "
                                   "made from another source (or other --kwargs); nothing was compared")
            else:
                _compare(store, dataset, samples, seed, result)
    finally:
        store.close()
        store.detach()
    return result


def _check_entries(path: str) -> list[str]:
    """Every entry of the cache directory that is not one of its own regular files (a link, a directory...)."""
    try:
        device = os.stat(path).st_dev
        entries = list(os.scandir(path))
    except OSError:
        return []  # opening the store reports a missing or unreadable cache
    problems = []
    for entry in entries:
        problem = check_entry(entry.stat(follow_symlinks=False), device)
        if problem:
            problems.append(f"{entry.path} {problem}: mmapcache refuses to read or write through it")
    return problems


def _check_state(store: Store, result: VerifyResult) -> None:
    state = store.state
    filled_bit = state.filled_mask()
    odd = (state.seq_np & 1) == 1
    result.interrupted = int((filled_bit & odd).sum())
    result.filled = int((filled_bit & ~odd).sum())
    stray = state.stale_mask() & ~filled_bit
    if stray.any():
        rows = np.flatnonzero(stray)
        result.problems.append(f"{store.path}/{fmt.STALE}: {len(rows)} row(s) (first: {rows[0]}) are marked stale but "
                               "not filled, which no writer does: the file is damaged")
    complete = filled_bit & ~odd
    for field, shapes, spec in zip(store.layout.fields, store.shapes, store.meta["fields"]):
        if shapes is None:
            continue
        stored = shapes[complete]
        bad = (stored < 0).any(axis=1) | (stored > np.asarray(field.shape, dtype=np.int64)).any(axis=1)
        if bad.any():
            row = int(np.flatnonzero(complete)[np.argmax(bad)])
            result.problems.append(f"{store.path}/{spec['shape_file']}: row {row} holds shape "
                                   f"{tuple(shapes[row].tolist())}, "
                                   f"outside the maximum {field.shape} of field {field.name!r}: the file is damaged")


def _compare(store: Store, dataset: Any, samples: int | None, seed: int | None, result: VerifyResult) -> None:
    from ._reader import RowReader

    reader = RowReader(store, recompute_stale=False)
    rowmap = RowMap.of(store)
    k = store.variants
    filled = store.state.filled_rows(np.arange(store.rows, dtype=np.int64))
    slots = np.flatnonzero(filled.reshape(store.slots, k).any(axis=1)) if store.rows else np.zeros(0, np.int64)
    if samples is not None and samples < len(slots):
        slots = np.sort(np.random.default_rng(seed).choice(slots, size=samples, replace=False))
    set_epoch = getattr(dataset, "set_epoch", None) if k > 1 else None
    for slot, index in zip(slots.tolist(), rowmap.indices_of_slots(slots).tolist()):
        for variant in range(k):
            row = rowmap.row_at(slot, variant)
            if not filled[row]:
                continue
            stored = reader.read_values(row)
            if stored is None:
                continue  # being rewritten right now
            if set_epoch is not None:
                set_epoch(variant)
            try:
                fresh = reader.check(dataset[index], index)
            except Exception as exc:
                result.differences.append(f"sample {index}: the source raised {type(exc).__name__}: {exc}")
                continue
            result.compared += 1
            field = differing_field(store.layout, stored, fresh)
            if field is not None:
                where = f"sample {index}" + (f" variant {variant}" if k > 1 else "")
                result.differences.append(f"{where} (row {row}), field {field!r}: the stored value differs from the "
                                          "source's")
