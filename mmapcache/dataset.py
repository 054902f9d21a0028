"""``MmapCachedDataset``: a map-style dataset that caches another one in a shared, file-backed store."""

from __future__ import annotations

import functools
import operator
import os
import warnings
import weakref
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from . import _admin, _create
from ._layout import Layout
from ._options import STALE_MODES, VARIANT_CHOICES, CreateOptions, check_bool, check_choice, \
    check_optional_str, mix, mix_array, source_length
from ._reader import RowReader
from ._create import parent_lock
from ._store import Store, resolve_path
from .errors import CacheMismatchError, CacheNotFoundError, CacheReadOnlyWarning, LayoutError, SampleNotCachedError

__all__ = ["MmapCachedDataset"]

_OPEN_ATTEMPTS = 3


class MmapCachedDataset(Dataset):
    """A map-style dataset whose samples are computed once and then read from a cache shared by every process.

    The first access of a sample calls ``dataset[i]`` and stores the result; every later access, in this or any
    other process that opens the same path, copies it out of a shared memory map (tmpfs, ``/dev/shm``). Samples
    are trees (tuple, list, dict, namedtuple) of tensors, numpy arrays and numbers; the layout is fixed by the
    first sample stored.

    Args:
        path: the cache directory. A path containing ``/`` is used as given; a bare name resolves to
            ``$MMAPCACHE_DIR/NAME``, default ``/dev/shm/mmapcache/NAME``.
        dataset: the source, a map-style dataset (``__len__`` and ``__getitem__``). None opens an existing cache
            without a source: filled samples are served, others raise ``SampleNotCachedError``.
        transform: applied to every sample after it leaves the cache (cheap random augmentation). Never cached.
        fingerprint: a string identifying the source (e.g. a hash of its file list and preprocessing config);
            opening a cache made with another fingerprint raises ``CacheMismatchError``.
        overwrite: replace an existing cache whose length, fingerprint, layout or options differ, instead of
            raising ``CacheMismatchError``. A matching cache is kept, so every rank may pass True.
        max_bytes: cache only as many samples as fit in this many bytes (an int or a size like ``"8G"``); the
            others pass straight through to the source on every access.
        cache_indices: which source indices may be cached (default: the first ones that fit).
        variants: K stored versions of each sample (the source is called once per version); ``set_epoch(e)``
            selects version ``e % K``. Default 1, or the existing cache's.
        variant_choice: ``"epoch"`` (version ``epoch % K`` for every sample) or ``"random"`` (a seeded per-sample
            choice per epoch).
        seed: seed of ``variant_choice="random"`` and of ``refresh(fraction=...)``.
        stale: what a reader does with a sample marked stale by ``refresh``: ``"recompute"`` it on access like a
            miss (default), or ``"serve"`` the previous version until a producer (``mmapcache build --follow``)
            replaces it.
        max_shapes: ``{field_path: max_shape}`` for fields whose shape varies between samples; each sample's
            actual shape is stored, and a hit returns exactly what was stored.
        delete_on_close: remove the cache when the last process using it closes it or exits.
        check_finite: refuse (ValueError, nothing stored) samples with NaN or infinite floating-point values.

    Pickling (DataLoader workers) carries the path, the source and the options, never the mapped data; each
    process maps the cache once, lazily. Reading is lock-free and safe in any number of processes and threads;
    filling takes a short per-cache lock.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        dataset: Any = None,
        *,
        transform: Callable[[Any], Any] | None = None,
        fingerprint: str | None = None,
        overwrite: bool = False,
        max_bytes: int | str | None = None,
        cache_indices: Sequence[int] | np.ndarray | None = None,
        variants: int | None = None,
        variant_choice: str = "epoch",
        seed: int = 0,
        stale: str = "recompute",
        max_shapes: Mapping[str, Sequence[int]] | None = None,
        delete_on_close: bool = False,
        check_finite: bool = False,
    ) -> None:
        self.path = resolve_path(path)
        self.dataset = dataset
        self.transform = transform
        self.fingerprint = check_optional_str(fingerprint, "fingerprint")
        self.stale = check_choice(stale, "stale", STALE_MODES)
        self.variant_choice = check_choice(variant_choice, "variant_choice", VARIANT_CHOICES)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} ({seed!r})")
        self.seed = int(seed)
        # A truthy string like "no" must not mean yes: overwrite=True replaces someone's cache.
        overwrite = check_bool(overwrite, "overwrite")
        self.delete_on_close = check_bool(delete_on_close, "delete_on_close")
        self.check_finite = check_bool(check_finite, "check_finite")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, got {type(transform).__name__}")
        self._epoch = 0
        self._reader: RowReader | None = None
        options = CreateOptions(max_bytes, cache_indices, variants, max_shapes)
        if dataset is not None:
            self._source_length = source_length(dataset)
        for attempt in range(_OPEN_ATTEMPTS):
            try:
                store = self._open_or_create(options, overwrite)
                try:
                    self._bind(store)
                except CacheNotFoundError:
                    store.close()
                    raise
                break
            except CacheNotFoundError:
                # Its last delete_on_close user removed it while we opened it: with a source, make a new one.
                if self.dataset is None or attempt == _OPEN_ATTEMPTS - 1:
                    raise

    # --- opening -----------------------------------------------------------------------------------------------

    def _open_or_create(self, options: CreateOptions, overwrite: bool) -> Store:
        """Opens the cache, or creates it with the sample computed to learn the layout already stored."""
        if os.path.exists(self.path) or self.dataset is None:
            store = Store(self.path)
            if self.dataset is None:
                return store
            probe = self._probe(options)
            problem = self._mismatch(store, options, probe)
            if problem is None:
                return store
            store.close()
            if not overwrite:
                raise CacheMismatchError(
                    f"the cache at {self.path} was made from a different source: {problem}. Pass overwrite=True to "
                    f"replace it, remove it (`mmapcache rm {self.path}`), or use another path"
                )
        else:
            probe = self._probe(options)
        layout, first_index, first_sample = probe
        slots, slot_index, variants = options.plan(layout, self._source_length)
        with parent_lock(self.path):
            _admin.sweep(os.path.dirname(self.path))
            if os.path.exists(self.path):  # another process created it (or it is the mismatched one)
                store = Store(self.path)
                problem = self._mismatch(store, options, probe)
                if problem is None:
                    store.attach()  # under the lock, for the same reason as below
                    return store
                store.close()
                if not overwrite:
                    raise CacheMismatchError(
                        f"the cache at {self.path}, just created by another process, was made from a different "
                        f"source: {problem}. Pass overwrite=True to replace it, or use another path"
                    )
                _admin.remove(self.path)
            _create.create(
                self.path, layout, length=self._source_length, slots=slots, variants=variants,
                slot_index=slot_index, fingerprint=self.fingerprint, delete_on_close=self.delete_on_close,
                library_version=_version(),
                prepare=functools.partial(self._store_first, first_index, first_sample),
            )
            # Attach before releasing the lock: a sweep by another creator would see an unused delete_on_close cache.
            store = Store(self.path)
            store.attach()
        return store

    def _store_first(self, index: int, sample: Any, directory: str) -> None:
        """Stores the layout probe in a cache still under its temporary name (see ``_create.create``)."""
        store = Store(directory, writable=True)
        try:
            reader = RowReader(store, recompute_stale=True)
            values = self._checked(index, sample, reader)
            # The probe's index is the first cacheable one, so it lives in slot 0; its variant is epoch 0's.
            k = store.variants
            row = 0 if k == 1 or self.variant_choice == "epoch" else mix(self.seed, 0, index) % k
            store.state.publish(row, lambda: reader.write(row, values))
        finally:
            store.close()

    def _probe(self, options: CreateOptions) -> tuple[Layout, int, Any]:
        """Computes one sample to learn (or check) the layout."""
        first = int(options.cache_indices[0]) if options.cache_indices is not None and len(options.cache_indices) else 0
        sample = self._fetch(first)
        try:
            return Layout.from_sample(sample, options.max_shapes), first, sample
        except LayoutError as exc:
            raise LayoutError(f"sample {first}: {exc}") from None

    def _mismatch(self, store: Store, options: CreateOptions, probe: tuple[Layout, int, Any]) -> str | None:
        meta = store.meta
        if meta["length"] != self._source_length:
            return f"length {meta['length']} in the cache, {self._source_length} in the dataset"
        if self.fingerprint is not None and meta["fingerprint"] != self.fingerprint:
            return f"fingerprint {meta['fingerprint']!r} in the cache, {self.fingerprint!r} given"
        if options.variants is not None and options.variants != meta["variants"]:
            return f"variants={meta['variants']} in the cache, variants={options.variants} given"
        layout, first, sample = probe
        if options.max_bytes is not None or options.cache_indices is not None:
            # Compare what the options decide (which indices are cacheable), not the numbers: any max_bytes at
            # least as large as the cache matches a cache that holds every sample.
            slots, index, _ = options.plan(layout, self._source_length, meta["variants"])
            wanted_index = np.arange(slots) if index is None else index
            have_index = np.arange(store.slots) if store.slot_index is None else store.slot_index
            if not np.array_equal(wanted_index, have_index):
                given = ", ".join(f"{name}={value}" for name, value in (
                    ("max_bytes", options.max_bytes),
                    ("cache_indices", None if options.cache_indices is None else f"<{len(options.cache_indices)} indices>"),
                ) if value is not None)
                return (f"{store.slots} cacheable samples ({'a chosen subset' if store.slot_index is not None else 'the first ones'}) "
                        f"in the cache, {slots} ({'a chosen subset' if index is not None else 'the first ones'}) "
                        f"with {given}; open it without max_bytes/cache_indices to use the recorded ones")
        wanted = {f.name: f.shape for f in layout.fields if f.variable}
        have = {f.name: f.shape for f in store.layout.fields if f.variable}
        if options.max_shapes is not None and wanted != have:
            return f"max_shapes {have or None} in the cache, {wanted} given"
        try:
            store.layout.check(sample, first)
        except LayoutError as exc:
            return f"the sample layout differs ({exc})"
        return None

    def _bind(self, store: Store) -> None:
        """Makes this process's view of an open store: the warm path's precomputed state."""
        self._store = store
        self._length = store.length
        if self.dataset is not None and self._source_length != store.length:
            raise CacheMismatchError(f"the cache at {self.path} has {store.length} samples, the dataset "
                                     f"{self._source_length}; pass overwrite=True or use another path")
        self._reader = RowReader(store, recompute_stale=self.stale == "recompute")
        self._lookup = store.slot_lookup()
        self._slots = store.slots
        self._variants = store.variants
        store.attach()
        # The cache's recorded lifetime applies to every user; an opener may also ask for removal of its own.
        delete = self.delete_on_close or bool(store.meta.get("delete_on_close"))
        self._finalizer = weakref.finalize(self, _close_store, store, delete)

    def _ensure_open(self) -> RowReader:
        """The reader of this process, opening the cache on first use (after unpickling in a worker)."""
        if self._reader is None:
            self._bind(Store(self.path))
        return self._reader  # type: ignore[return-value]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_store", "_reader", "_lookup", "_finalizer"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reader = None

    # --- the sequence protocol ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._length

    def _index(self, index: Any) -> int:
        if type(index) is not int:
            if isinstance(index, (float, np.floating)) or isinstance(index, bool):
                raise TypeError(f"cache indices must be integers, not {type(index).__name__} ({index!r})")
            try:
                index = operator.index(index)
            except TypeError:
                raise TypeError(f"cache indices must be integers, not {type(index).__name__}") from None
        n = self._length
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index if index >= 0 else index - n} is out of range for the cache at {self.path} "
                             f"of length {n}")
        return index

    def _row(self, index: int, epoch: int) -> int:
        """The row of a sample for an epoch, or -1 if the sample is not cacheable."""
        if self._lookup is None:
            slot = index if index < self._slots else -1
        else:
            slot = int(self._lookup[index])
        if slot < 0 or self._variants == 1:
            return slot
        if self.variant_choice == "epoch":
            return slot * self._variants + epoch % self._variants
        return slot * self._variants + mix(self.seed, epoch, index) % self._variants

    def __getitem__(self, index: int) -> Any:
        reader = self._reader  # kept across fork: the maps are shared, the lock reopens itself
        if reader is None:
            reader = self._ensure_open()
        i = self._index(index)
        row = self._row(i, self._epoch)
        sample = reader.read(row) if row >= 0 else None
        if sample is None:
            sample = self._miss(i, row)
        return self.transform(sample) if self.transform is not None else sample

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Fetches a batch: one gather per field (the protocol ``torch.utils.data`` uses when present)."""
        reader = self._ensure_open()
        idx = self._indices(indices)
        if reader.variable or len(idx) == 0:
            return [self[int(i)] for i in idx]
        samples = reader.samples(self._gather(idx, self._epoch))
        if self.transform is not None:
            samples = [self.transform(s) for s in samples]
        return samples

    def _indices(self, indices: Sequence[int]) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu" and not (idx.size == 0):
            raise TypeError(f"cache indices must be integers, got an array of {idx.dtype}")
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        n = self._length
        idx = np.where(idx < 0, idx + n, idx)
        bad = (idx < 0) | (idx >= n)
        if bad.any():
            raise IndexError(f"index {int(np.asarray(indices).reshape(-1)[np.argmax(bad)])} is out of range for the "
                             f"cache at {self.path} of length {n}")
        return idx

    def _slots_of(self, idx: np.ndarray) -> np.ndarray:
        if self._lookup is None:
            return np.where(idx < self._slots, idx, -1)
        return self._lookup[idx]

    def _rows(self, idx: np.ndarray, epoch: int) -> np.ndarray:
        slots = self._slots_of(idx)
        if self._variants == 1:
            return slots
        k = self._variants
        if self.variant_choice == "epoch":
            variant = np.full(len(idx), epoch % k, dtype=np.int64)
        else:
            variant = (mix_array(self.seed, epoch, idx) % np.uint64(k)).astype(np.int64)
        return np.where(slots >= 0, slots * k + variant, -1)

    def _gather(self, idx: np.ndarray, epoch: int, alloc: Callable[..., np.ndarray] = np.empty) -> list[np.ndarray]:
        """Per field, the batch of values of ``idx`` in request order; misses are computed and stored."""
        reader = self._ensure_open()
        rows = self._rows(idx, epoch)
        columns, missing = reader.gather(rows, alloc)
        computed: list[tuple[int, list[Any]]] = []
        try:
            for k in missing:
                index, row = int(idx[k]), int(rows[k])
                values = reader.read_values(row) if row >= 0 else None  # rewritten during the gather: read again
                if values is None:
                    if self.dataset is None:
                        self._miss(index, row)  # raises SampleNotCachedError
                    values = self._checked(index, self._fetch(index))
                    if row >= 0:
                        computed.append((row, values))
                for column, value in zip(columns, values):
                    column[k] = value
        finally:
            # One lock acquisition for the whole batch; samples computed before a failing one are kept.
            if computed:
                self._publish_rows(computed)
        return columns

    def _publish_rows(self, computed: list[tuple[int, list[Any]]]) -> None:
        if not self._store.writable:
            _warn_read_only(self.path)
            return
        reader = self._ensure_open()
        self._store.state.publish_many(
            [(row, functools.partial(reader.write, row, values)) for row, values in computed]
        )

    # --- misses ------------------------------------------------------------------------------------------------

    def _fetch(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:
            exc.add_note(f"mmapcache: raised by the source dataset computing sample {index} for the cache at {self.path}")
            raise

    def _miss(self, index: int, row: int) -> Any:
        """Computes a sample that is not readable from the cache, and stores it if it is cacheable."""
        if self.dataset is None:
            raise SampleNotCachedError(
                f"sample {index} is not in the cache at {self.path} (opened without a source dataset); fill it with "
                f"MmapCachedDataset(path, dataset) or `mmapcache build {self.path} --dataset SPEC`"
            )
        sample = self._fetch(index)
        if row >= 0:
            self._publish(index, row, sample)
        return sample

    def _checked(self, index: int, sample: Any, reader: RowReader | None = None) -> list[Any]:
        reader = reader or self._reader
        values = reader.check(sample, index)
        if self.check_finite:
            for field, value in zip(reader.fields, values):
                if np.asarray(value).dtype.kind in "fc" and not np.isfinite(value).all():
                    raise ValueError(f"sample {index}, field {field.name!r}: contains NaN or infinite values "
                                     "(check_finite=True); nothing was stored for it")
        return values

    def _publish(self, index: int, row: int, sample: Any) -> list[np.ndarray]:
        values = self._checked(index, sample)
        store = self._store
        if not store.writable:
            _warn_read_only(self.path)
            return values
        reader = self._ensure_open()
        store.state.publish(row, lambda: reader.write(row, values))
        return values

    # --- public API --------------------------------------------------------------------------------------------

    def is_cached(self, index: int) -> bool:
        """Whether sample ``index`` (for the current epoch's variant) is filled. Safe across processes."""
        reader = self._ensure_open()
        row = self._row(self._index(index), self._epoch)
        return row >= 0 and reader.state.is_filled(row)

    @property
    def num_cached(self) -> int:
        """Filled rows (samples times variants). Safe across processes; costs a scan of the bitmap."""
        return self._ensure_open().state.count_filled()

    @property
    def num_cacheable(self) -> int:
        """How many samples can be cached (all of them unless ``max_bytes``/``cache_indices`` limited it)."""
        return self._slots

    @property
    def variants(self) -> int:
        return self._variants

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Selects the variant served this epoch (``variants > 1``). Reaches DataLoader workers when they are
        started for the epoch (non-persistent workers) and always through ``ds.loader()``."""
        self._epoch = operator.index(epoch)

    def refresh(self, fraction: float | None = None, indices: Sequence[int] | None = None) -> int:
        """Marks filled samples stale so they are recomputed (on access, or by ``mmapcache build --follow``).

        Args:
            fraction: a random share of the filled rows to mark, in [0, 1] (seeded by ``seed`` and the epoch).
            indices: source indices to mark (all their variants).

        Returns the number of rows newly marked. Safe across processes; readers never see a half-rewritten sample.
        """
        reader = self._ensure_open()
        if (fraction is None) == (indices is None):
            raise TypeError("refresh() takes exactly one of fraction= or indices=")
        if indices is not None:
            slots = self._slots_of(self._indices(indices))
            slots = slots[slots >= 0]
            rows = (slots[:, None] * self._variants + np.arange(self._variants)).reshape(-1)
        else:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
                raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
            filled = np.flatnonzero(reader.state.filled_mask())
            # Seeded by (seed, epoch) only, as documented: every DDP rank calling it marks the same rows.
            rng = np.random.default_rng([self.seed, self._epoch])
            rows = rng.choice(filled, size=int(round(fraction * len(filled))), replace=False)
        return reader.state.mark_stale(rows)

    def fill(self, indices: Sequence[int] | None = None) -> int:
        """Computes and stores every not-yet-filled or stale sample among ``indices`` (default: all cacheable
        ones), in this process, for the current epoch's variant. Returns how many this call stored.

        Stale rows are rewritten too: with ``stale="serve"`` this is what replaces the previous version. Safe
        across processes (each row is published under the writer lock; readers never see a half-written row).
        """
        reader = self._ensure_open()
        idx = self._indices(range(self._length) if indices is None else indices)
        rows = self._rows(idx, self._epoch)
        keep = rows >= 0
        idx, rows = idx[keep], rows[keep]
        state = reader.state
        todo = ~state.filled_rows(rows) | state.stale_rows(rows) if len(rows) else np.zeros(0, bool)
        if self.dataset is None and todo.any():
            raise SampleNotCachedError(
                f"fill() needs the source dataset: {int(todo.sum())} sample(s) of the cache at {self.path} are unfilled "
                f"or stale (first: {int(idx[todo][0])}); open it with MmapCachedDataset(path, dataset)"
            )
        stored = 0
        for i, row in zip(idx[todo].tolist(), rows[todo].tolist()):
            if not state.is_filled(row) or state.stale[row >> 3] >> (row & 7) & 1:  # re-check: others fill too
                values = self._checked(i, self._fetch(i))
                stored += reader.state.publish(row, lambda: reader.write(row, values))
        return stored

    def prefill(self, *, rank: int | None = None, world_size: int | None = None, barrier: bool = True) -> int:
        """Fills the cache before training, cooperatively with the other processes (DDP ranks) of this node: each
        computes a disjoint share, then they wait for each other. See ``mmapcache.distributed.prefill``.

        Returns how many samples this process stored. Safe across processes.
        """
        from .distributed import prefill

        return prefill(self, rank=rank, world_size=world_size, barrier=barrier)

    def loader(self, **kwargs: Any) -> torch.utils.data.DataLoader:
        """A DataLoader over the cache that gathers each batch straight into its final tensors.

        Takes DataLoader's arguments with their usual meanings and yields what ``DataLoader(self, **kwargs)``
        with default collation yields. Falls back to exactly that when a ``collate_fn`` or ``transform`` is set,
        or a field has a variable shape (which default collation cannot stack).
        """
        from ._loader import make_loader

        return make_loader(self, **kwargs)

    def close(self) -> None:
        """Unmaps the cache in this process; with ``delete_on_close``, the last user removes it."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        self._reader = None

    def __enter__(self) -> MmapCachedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MmapCachedDataset({self.path!r}, length={self._length}, variants={self._variants})"


def _close_store(store: Store, delete_on_close: bool) -> None:
    """Detaches this process from the cache and unmaps it; with ``delete_on_close`` the last user removes it.

    Runs from ``close()``, garbage collection, or interpreter exit (``weakref.finalize``); a process killed
    outright detaches through the kernel (its locks vanish) and a later ``sweep`` removes what it left.
    """
    store.close()
    if delete_on_close and os.path.isdir(os.path.dirname(store.path)):
        # The parent lock orders this removal with creators and sweeps in the same directory.
        with parent_lock(store.path):
            store.detach(remove_if_last=True)
    else:
        store.detach()


_warned_read_only: set[str] = set()


def _warn_read_only(path: str) -> None:
    if path not in _warned_read_only:
        _warned_read_only.add(path)
        warnings.warn(
            f"the cache at {path} is read-only for this process (file permissions or a read-only mount): missing "
            "samples are computed from the source but not stored", CacheReadOnlyWarning, stacklevel=4,
        )


def _version() -> str:
    from . import __version__

    return __version__
