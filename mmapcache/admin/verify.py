"""``mmapcache verify``: checking a cache's files and state, and comparing stored samples with a fresh source.

Opening a ``Store`` already checks ``meta.json``, every ``.npy`` header and size, the state files' sizes, bits past
the end and filled rows never written, and refuses files that are links or not regular. This module first scans
the directory's entries (so a link or a foreign file is reported as damage, by name, rather than failing the open),
then adds the checks that need a scan of the state (stale bits without filled bits, stored shapes outside their
field's maximum, keys that are not their slot's index, heap extents outside the heap or overlapping each other or
the free lists) and the recomputation of filled samples.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any

import numpy as np

from ..errors import CacheFormatError, LayoutError
from ..fill.specs import DatasetSpec
from ..format import spec as fmt
from ..format.codec import differing_field
from ..read.ragged import shapeable
from ..store.files import check_entry, read_meta
from ..store.paths import resolve_path
from ..store.ring import epoch_order
from ..store.rows import RowMap
from ..store.split import StreamSplit
from ..store.store import Store

__all__ = ["VerifyResult", "verify"]


@dataclasses.dataclass
class VerifyResult:
    """``problems``: damage found in the files; ``differences``: stored samples unequal to the source's, one line
    each, except samples whose layout the source changed (another shape or type: ``changed_layout``), one line per
    field that changed; ``differing``: how many samples differ, all told;
    ``mismatch``: why the given source cannot be the cache's (another length: not damage, another source);
    ``compared``: rows compared with the source; ``interrupted``: rows a dead writer left mid-write (they count
    as unfilled and will be written again: not damage); ``recounts``: counters a writer killed mid-change left off
    what they count, which the next writer recounts (not damage); ``uncomparable``: why a given source was not
    compared (a source recorded as not deterministic, a stream)."""

    path: str
    rows: int = 0
    filled: int = 0
    compared: int = 0
    interrupted: int = 0
    recounts: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    differences: list[str] = dataclasses.field(default_factory=list)
    mismatch: str | None = None
    uncomparable: str | None = None  # why samples were not compared with the given source (not a problem)
    changed_layout: bool = False
    differing: int = 0
    stream: bool = False  # the cache is a stream: its rows are computed afresh every lap

    @property
    def ok(self) -> bool:
        return not self.problems and not self.differences and self.mismatch is None


def verify(path: str | os.PathLike[str], dataset: Any = None, *, kwargs: dict[str, Any] | None = None,
           samples: int | None = 100, seed: int | None = None) -> VerifyResult:
    """Checks the cache at ``path``; with ``dataset``, recomputes filled samples and compares them byte for byte.
    Safe across processes: it registers as a user of the cache while it reads, and checks the state files, heaps and
    ring under the writer lock (writers running meanwhile wait for those checks, not for the comparison).

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
    if os.path.isdir(path) and not os.path.lexists(os.path.join(path, fmt.META)):
        read_meta(path)  # not a cache at all (no meta.json): the error says so, and is not damage
    try:
        store = Store(path, writable=False)
    except CacheFormatError as exc:  # damage found while opening: a finding, like the others
        return VerifyResult(path, problems=[str(exc)])
    result = VerifyResult(path, rows=store.rows, stream=store.meta["mode"] == "stream")
    try:
        store.attach()  # a user while it reads: `mmapcache rm` without --force refuses to remove it meanwhile
        # Under the writer lock: a writer running meanwhile (a producer, a build) moves rows, extents and free
        # lists while they are read, which looked like damage (overlapping extents, free lists off their counter).
        store.state.still(lambda: _check_state(store, result))
        if dataset is not None:
            if len(dataset) != store.length:
                result.mismatch = (f"the source has {len(dataset)} samples, the cache {store.length}: the cache was "
                                   "made from another source (or other --kwargs); nothing was compared")
            elif not store.meta["deterministic"]:
                result.uncomparable = "its source is recorded as not deterministic"
            else:
                _compare(store, dataset, samples, seed, result)
    except CacheFormatError as exc:
        result.problems.append(str(exc))
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
    _check_keys(store, complete, result)
    # What a writer takes as the row's own heap extents, to reuse or free (see SlotState.publish): every row written
    # whole, whether or not its filled bit still says so.
    _check_heaps(store, complete, state.owned_mask(), bool(state.changes[0] & 1), result)
    if store.meta["mode"] == "stream":
        _check_ring(store, result)
    share = RowMap.of(store).share
    if share is not None and store.slot_index is not None and not np.array_equal(
            store.slot_index, share.indices(store.length)):
        result.problems.append(f"{store.path}/{fmt.SLOT_INDEX}: not the indices of {share.describe(store.length)} "
                               "(generation 0) that meta.json records: the file is damaged")
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


