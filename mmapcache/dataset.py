"""``MmapCachedDataset``: a map-style dataset that caches another one in a shared, file-backed store."""

from __future__ import annotations

import dataclasses
import operator
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .fill.contents import CacheContents
from .fill.create import Request, Source
from .fill.misses import Misses, checker, fetcher
from .fill.open import identity, open_cache
from .fill.options import (
    ON_MISS,
    STALE_MODES,
    CreateOptions,
    check_bool,
    check_choice,
    check_optional_str,
    source_length,
)
from .fill.stream import StreamControls
from .read.gather import column_alloc
from .read.loader import make_loader
from .read.ragged import mark_ragged
from .read.reader import RowReader
from .read.sampler import ShareSampler
from .read.stream import StreamReads, warn_bypass
from .store.admin import close_store
from .store.paths import resolve_path
from .store.ring import Ring
from .store.rows import VARIANT_CHOICES, RowMap, check_index, check_indices
from .store.share import Share, share_option
from .store.split import StreamSplit, stream_split_option
from .store.store import Store

__all__ = ["MmapCachedDataset"]


class MmapCachedDataset(CacheContents, StreamControls, Dataset):
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
            raising ``CacheMismatchError``; with it, a cache recorded with another ``deterministic`` is replaced too
            (without it, a source declared random reads a deterministic one's stored samples). A matching cache is
            kept, so every rank may pass True.
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
        ragged: which fields are stored packed at each value's own size (token ids, boxes, audio). ``"auto"``
            (default): when the first sample has an array field, the creator also computes (and stores) 8 samples
            spread over the dataset, and every field whose shape differs among them is ragged, so a varying shape
            needs no option. A list of field paths: those fields, and no probing. None: no probing, every field
            keeps the first sample's shape. ``str``/``bytes`` fields and 1-D lists of numbers are always ragged.
            A field that kept a shape and meets another later is a ``LayoutError`` naming the fix.
        max_shapes: ``{field_path: max_shape}`` for varying fields stored instead in fixed rows of the maximum
            shape (each sample's actual shape is stored beside it, and a hit returns exactly what was stored).
        store_as: ``{field_path: dtype}`` for ragged fields whose values fit a narrower type than the source's
            (token ids of a vocabulary under 2**31 in ``"int32"``, under 65,536 in ``"uint16"``), stored so and
            returned in the source's dtype; ``"ones"`` for a field whose values are all ones (an attention mask
            without padding), of which only the shapes are stored. Every value is checked as it is stored: one
            that does not fit (or a mask with a zero) raises ``LayoutError`` naming the field, the value and the
            fix, never a wrapped or rounded value. The fields named are ragged. Recorded in the cache (format 3);
            an opener without ``store_as`` reads the cache as it was made, and ``store_as={}`` asks for no field
            narrowed (with ``overwrite=True``, a narrowed cache is made anew plain).
        node_share: cache only this node's share of the dataset (multi-node jobs whose dataset is larger than one
            node's memory): ``True`` finds the node and node count from torchrun, SLURM or an initialised process
            group; ``(node, nodes)`` gives them. Every node computes the same seeded partition into ``nodes``
            near-equal parts (seeded by ``seed``) and caches its own; read with ``ds.sampler()``, whose ranks
            read only their node's share. Recorded in the cache: reopening with another node or node count is a
            ``CacheMismatchError``.
        rotate_every: with ``node_share``, draw the partition again every this many epochs (``set_epoch``), so
            each node sees other samples over a long run; each rotation refills the share from the source.
        stream: a *stream* instead of a cache (fresh augmentation every epoch on a dataset larger than memory):
            the cache is a ring of ``max_bytes`` (default: 4096 samples) holding the next positions of each
            epoch's seeded order (``seed``), filled ahead of the trainer by producers (``ds.produce()``, or
            ``mmapcache build PATH --dataset SPEC --follow``) and read once each through ``ds.loader()``. See the
            README's "Fresh samples every epoch".
        on_miss: in a stream, what ``ds.loader`` does with a position no producer has filled yet: ``"compute"`` it
            (default: never slower than no cache), or ``"wait"`` for a producer (up to ``wait_timeout`` seconds,
            then ``StreamTimeoutError`` naming the producers).
        wait_timeout: see ``on_miss``.
        delete_on_close: remove the cache when the last process using it closes it or exits.
        check_finite: refuse (ValueError, nothing stored) samples with NaN or infinite floating-point values.
            A check of what this process computes and stores: rows another process stored are read as they
            are (fill such a cache with ``build(check_finite=True)`` or ``--check-finite`` too).
        deterministic: whether the source returns the same sample for the same index every time (default True;
            recorded when this opener creates the cache). An opener without a fingerprint recomputes the cache's
            first sample and 3 other stored ones (chosen at random on each open) and compares them byte for byte
            with the stored copies, so a changed source is refused instead of served stale; declare a source with
            random augmentation ``deterministic=False`` (then only its layout is compared, by every later opener
            too), or give a fingerprint.

    Attributes:
        path: the resolved cache directory.
        created: whether this object created the cache (it then computed and stored the first sample).

    Pickling (DataLoader workers) carries the path, the source and the options, never the mapped data; each
    process maps the cache once, lazily, and refuses a cache replaced meanwhile by one of another source
    (``CacheMismatchError``). A process that opens the path after the cache was removed (a spawned worker, a
    reopen after ``close``) creates it anew from its source; processes that had it mapped keep serving it.
    Reading is lock-free and safe in any number of processes and threads; filling takes a short per-cache lock.
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
        ragged: Sequence[str] | str | None = "auto",
        max_shapes: Mapping[str, Sequence[int]] | None = None,
        store_as: Mapping[str, str] | None = None,
        node_share: bool | tuple[int, int] = False,
        rotate_every: int | None = None,
        stream: bool = False,
        on_miss: str = "compute",
        wait_timeout: float = 60.0,
        delete_on_close: bool = False,
        check_finite: bool = False,
        deterministic: bool = True,
    ) -> None:
        self.path = resolve_path(path)
        self.dataset = dataset
        self.transform = transform
        self.fingerprint = check_optional_str(fingerprint, "fingerprint")
        self.stale = check_choice(stale, "stale", STALE_MODES)
        self.variant_choice = check_choice(variant_choice, "variant_choice", VARIANT_CHOICES)
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} ({seed!r})")
        self.seed = int(seed)
        # A truthy string like "no" must not mean yes: overwrite=True replaces someone's cache.
        overwrite = check_bool(overwrite, "overwrite")
        self.delete_on_close = check_bool(delete_on_close, "delete_on_close")
        self.check_finite = check_bool(check_finite, "check_finite")
        self.on_miss = check_choice(on_miss, "on_miss", ON_MISS)
        if isinstance(wait_timeout, bool) or not isinstance(wait_timeout, (int, float)) or not wait_timeout > 0:
            raise ValueError(f"wait_timeout must be a number of seconds > 0, got {wait_timeout!r}")
        self.wait_timeout = float(wait_timeout)
        self.deterministic = check_bool(deterministic, "deterministic")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, got {type(transform).__name__}")
        # The epoch lives in one shared-memory cell that every copy of this dataset reads: DataLoader workers,
        # persistent ones too, forked (inherited mapping) or spawned (torch pickles a shared tensor as a handle to
        # the same memory), so set_epoch in the main process reaches them all.
        self._epoch_cell = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._epoch_view = memoryview(self._epoch_cell.numpy())
        # How many times set_epoch was called in this process: an epoch set explicitly draws its own order
        # (read.order), and a loader state loaded after one does not move the epoch back (read.loader_state).
        self.epoch_sets = 0
        self._reader: RowReader | None = None
        self._open_lock = threading.Lock()
        self._source_length = source_length(dataset) if dataset is not None else 0
        stream = check_bool(stream, "stream")
        # A stream is per node: under a job of several nodes its ring holds its node's ranks' part (store.split).
        share = share_option(node_share, rotate_every, self.seed) if not stream else None
        if stream and rotate_every is not None:
            raise ValueError("rotate_every rotates a node share; a stream reads every sample fresh each epoch")
        split = stream_split_option(node_share, self.path) if stream else None
        self._request = Request(self.path, self.fingerprint, CreateOptions(max_bytes, cache_indices, variants,
                                max_shapes, ragged, share, stream, split, store_as), overwrite,
                                self.delete_on_close, self.variant_choice, self.seed)
        store, self.created = open_cache(self._request, self._source())
        self._identity = identity(store)
        self._bind(store)

    # --- opening -----------------------------------------------------------------------------------------------

    def _source(self) -> Source | None:
        if self.dataset is None:
            return None
        return Source(self._source_length, fetcher(self.dataset, self.path), checker(self.check_finite),
                      self.deterministic)

    def _bind(self, store: Store) -> None:
        """Makes this process's view of an open, attached store: the warm path's precomputed state."""
        self._store = store
        self._length = store.length
        self._rows = RowMap.of(store, variant_choice=self.variant_choice, seed=self.seed)
        self._reader = RowReader(store, recompute_stale=self.stale == "recompute")
        self._ring = Ring(store) if store.meta["mode"] == "stream" else None
        self._misses = misses = Misses(self.dataset, store, self._rows, self._reader, self.check_finite)
        reader = self._reader

        def compute(index: int) -> list[Any]:
            return misses.kept(misses.checked(reader, misses.fetch(index), index))

        self._streams = None if self._ring is None else StreamReads(
            self._ring, reader, compute if self.dataset is not None else None, self._epoch_view,
            self.on_miss == "wait", self.wait_timeout)
        # The cache's recorded lifetime applies to every user; an opener may also ask for removal of its own.
        delete = self.delete_on_close or bool(store.meta.get("delete_on_close"))
        self._finalizer = weakref.finalize(self, close_store, store, delete, self._ring)

    def _ensure_open(self) -> RowReader:
        """The reader of this process, opening the cache on first use (after unpickling in a worker, or after
        ``close``). Safe from several threads: one opens, the others wait for it."""
        reader = self._reader
        if reader is not None:
            return reader
        with self._open_lock:
            if self._reader is None:
                # Never overwrite from here, and refuse a cache that another source's job put in its place.
                request = dataclasses.replace(self._request, overwrite=False)
                self._bind(open_cache(request, self._source(), expected=self._identity)[0])
            return self._reader  # type: ignore[return-value]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_store", "_reader", "_rows", "_ring", "_misses", "_streams", "_finalizer", "_open_lock",
                    "_epoch_view"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reader = None
        self._open_lock = threading.Lock()
        self._epoch_view = memoryview(self._epoch_cell.numpy())

    # --- the sequence protocol ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._length

    def _where(self) -> str:
        return f"the cache at {self.path}"

    def __getitem__(self, index: int) -> Any:
        reader = self._reader  # kept across fork: the maps are shared, the lock reopens itself
        if reader is None:
            reader = self._ensure_open()
        n = self._length
        i = index if type(index) is int and 0 <= index < n else check_index(index, n, self._where())
        # (``_sample`` inlined: a call more costs the warm ds[i] 5%)
        rows = self._rows
        row = rows.row(i, self._epoch_view[0])
        sample = reader.read(row, i if rows.keyed else -1) if row >= 0 else None
        if sample is None:
            sample = self._misses.one(i, row) if self._ring is None else self._miss(i, row)
        return self.transform(sample) if self.transform is not None else sample

    def sample_at(self, index: int, epoch: int) -> Any:
        """``ds[index]`` of ``epoch``'s variant (``samples_at`` for one index, as ``ds[i]`` gives it)."""
        return self._sample(self._ensure_open(), check_index(index, self._length, self._where()), epoch)

    def _sample(self, reader: RowReader, i: int, epoch: int, batched: bool = False) -> Any:
        """Sample ``i`` (valid) of ``epoch``'s variant, transformed. ``batched``: its ragged fields' tensors marked
        as a gathered batch's are, which ``default_collate`` lists instead of stacking (``read.ragged``)."""
        rows = self._rows
        row = rows.row(i, epoch)
        sample = reader.read(row, i if rows.keyed else -1) if row >= 0 else None
        if sample is None:
            sample = self._misses.one(i, row) if self._ring is None else self._miss(i, row)
        if batched:
            mark_ragged(sample, reader.fields)
        return self.transform(sample) if self.transform is not None else sample

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Fetches a batch: one gather per field (the protocol ``torch.utils.data`` uses when present)."""
        return self.samples_at(indices)

    def samples_at(self, indices: Sequence[int] | np.ndarray, epoch: int | None = None) -> list[Any]:
        """The samples of ``indices`` as ``__getitems__`` gives them, of ``epoch``'s variants (None: this dataset's
        epoch): what a loader's batch reads, keyed by the epoch its order was drawn for (a mixture's, set on the
        mixture and not on its sources). Safe across processes and threads."""
        reader = self._ensure_open()
        idx = check_indices(indices, self._length, self._where())
        epoch = self._epoch_view[0] if epoch is None else epoch
        if reader.variable or len(idx) == 0:  # (read one by one: a max_shapes field)
            return [self._sample(reader, int(i), epoch, batched=True) for i in idx]
        # In a DataLoader worker the batch arrays are shared memory: default_collate hands them on as they are (see
        # mmapcache.collate), and they cross to the main process without a copy.
        samples = reader.samples(self.gather_columns(idx, epoch, column_alloc(reader.fields, len(idx))))
        if self.transform is not None:
            samples = [self.transform(s) for s in samples]
        return samples

    def gather_columns(self, idx: np.ndarray, epoch: int,
                       alloc: Callable[..., np.ndarray] = np.empty) -> list[np.ndarray]:
        """Per field, the batch of values of ``idx`` (int64, valid) in request order, misses computed and stored:
        a fixed field's array (made by ``alloc(shape, dtype)``, in field order), a ragged field's ``RaggedColumn``.
        What ``read_batch`` collates (``collate_columns``); a mixture gathers its sources' parts with it. Safe
        across processes and threads."""
        reader = self._ensure_open()
        keyed = self._rows.keyed
        rows = self._rows.rows_of(idx, epoch)
        # Every row cacheable (a full cache, or a batch of a node share's sampler): the cache-wide fast check applies.
        cacheable = self._rows.total or (bool(len(rows)) and int(rows.min()) >= 0)
        columns, missing = reader.gather(rows, alloc, idx if keyed else None, cacheable)
        if not missing:
            return columns
        self._misses.fill(idx, rows, columns, missing)
        return columns

    # --- misses ------------------------------------------------------------------------------------------------

    def _miss(self, index: int, row: int) -> Any:
        """Computes a sample that is not readable from the cache, and stores it if it is cacheable (``Misses.one``)."""
        if self._ring is not None and self.dataset is not None:
            warn_bypass(self.path)
        return self._misses.one(index, row)

    # --- public API --------------------------------------------------------------------------------------------

    @property
    def variants(self) -> int:
        return self._rows.variants

    @property
    def epoch(self) -> int:
        return int(self._epoch_view[0])

    def set_epoch(self, epoch: int) -> None:
        """Selects the variant served this epoch (``variants > 1``). Reaches every process that reads through a
        copy of this dataset: DataLoader workers of any start method, persistent or not, and ``ds.loader()``'s,
        whose own shuffle then reads epoch ``epoch``'s order (a function of ``(seed, epoch)``, the same each time)."""
        self.restore_epoch(epoch)
        self.epoch_sets += 1

    def restore_epoch(self, epoch: int) -> None:
        """Sets the epoch as ``set_epoch`` does, but as a loaded loader state's, not a choice of the caller's: the
        order drawn for it is the state's (``read.order``)."""
        epoch = operator.index(epoch)
        if not -(2**63) <= epoch < 2**63:
            raise ValueError(f"epoch {epoch} does not fit in int64")
        self._epoch_view[0] = epoch

    @property
    def fields(self) -> list[str]:
        """The field paths of a sample (``"image"``, ``"meta.0"``; see the README's "What a sample can be")."""
        return [f.name for f in self._ensure_open().fields if f.kind != "json"]

    @property
    def stream_split(self) -> StreamSplit:
        """A stream's node split: which positions of each epoch its ring holds (``store.split``; one node: all)."""
        return self._stream_ring().split

    @property
    def share(self) -> Share | None:
        """The node share this cache holds (``node_share``), or None for a full copy."""
        return self._rows.share

    def sampler(self, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False, rank: int | None = None,
                world_size: int | None = None) -> ShareSampler:
        """A distributed sampler that keeps each rank on its node's share (``DistributedSampler`` for a full
        copy), with ``set_epoch``; ``ds.loader(sampler=ds.sampler())`` keeps the loader's batched gather. See
        ``mmapcache._sampler`` for the order it yields."""
        return ShareSampler(self, shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank,
                            world_size=world_size)

    @property
    def reads_batches(self) -> bool:
        """Whether ``read_batch`` can build collated batches (no ``transform``, no variable-shape field)."""
        return self.transform is None and not self._ensure_open().variable

    def read_batch(self, indices: Sequence[int] | np.ndarray, epoch: int | None = None, pad: Any = None, *,
                   trusted: bool = False) -> Any:
        """The batch of ``indices`` as ``default_collate`` would build it from ``[ds[i] for i in indices]``, in one
        gather per field straight into the batch's tensors (shared memory in a DataLoader worker); a ragged field
        is a list of its values, or with ``pad`` (a ``mmapcache.PadCollate``) a ``Padded`` batch. Misses are
        computed and stored. Needs ``reads_batches``. ``trusted``: ``indices`` is an int64 array of valid indices
        (``ds.loader``'s own sampler), not checked again. Safe across processes and threads."""
        reader = self._ensure_open()
        idx = np.asarray(indices) if trusted else check_indices(indices, self._length, self._where())
        epoch = self._epoch_view[0] if epoch is None else epoch
        if getattr(pad, "read_parts", None) is not None and not self._rows.keyed:  # straight from the heaps
            rows = self._rows.rows_of(idx, epoch)
            batch = pad.read_parts([(reader, rows)]) if self._rows.total or int(rows.min(initial=0)) >= 0 else None
            if batch is not None:
                return batch
        return reader.collate(self.gather_columns(idx, epoch, column_alloc(reader.fields, len(idx))), pad)

    def collate_columns(self, columns: list[Any], pad: Any = None) -> Any:
        """``gather_columns``' columns as ``read_batch`` returns them (see ``RowReader.collate``)."""
        return self._ensure_open().collate(columns, pad)

    def loader(self, **kwargs: Any) -> torch.utils.data.DataLoader:
        """A DataLoader over the cache that gathers each batch straight into its final tensors, splits each epoch
        across the ranks of a distributed job, and resumes mid-epoch.

        Takes DataLoader's arguments with their usual meanings, plus ``rank``, ``world_size`` (default: the job's:
        an initialised process group, torchrun's or SLURM's environment) and ``seed`` (the shuffle's, default this
        dataset's ``seed``). Without a ``sampler``, each rank of a job of any number of processes reads what
        ``DistributedSampler(self, shuffle=shuffle, seed=seed)`` gives it: the order is a function of the seed and
        the epoch, never of torch's global generator; call ``loader.sampler.set_epoch(epoch)`` each epoch, as
        Lightning does (or ``loader.set_epoch``, as Hugging Face's ``Trainer`` does, or ``set_epoch``). A pass
        after the first since the epoch was last set draws the epoch's next order, so a loop that never sets it
        still reshuffles; that holds for every loader over this dataset in this process, so two loaders made alike
        read one order when each is given the epoch before its pass. With a ``generator`` or a ``sampler``, one
        process yields what ``DataLoader(self, **kwargs)`` yields. Batches are the dataset's own samples collated
        when there is a ``collate_fn``, a ``transform`` or fields default collation cannot stack. ``state_dict()`` and
        ``load_state_dict()`` (torchdata's ``StatefulDataLoader`` protocol, which Lightning saves in its
        checkpoints) resume exactly: see ``mmapcache.read.order``. A stream (``stream=True``) returns its own
        loader, which reads the stream's order and resumes at the rank's cursor.

        ``group_by_length="input_ids"`` batches samples of similar lengths (less padding): each run of
        ``group_size`` positions of the epoch's order (default 50 x batch size x ranks) is sorted longest first
        before the split, as Hugging Face's ``group_by_length`` does; the ranks' split, the resume (elastic too)
        and ``set_epoch`` hold as without it. It reads ``lengths(field)``: the cache must hold every sample.
        """
        return make_loader(self, **kwargs)

    def close(self) -> None:
        """Unmaps the cache in this process; with ``delete_on_close``, the last user removes it."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        self._reader = None
        for held in ("_misses", "_streams"):  # they hold the reader's maps; _ensure_open makes new ones
            self.__dict__.pop(held, None)

    def __enter__(self) -> MmapCachedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MmapCachedDataset({self.path!r}, length={self._length}, variants={self._rows.variants})"
