"""Opening a cache, or creating it: the one protocol behind ``MmapCachedDataset`` and ``build``.

An opener with a source either finds a cache at the path and checks that it was made from the same source, or
creates one. The checks, cheapest first:

1. recorded facts: length, fingerprint, variants, the cacheable indices (``max_bytes``/``cache_indices``) and the
   declared ``max_shapes``;
2. stored samples, when the opener gives no fingerprint: the source computes again the cache's first sample and
   up to ``_COMPARED`` other stored ones, chosen at random on every open, and their layout and bytes must equal
   the stored copies (a changed source without a fingerprint would otherwise be served stale). A fingerprint that
   matches is trusted instead, so a warm rerun with a fingerprint calls the source 0 times. Sources declared
   non-deterministic, when the cache was created (recorded in ``meta.json``) or by this opener, and caches of
   several variants (a random source by design), are checked for layout only; a fingerprinted cache then needs
   the fingerprint.

Creation happens under the parent directory's lock (``store.create.parent_lock``): the first opener computes the
first sample (and the layout probes) there, stores them in the cache under its temporary name, and renames the
cache into place (``fill.create``); openers racing it wait for the lock and then find the cache, so only one process
computes those samples.

A process that reopens a cache it used before (a DataLoader worker, a reopen after ``close``) passes the
``identity`` it saw; a cache replaced meanwhile by one of another source is then refused, never served.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from ..errors import CacheMismatchError, CacheNotFoundError, LayoutError
from ..format.codec import differing_field, float_drift
from ..format.layout import Layout
from ..read.reader import RowReader
from ..store import admin as _admin
from ..store import create as _create
from ..store.create import plan_bytes
from ..store.rows import RowMap
from ..store.share import Share
from ..store.split import StreamSplit
from ..store.store import Store
from .create import Request, Source, create_locked
from .options import CreateOptions

__all__ = ["open_cache", "identity"]

_ATTEMPTS = 3  # a delete_on_close cache removed by its last user while we open it: opened anew, under the lock


def identity(store: Store) -> dict[str, Any]:
    """What makes two caches interchangeable for a reader: the source's facts and the sample layout (not the
    creation time: a cache removed and built again from the same source serves the same samples)."""
    meta = store.meta
    ident = {key: meta[key] for key in ("length", "slots", "variants", "fingerprint", "structure")}
    files = ("file", "shape_file", "heap", "index_file")
    ident["fields"] = [{k: v for k, v in f.items() if k not in files} for f in meta["fields"]]
    ident["slot_index"] = None if store.slot_index is None else \
        hashlib.sha256(np.ascontiguousarray(store.slot_index).tobytes()).hexdigest()
    return ident


def open_cache(request: Request, source: Source | None, *,
               expected: dict[str, Any] | None = None) -> tuple[Store, bool]:
    """Opens (or, with a source, creates) the cache ``request.path``; returns it registered as used, and whether
    this call created it (and stored its first sample).

    Args:
        request: the path and the options.
        source: the source dataset, or None to open an existing cache read-only for misses.
        expected: the ``identity`` this process saw before (a reopen); a cache that differs raises
            ``CacheMismatchError``. An existing cache is then compared with it alone: the source was checked
            when the cache was first opened, so a reopening worker never computes a sample to check it.

    Raises:
        CacheNotFoundError: no cache and no source.
        CacheMismatchError: the cache was made from another source (and ``overwrite`` is off), or differs
            from ``expected``.
        LayoutError: the source's first sample cannot be stored.
    """
    for attempt in range(_ATTEMPTS):
        try:
            # After a lost race (the last user removed the cache between our opening and attaching), the next try
            # opens under the parent directory's lock, which removers hold: it cannot lose again.
            store, created = _open_or_create(request, None if expected is not None and os.path.exists(request.path)
                                             else source, locked=attempt > 0)
            try:
                if expected is not None and identity(store) != expected:
                    raise CacheMismatchError(_replaced_message(request.path, expected, identity(store)))
                store.attach()
            except BaseException:
                store.close()
                raise
            return store, created
        except CacheNotFoundError:
            if source is None or attempt == _ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")  # the loop returns or raises


def _open_or_create(request: Request, source: Source | None, locked: bool = False) -> tuple[Store, bool]:
    """The cache at ``request.path`` opened, or created from ``source``; with ``locked``, an existing one is opened
    and attached under the parent directory's lock too (not only a creation)."""
    path = request.path
    if source is None or (os.path.exists(path) and not locked):
        store = Store(path)
        if source is None:
            return store, False
        problem = _mismatch(store, request, source) or _replaced_option(store, request, source)
        if problem is None:
            return store, False
        store.close()
        if not request.overwrite:
            raise CacheMismatchError(_mismatch_message(path, problem))
    with _create.parent_lock(path):
        _admin.sweep(os.path.dirname(path))
        if os.path.exists(path):  # another process created it meanwhile (or it is the mismatched one)
            store = Store(path)
            problem = _mismatch(store, request, source) or _replaced_option(store, request, source)
            if problem is None:
                store.attach()  # under the lock: a sweep by another creator must see it used
                return store, False
            store.close()
            if not request.overwrite:
                raise CacheMismatchError(_mismatch_message(path, problem, just_created=True))
            _admin.delete(path)
        create_locked(request, source)
        store = Store(path)
        store.attach()
    return store, True