def _check_keys(store: Store, complete: np.ndarray, result: VerifyResult) -> None:
    """A complete row's key must be the source index its slot holds; in a rotating share, some source index (which
    generation filled the row, only the key says); in a stream, a sequence number ``q`` of this row (``q % S``)."""
    rows = np.flatnonzero(complete)
    keys = store.state.keys_np[rows]
    rowmap = RowMap.of(store)
    if store.meta["mode"] == "stream":
        wrong = (keys < 0) | (keys % max(1, store.slots) != rows)
        expected = "a sequence number of this row (key % slots == row)"
    elif rowmap.keyed:
        wrong = (keys < 0) | (keys >= store.length)
        expected = f"a source index in [0, {store.length})"
    else:
        indices, _ = rowmap.index_and_variant(rows)
        wrong = keys != indices
        expected = "the index {} of their slot"
    if wrong.any():
        k = int(np.argmax(wrong))
        expected = expected.format(int(indices[k])) if "{}" in expected else expected
        result.problems.append(f"{store.path}/{fmt.KEYS}: {int(wrong.sum())} filled row(s) (first: {int(rows[k])}) "
                               f"hold the key {int(keys[k])}, not {expected}: the file is damaged")


def _check_ring(store: Store, result: VerifyResult) -> None:
    """A stream's ring (``ring.u64``): its size, and each reader's cursor consistent with its progress."""
    from ..store.ring import Ring

    ring = Ring(store)  # checks the file's size (CacheFormatError: reported by the caller)
    try:
        result.problems += [f"{store.path}/{fmt.RING}: {problem}: the file is damaged" for problem in ring.problems()]
    finally:
        ring.close()


def _check_heaps(store: Store, complete: np.ndarray, owned: np.ndarray, interrupted: bool,
                 result: VerifyResult) -> None:
    """Per ragged field: the heap's counters fit its file; every complete row's value lies in its extent, inside
    the heap's used part, with its field's fixed dimensions; the extents of the other rows a writer would reuse
    (``owned``: written whole, yet no longer marked filled) lie there too; no two rows' extents overlap; the free
    lists lie in the heap, hold extents of their size class, and as many bytes as their counter says, unless a
    writer died mid-change (``interrupted``: the cache-wide change counter is odd, and no writer holds the lock),
    which may have left the counter off its lists: the next writer recounts it (``SlotState``), and
    ``recounts`` says so."""
    from ..store.heap import END, FREE

    rows = np.flatnonzero(complete)
    kept = np.flatnonzero(owned & ~complete)
    for field, index, heap, spec in zip(store.layout.fields, store.index, store.heaps, store.meta["fields"]):
        if heap is None or index is None:
            continue
        try:
            heap.check_counters()
        except CacheFormatError as exc:
            result.problems.append(str(exc))
            continue
        counters = heap.counters
        where = f"{store.path}/{spec['index_file']}"
        end = int(counters[END])
        entries = index[rows]
        offsets, capacities, shapes = entries[:, 0], entries[:, 1], entries[:, 2:]
        # In float64: a damaged row must not overflow int64 into a plausible size.
        # (A field stored as ones keeps no bytes: its rows' extents are empty, at offset 0.)
        itemsize = field.value_itemsize
        align = max(itemsize, 1)
        nbytes = np.prod(shapes, axis=1, dtype=np.float64) * itemsize
        bad = (offsets < 0) | (capacities < 0) | (shapes < 0).any(axis=1) | (nbytes > capacities) | (
            offsets.astype(np.float64) + capacities > end) | (
            offsets % align != 0) | ~field.keeps_fixed(shapes) | ~shapeable(shapes, align)
        if field.ones:
            bad |= (offsets != 0) | (capacities != 0)
        if bad.any():
            k = int(np.argmax(bad))
            result.problems.append(f"{where}: row {int(rows[k])} holds [offset, extent, *shape] "
                                   f"{entries[k].tolist()}, not a value of field {field.name!r} inside the heap's "
                                   f"{end} used bytes: the file is damaged")
            continue
        # The other rows' extents, checked as a writer checks them before reusing or freeing them (rare: a row is
        # written whole yet not marked filled only after damage, or a writer killed between the two).
        held = index[kept, :2].tolist()
        wrong = _first_refused(heap, held, kept, align)
        if wrong is not None:
            result.problems.append(f"{where}: row {int(kept[wrong])} (not complete, its extent kept for its next "
                                   f"value) records the extent {held[wrong]}, not a part of the heap's {end} used "
                                   f"bytes at a multiple of {align}: the file is damaged")
            continue
        extents = sorted((int(a), int(n)) for a, n in itertools.chain(zip(offsets, capacities), held) if n)
        free, problem = heap.free_extents()
        if problem:
            result.problems.append(f"{store.path}/{spec['heap']}: {problem}: the file or {fmt.HEAPS} is damaged")
            continue
        overlap = [(a, b) for a, b in itertools.pairwise(sorted(extents + free)) if a[0] + a[1] > b[0]]
        if overlap:
            result.problems.append(f"{store.path}/{spec['heap']}: extents {overlap[0][0]} and {overlap[0][1]} "
                                   "(offset, bytes) overlap: two rows, or a row and a free list, share bytes; the "
                                   "file is damaged")
        elif sum(size for _, size in free) != int(counters[FREE]) and interrupted:
            result.recounts.append(f"field {field.name!r}'s free counter says {int(counters[FREE])} bytes, its free "
                                   f"lists hold {sum(size for _, size in free)}: a writer was killed between the "
                                   "two stores; the next writer recounts it")
        elif sum(size for _, size in free) != int(counters[FREE]):
            result.problems.append(f"{store.path}/{fmt.HEAPS}: field {field.name!r}'s free lists hold "
                                   f"{sum(size for _, size in free)} bytes, its counter says {int(counters[FREE])}: "
                                   "the file is damaged")