# --- is it the same source? -------------------------------------------------------------------------------------


def _replaced_option(store: Store, request: Request, source: Source) -> str | None:
    """With ``overwrite``, a recorded option the opener declares otherwise, which ``_mismatch`` lets pass (a source
    declared random reads a cache made as deterministic, taking its stored samples): the opener asked for a cache
    made with its options. (A source changed to augment at random, opened with ``deterministic=False,
    overwrite=True``, was served the stored samples of the old source, never augmented.)"""
    if request.overwrite and store.meta["deterministic"] != source.deterministic:
        return (f"deterministic={store.meta['deterministic']} in the cache, deterministic={source.deterministic} "
                "given")
    return None


def _mismatch(store: Store, request: Request, source: Source) -> str | None:
    """Why the cache at ``store`` cannot serve ``source``, or None."""
    meta, options = store.meta, request.options
    if meta["length"] != source.length:
        return f"length {meta['length']} in the cache, {source.length} in the dataset"
    if (meta["mode"] == "stream") != options.stream:
        return (f"a {meta['mode']} in the cache, a {'stream' if options.stream else 'cache'} asked for "
                f"(stream={options.stream})")
    if options.stream and meta["stream"]["seed"] != request.seed:
        return f"a stream of seed {meta['stream']['seed']} in the cache, seed={request.seed} given"
    if options.split is not None and meta["stream"].get("split") != options.split.to_json():
        # (A process outside a job of several nodes asks for no split: a producer, a script, the command line.)
        made = StreamSplit.from_json(meta["stream"].get("split"))
        return (f"a stream of {made.describe(meta['length'])} in the cache, but this process is "
                f"{options.split.describe(meta['length'])}: a stream keeps the shape of the job that made it; give "
                f"this job a new path (or `mmapcache rm` the old one)")
    if request.fingerprint is not None and meta["fingerprint"] != request.fingerprint:
        hint = "" if meta["fingerprint"] is not None else (
            " (it was made without one, by `mmapcache build` without --fingerprint or by code without fingerprint=: "
            "make it with this one, or open it without fingerprint=)")
        return f"fingerprint {meta['fingerprint']!r} in the cache, {request.fingerprint!r} given{hint}"
    if options.variants is not None and options.variants != meta["variants"]:
        return f"variants={meta['variants']} in the cache, variants={options.variants} given"
    if options.share is not None:
        if meta["share"] != options.share.to_json():
            recorded = "no node share (a full copy)" if meta["share"] is None else \
                f"the share {Share.from_json(meta['share']).describe(meta['length'])}"
            return (f"{recorded} in the cache, the share {options.share.describe(source.length)} asked for (another "
                    "node count, node rank, seed or rotation); each node's cache must be made for its own node: "
                    "use a node-local MMAPCACHE_DIR, or remove this cache to make it anew")
    elif meta["share"] is not None and options.cache_indices is not None:
        return "a node share in the cache, cache_indices given"
    if meta["share"] is None and (options.max_bytes is not None or options.cache_indices is not None) and not (
            _same_max_bytes(store, options)):
        # Compare what the options decide (which indices are cacheable), not the numbers: any max_bytes at least
        # as large as the cache matches a cache that holds every sample.
        slots, index, _ = options.plan(store.layout, source.length, meta["variants"])
        wanted = np.arange(slots) if index is None else index
        have = np.arange(store.slots) if store.slot_index is None else store.slot_index
        if not np.array_equal(wanted, have) and meta["mode"] == "stream":
            return (f"a ring of {store.slots} slots in the stream, {slots} with max_bytes={options.max_bytes}; open "
                    "it without max_bytes to use the recorded ring")
        if not np.array_equal(wanted, have):
            given = ", ".join(f"{name}={value}" for name, value in (
                ("max_bytes", options.max_bytes),
                ("cache_indices", None if options.cache_indices is None else f"<{len(options.cache_indices)} indices>"),
            ) if value is not None)
            which = "a chosen subset" if store.slot_index is not None else "the first ones"
            return (f"{store.slots} cacheable samples ({which}) in the cache, {slots} "
                    f"({'a chosen subset' if index is not None else 'the first ones'}) with {given}; open it without "
                    "max_bytes/cache_indices to use the recorded ones")
    if options.ragged is not None and options.ragged != "auto":
        stored_fixed = sorted(set(options.ragged) - {f.name for f in store.layout.ragged})
        if stored_fixed:
            return (f"field(s) {stored_fixed} are stored with a fixed shape in the cache, "
                    f"ragged={list(options.ragged)} given")
    if options.max_shapes is not None:
        have_shapes = {f.name: f.shape for f in store.layout.fields if f.variable}
        if have_shapes != options.max_shapes:
            return f"max_shapes {have_shapes or None} in the cache, {options.max_shapes} given"
    if options.store_as is not None:
        have_narrowed = narrowed_fields(store.layout)
        if have_narrowed != _normal(options.store_as):
            return (f"store_as {have_narrowed or None} in the cache, {options.store_as} given (read it without "
                    "store_as, or give the cache's)")
    if request.fingerprint is not None:
        return None  # a matching fingerprint identifies the source: no need to compute a sample
    return _sample_mismatch(store, request, source)


def narrowed_fields(layout: Layout) -> dict[str, str]:
    """The ``store_as`` a cache was made with: its narrowed fields' stored dtype names, or ``"ones"``."""
    return {f.name: "ones" if f.ones else f.storage_dtype.name for f in layout.fields if f.stored or f.ones}


def _normal(store_as: dict[str, str]) -> dict[str, str]:
    out = {}
    for name, how in store_as.items():
        try:
            out[name] = how if how == "ones" else np.dtype(how).name
        except TypeError:
            out[name] = how
    return out


def _same_max_bytes(store: Store, options: CreateOptions) -> bool:
    """Whether ``options.max_bytes`` (and ``cache_indices``) are the ones the cache was created with, for a cache with
    ragged fields: its slots were planned from the creator's probes (the bytes their ragged values take), which an
    opener cannot plan again, but the heap budget it recorded is what ``max_bytes`` left after the fixed rows."""
    budget, chosen = store.meta["heap_budget"], options.cache_indices
    if budget is None or options.max_bytes is None or (chosen is None) != (store.slot_index is None):
        return False
    if chosen is not None and store.slot_index is not None and not np.array_equal(store.slot_index,
                                                                                  chosen[:store.slots]):
        return False  # cache_indices with max_bytes: the first of them that fitted
    fixed = plan_bytes(store.layout, store.rows, store.slots if store.slot_index is not None else 0)
    return options.max_bytes == budget + fixed


# Without a fingerprint, an opener computes again the cache's first sample and this many more stored ones, chosen
# afresh at random on every open (a source changed on only some samples is caught by some opener, not by all).
_COMPARED = 3