def _first_refused(heap: Any, extents: list[list[int]], rows: np.ndarray, align: int) -> int | None:
    """The position of the first ``[offset, capacity]`` of ``rows`` that ``Heap.check_extent`` refuses, or None."""
    for k, (offset, capacity) in enumerate(extents):
        try:
            heap.check_extent(offset, capacity, align, int(rows[k]))
        except CacheFormatError:
            return k
    return None


def _compare(store: Store, dataset: Any, samples: int | None, seed: int | None, result: VerifyResult) -> None:
    """Recomputes the samples of filled rows (``samples`` source indices chosen at random, all their variants; None:
    every one) and compares them byte for byte. A rotating share's row is compared with the sample its key names,
    a stream's with the sample at its key's position of the stream's order."""
    from ..read.reader import RowReader

    reader = RowReader(store, recompute_stale=False)
    rowmap = RowMap.of(store)
    k = store.variants
    rows = np.flatnonzero(store.state.filled_rows(np.arange(store.rows, dtype=np.int64)))
    variants = rows % k
    keys = np.full(len(rows), -1, np.int64)  # the key each row must still hold when it is read (-1: none)
    if rowmap.keyed:
        indices = store.state.keys_np[rows]
        keep = (indices >= 0) & (indices < store.length)  # others are reported by _check_keys
        rows, indices, variants = rows[keep], indices[keep], variants[keep]
        keys = indices
    elif store.meta["mode"] == "stream":  # a row holds the sample of its key's position in the stream's order
        keys = store.state.keys_np[rows]
        keep = (keys >= 0) & (keys % max(1, store.slots) == rows)  # others are reported by _check_keys
        rows, keys, variants = rows[keep], keys[keep], variants[keep]
        order_seed, n = store.meta["stream"]["seed"], store.length
        split = StreamSplit.from_json(store.meta["stream"].get("split"))
        m = max(1, split.positions(n))  # the node's positions per epoch (store.ring)
        orders = {e: epoch_order(order_seed, e, n) for e in np.unique(keys // m).tolist()}
        positions = split.position(keys % m)
        indices = np.array([orders[q // m][p % n] for q, p in zip(keys.tolist(), positions.tolist())], np.int64)
    else:
        indices = rowmap.index_and_variant(rows)[0]
    chosen = np.unique(indices)
    if samples is not None and samples < len(chosen):
        chosen = np.random.default_rng(seed).choice(chosen, size=samples, replace=False)
        keep = np.isin(indices, chosen)
        rows, indices, variants, keys = rows[keep], indices[keep], variants[keep], keys[keep]
    set_epoch = getattr(dataset, "set_epoch", None) if k > 1 else None
    changed: dict[tuple[str, str], list[int]] = {}  # (what the cache stores, what the source gives): samples
    for row, index, variant, key in zip(rows.tolist(), indices.tolist(), variants.tolist(), keys.tolist()):
        try:
            stored = reader.read_values(row, key)
        except CacheFormatError as exc:  # a value that cannot be read: reported, and the others compared
            result.problems.append(str(exc))
            continue
        if stored is None:
            continue  # being rewritten right now
        if set_epoch is not None:
            set_epoch(variant)
        try:
            sample = dataset[index]
            fresh = reader.check(sample, index)
        except LayoutError as exc:  # not this cache's layout: grouped by what differs, below
            result.compared += 1
            differences = list(store.layout.differences(sample))
            for stored_as, found in differences:
                changed.setdefault((stored_as, found), []).append(index)
            if not differences:  # the layout's own, but a value it cannot hold (store_as: one that does not fit)
                result.differences.append(str(exc))
            result.differing += 1
            continue
        except Exception as exc:
            result.differences.append(f"sample {index}: the source raised {type(exc).__name__}: {exc}")
            result.differing += 1
            continue
        result.compared += 1
        field = differing_field(store.layout, stored, fresh)
        if field is not None:
            where = f"sample {index}" + (f" variant {variant}" if k > 1 else "")
            result.differences.append(f"{where} (row {row}), field {field!r}: the stored value differs from the "
                                      "source's")
            result.differing += 1
    for (stored_as, found), samples_of in changed.items():
        more = len(samples_of) - 5
        shown = ", ".join(map(str, samples_of[:5])) + (f" and {more} more" if more > 0 else "")
        result.differences.append(f"the cache stores {stored_as}, the source gives {found} (samples {shown}): the "
                                  "source is not the one the cache was built from")
        result.changed_layout = True