def _sample_mismatch(store: Store, request: Request, source: Source) -> str | None:
    """Why ``source`` is not the source of ``store``'s samples, comparing recomputed samples with stored ones (see
    the module docstring), or None."""
    rows = RowMap.of(store, variant_choice=request.variant_choice, seed=request.seed)
    first = int(rows.cacheable()[0]) if rows.slots else 0
    reader = RowReader(store, recompute_stale=True)

    def computed(index: int) -> list[Any] | str:
        """Sample ``index`` computed now, or why its layout differs from the recorded one."""
        try:
            return source.values(reader, source.fetch(index), index)
        except LayoutError as exc:  # (the reader's check raises CacheFormatError where meta.json is wrong)
            return f"the sample layout differs ({exc})"

    fresh = computed(first)
    if isinstance(fresh, str):
        return fresh
    recorded = store.meta["deterministic"]
    if not (source.deterministic and recorded and store.variants == 1 and store.meta["mode"] == "cache"):
        if meta_fingerprint := store.meta["fingerprint"]:
            why = "declared non-deterministic" if not (source.deterministic and recorded) else \
                "several variants" if store.variants > 1 else "a stream keeps no sample for good"
            return (f"fingerprint {meta_fingerprint!r} in the cache, none given, and the source cannot be compared "
                    f"sample by sample ({why}); pass fingerprint={meta_fingerprint!r}")
        return None
    compared = [(first, rows.row(first, 0))] if rows.slots else []
    for index, row in compared + _stored_rows(store, rows, first):
        if index != first:
            fresh = computed(index)
            if isinstance(fresh, str):
                return fresh
        # A row being rewritten, or holding another generation's sample (a rotating share): nothing to compare.
        stored = reader.read_values(row, index if rows.keyed else -1) if row >= 0 else None
        if stored is None:
            continue
        field = differing_field(store.layout, stored, fresh)
        if field is not None:
            drift = float_drift(store.layout, stored, fresh)
            if drift is not None:
                return (f"sample {index} computed now differs from the stored copy in field {field!r} only in its "
                        f"last bits (relative difference {drift:.1g}): a float pipeline whose result depends on the "
                        "number of threads (DataLoader workers run torch with 1, the main process with every core) "
                        "or on the hardware computes it slightly differently in each. Give the source a "
                        "fingerprint= (then samples are not compared), or compute it alike everywhere "
                        "(torch.set_num_threads(1) before the dataset is opened)")
            return (f"sample {index} computed now differs from the stored copy in field {field!r} (a changed source, "
                    "or one that is not deterministic); give the source a fingerprint= that changes with it, or "
                    "declare a random source with deterministic=False")
    return None


def _stored_rows(store: Store, rows: RowMap, first: int) -> list[tuple[int, int]]:
    """Up to ``_COMPARED`` ``(source index, row)`` of stored samples other than ``first``, chosen at random."""
    state = store.state
    complete = np.flatnonzero(state.filled_mask() & ~state.stale_mask())
    # A rotating share's row holds the sample its key names, of whichever generation filled it.
    indices = state.keys_np[complete] if rows.keyed else rows.index_and_variant(complete)[0]
    keep = (indices != first) & (indices >= 0) & (indices < store.length)
    complete, indices = complete[keep], indices[keep]
    if len(complete) > _COMPARED:
        chosen = np.random.default_rng().choice(len(complete), _COMPARED, replace=False)
        complete, indices = complete[chosen], indices[chosen]
    return list(zip(indices.tolist(), complete.tolist()))


def _mismatch_message(path: str, problem: str, just_created: bool = False) -> str:
    when = ", just created by another process," if just_created else ""
    return (f"the cache at {path}{when} was made from a different source or with other options: {problem}. Replace "
            f"it (overwrite=True in Python; on the command line `mmapcache rm {path}`, then build again), or use "
            "another path")


def _replaced_message(path: str, expected: dict[str, Any], found: dict[str, Any]) -> str:
    key = next(k for k in expected if expected[k] != found.get(k))
    if key in ("length", "slots", "variants", "fingerprint"):
        detail = f"{key} {expected[key]!r} before, {found.get(key)!r} now"
    else:
        detail = f"its {key} differ"
    return (f"the cache at {path} was replaced by one of another source since this dataset opened it ({detail}); "
            "this process refuses to serve it. Open the dataset again (with overwrite=True to replace it back), or "
            "use separate paths for separate sources")
