"""``ds.loader()``: a DataLoader whose batches are gathered straight into their final, collated tensors."""

from __future__ import annotations

import copy
import multiprocessing
import os
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
from torch.utils.data import DataLoader, Dataset, default_collate, default_convert

from ..errors import WorkerStartError
from . import arena, loader_state
from .collate import PadCollate
from .lending import Lending
from .order import BatchOrder
from .resume import no_base_seed
from .stream_loader import StreamLoader
from .text_collate import TextCollate


class BatchReader(Protocol):
    """What the loader needs of a dataset (``MmapCachedDataset`` provides it)."""

    transform: Any
    seed: int
    epoch_sets: int

    @property
    def epoch(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def restore_epoch(self, epoch: int) -> None: ...

    @property
    def reads_batches(self) -> bool: ...

    @property
    def fields(self) -> list[str]: ...

    @property
    def stream(self) -> bool: ...

    path: str

    def read_batch(self, indices: Sequence[int] | np.ndarray, epoch: int | None = None, pad: Any = None, *,
                   trusted: bool = False) -> Any: ...

    def __len__(self) -> int: ...


def make_loader(ds: BatchReader, **kwargs: Any) -> Any:
    """``ds.loader(**kwargs)``: a ``CacheLoader``, or a ``StreamLoader`` for a stream (see ``ds.loader``)."""
    _check_workers_can_import(ds, kwargs)
    grouping = _grouping(ds, kwargs)
    collate = kwargs.get("collate_fn")
    # Fused into the gather: pads from the heaps.
    pad = collate if isinstance(collate, (PadCollate, TextCollate)) else None
    if pad is not None:
        pad.check_fields(set(ds.fields))
    if ds.stream:
        return StreamLoader(ds, pad, **kwargs)  # type: ignore[arg-type]
    batch_size = kwargs.pop("batch_size", 1)
    shuffle = kwargs.pop("shuffle", None)
    sampler = kwargs.pop("sampler", None)
    batch_sampler = kwargs.pop("batch_sampler", None)
    drop_last = kwargs.pop("drop_last", False)
    generator = kwargs.pop("generator", None)
    collate = kwargs.pop("collate_fn", None)
    placement = {name: kwargs.pop(name, None) for name in ("rank", "world_size", "seed")}
    # DataLoader's own checks, in its words.
    if batch_size is not None:
        if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise ValueError(f"batch_size should be a positive integer value, but got batch_size={batch_size}")
        batch_size = int(batch_size)
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None and (batch_size != 1 or shuffle or sampler is not None or drop_last):
        raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last")
    if batch_size is None and drop_last:
        raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")
    order = BatchOrder(ds, batch_size=None if batch_sampler is not None else batch_size, shuffle=bool(shuffle),
                       drop_last=drop_last, generator=generator, sampler=sampler, batch_sampler=batch_sampler,
                       **placement, **grouping)
    if (collate is None or pad is not None) and ds.reads_batches and batch_size is not None:
        reads: _Reads = _Batches(ds, pad, order.trusted)
    else:
        reads = _Samples(ds, collate, batched=batch_size is not None or batch_sampler is not None)
    reads.order = order
    # A user's generator also goes to the DataLoader: it draws the workers' base seed from it before the order
    # draws the permutation, exactly as DataLoader(ds, generator=...) does, so both shuffle alike.
    return CacheLoader(reads, batch_size=None, sampler=order, collate_fn=_identity, generator=order.generator,
                       **kwargs)


def _grouping(ds: BatchReader, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``group_by_length`` and ``group_size``, taken out of ``kwargs`` and checked."""
    field, size = kwargs.pop("group_by_length", None), kwargs.pop("group_size", None)
    if field is None:
        if size is not None:
            raise ValueError("group_size= sizes the length groups of group_by_length=; pass both, or neither")
        return {}
    if not isinstance(field, str) or field not in ds.fields:
        raise ValueError(f"group_by_length= names the field whose lengths group the batches, one of {ds.fields}; "
                         f"got {field!r}")
    if ds.stream:
        raise ValueError("group_by_length= orders a cache's epoch by its samples' lengths; a stream's order is its "
                         "own (its producers fill the ring in it): leave group_by_length out")
    if kwargs.get("sampler") is not None or kwargs.get("batch_sampler") is not None:
        raise ValueError("group_by_length= groups ds.loader()'s own order; a sampler or batch_sampler chooses "
                         "another: pass one or the other")
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1):
        raise ValueError(f"group_size must be an int >= 1 (samples per length group), got {size!r}")
    return {"group_by_length": field, "group_size": None if size is None else int(size)}


class CacheLoader(DataLoader):
    """The DataLoader ``ds.loader()`` returns: its batches are read by ``_Batches`` (one gather per field, straight
    into the collated tensors) or ``_Samples`` (the dataset's own samples and a ``collate_fn``), in the order of its
    ``sampler``, a ``BatchOrder`` (``read.order``: split across the ranks of a distributed job).

    Without workers (and without pinning), iterating it skips DataLoader's per-batch machinery (a profiler record
    per batch, a fetcher, the collate indirection): about half the time of a batch of tiny rows. It yields the same
    batches, after the same random draws (the base seed DataLoader draws from the generator, then the order's;
    the rest of a pass resumed from a state draws neither again: its first batches' loader drew them).

    ``state_dict()`` and ``load_state_dict()`` follow torchdata's ``StatefulDataLoader`` protocol (PyTorch Lightning
    saves and restores them in its checkpoints): a loader given the state of one interrupted mid-epoch yields the
    batches that epoch had left, then the same epochs after it.
    """

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        order, sampler = getattr(dataset, "order", None), kwargs.get("sampler")
        if isinstance(order, BatchOrder) and sampler is not None and not isinstance(sampler, BatchOrder):
            # Rebuilt from its attributes with another sampler (PyTorch Lightning's ``overfit_batches`` puts in a
            # ``SequentialSampler(loader.dataset)``): that sampler's indices, batched as this loader batched its own.
            kwargs["sampler"] = order.over(sampler)
            dataset = copy.copy(dataset)  # the original loader keeps its own
            dataset.order, dataset.trusted = kwargs["sampler"], False  # its indices are checked
        super().__init__(dataset, *args, **kwargs)

    def __iter__(self) -> Any:
        order: BatchOrder = self.sampler  # type: ignore[assignment]
        order.started, order.skipped = None, 0
        self._pass = _Pass(self._begin, len(self))  # a new pass: an abandoned one's progress is gone
        return self._pass

    def _begin(self) -> Iterator[Any]:
        """Starts a pass, at its first batch (not at ``iter()``: a ``set_epoch`` in between counts, also with
        workers, whose DataLoader iterator draws the order as it starts)."""
        order: BatchOrder = self.sampler  # type: ignore[assignment]
        order.settle()  # before the workers' base seed is drawn from a generator the settled pass draws from
        if self.num_workers or self.pin_memory:
            order.draws_base_seed = False
            with no_base_seed(self, order.resume is not None and order.resume.same_epoch):
                return arena.from_workers(self, super().__iter__) if self.num_workers else super().__iter__()
        # No DataLoader iterator draws the workers' base seed from the generator: the order draws it first, as
        # DataLoader's iterator would just before (so both shuffle alike).
        order.draws_base_seed = True
        return map(self.dataset.__getitem__, order)

    def set_epoch(self, epoch: int) -> None:
        """``sampler.set_epoch(epoch)``: the next pass reads epoch ``epoch``'s order (Hugging Face's ``Trainer`` calls
        a loader's ``set_epoch`` each epoch; without it each pass of an epoch draws a new order of its own)."""
        self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]

    # --- resuming ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: the pass being read and the batches it yielded of it (or, between passes, what the
        next one draws), with what its order was drawn from (``read.loader_state``). Picklable; ``torch.save``
        stores it. A loader given a state and not iterated since returns that state."""
        return loader_state.save(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next pass continue where the loader that saved ``state`` was: the rest of its pass, if the next
        pass is of that epoch (the dataset's epoch is set to it, unless ``set_epoch`` was called since this loader
        was made), or the epoch ``set_epoch`` sets instead, drawn as the uninterrupted loader would have drawn it
        (a trainer that moves on from a state taken after an epoch's last batch: that whole epoch, never nothing).

        Raises:
            ValueError: ``state`` is not a loader state, holds a value no loader saves (each key is checked), or is
                that of a loader over another dataset length, batch size, world size or order (a silent reshuffle
                otherwise).
        """
        loader_state.load(self, state)


def _check_workers_can_import(ds: BatchReader, kwargs: dict[str, Any]) -> None:
    """Workers started by ``spawn``/``forkserver`` unpickle the dataset by importing what defined it. A class or
    function defined in an interactive ``__main__`` (``python -c``, a notebook, stdin) cannot be imported there, and
    torch then reports only "DataLoader worker exited unexpectedly": say what is wrong before starting them."""
    if not kwargs.get("num_workers"):
        return
    context = kwargs.get("multiprocessing_context")
    if context is None:
        method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    else:
        method = context if isinstance(context, str) else context.get_start_method()
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if method == "fork" or main is None or (script and os.path.isfile(script)):
        return  # fork copies the process; a script's __main__ is re-imported by the workers (not '<stdin>')
    parts = {"the source dataset": getattr(ds, "dataset", None), "transform": getattr(ds, "transform", None),
             **{name: kwargs.get(name) for name in ("collate_fn", "worker_init_fn", "sampler", "batch_sampler")}}
    for what, obj in parts.items():
        if obj is None:
            continue
        # Classes and functions pickle by their own name; instances by their class's.
        named = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
        if named.__module__ == "__main__":
            raise WorkerStartError(
                f"{what} ({named.__qualname__}) is defined in an interactive "
                f"__main__ (python -c, a notebook, stdin), which DataLoader workers started by {method!r} cannot "
                "import; define it in a module (a .py file on the path) and import it, or use "
                "multiprocessing_context='fork' (Linux), or num_workers=0"
            )


def _identity(batch: Any) -> Any:
    return batch


class _Pass(Iterator[Any]):
    """One pass over a ``CacheLoader``: an iterator with a length, as DataLoader's own, that counts the batches it
    handed to the caller (what a state records: not a worker's prefetch). ``begin()`` makes its batches, at the
    first ``next``."""

    def __init__(self, begin: Callable[[], Iterator[Any]], length: int) -> None:
        self._begin: Callable[[], Iterator[Any]] | None = begin
        self._length = length
        self._next: Callable[[], Any] = self._first
        self.yielded, self.active = 0, True

    def _first(self) -> Any:
        begin, self._begin = self._begin, None  # the loader's method: kept, it would tie the loader and its workers'
        assert begin is not None  #              iterator in a cycle, shut down only by the garbage collector
        self._next = begin().__next__
        return self._next()

    def __next__(self) -> Any:
        try:
            batch = self._next()
        except StopIteration:
            self.active = False
            raise
        self.yielded += 1
        return batch

    def __len__(self) -> int:
        return self._length


def _not_a_batch_key(key: Any) -> TypeError:
    return TypeError(
        f"ds.loader()'s dataset is read by (epoch, indices) keys from its own sampler, not {key!r}: to index "
        "samples, use the MmapCachedDataset itself (ds[i]); to iterate with another sampler, pass it as "
        "ds.loader(sampler=...) or use torch.utils.data.DataLoader(ds, ...)")


class _Reads(Dataset):
    """A loader's dataset. ``order`` is the loader's ``BatchOrder`` (to rebuild the loader with another sampler);
    it stays in this process: workers are sent only what they read with."""

    order: BatchOrder | None = None
    lending: Lending | None = None  # while its loader starts workers (``read.lending``)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "order": None}


class _Batches(_Reads):
    """Maps ``(epoch, indices)`` to the collated batch, gathered in one step per field (``read_batch``)."""

    def __init__(self, ds: BatchReader, pad: PadCollate | TextCollate | None = None, trusted: bool = False) -> None:
        self.ds = ds
        self.pad = pad
        self.trusted = trusted

    def __getitem__(self, key: tuple[int, Any]) -> Any:
        try:
            epoch, indices = key
        except (TypeError, ValueError):
            raise _not_a_batch_key(key) from None
        return arena.read(self.lending, self.ds.read_batch, indices, epoch, self.pad, trusted=self.trusted)

    def __len__(self) -> int:
        return len(self.ds)


class _Samples(_Reads):
    """Maps ``(epoch, indices)`` to ``collate_fn([ds[i] for i in indices])`` (through ``__getitems__``), or, not
    batched, ``(epoch, i)`` to ``collate_fn(ds[i])``: what ``DataLoader(ds)`` does with a ``collate_fn``, a
    ``transform`` or fields default collation cannot stack (default: ``default_collate``, or ``default_convert``
    when not batched)."""

    def __init__(self, ds: Any, collate: Any, batched: bool) -> None:
        self.ds, self.batched = ds, batched
        self.collate = collate if collate is not None else default_collate if batched else default_convert

    def __getitem__(self, key: tuple[int, Any]) -> Any:
        try:
            epoch, indices = key
        except (TypeError, ValueError):
            raise _not_a_batch_key(key) from None
        if not self.batched:
            return arena.read(self.lending, self._one, indices, epoch)
        return arena.read(self.lending, self._many, indices, epoch)

    # (the variants of the epoch the batch's order was drawn for, as the gathered batches read them: a set_epoch
    # between the order's draw and this read changes neither)
    def _one(self, i: int, epoch: int) -> Any:
        return self.collate(self.ds.sample_at(i, epoch))

    def _many(self, indices: Any, epoch: int) -> Any:
        return self.collate(self.ds.samples_at(indices, epoch))

    def __len__(self) -> int:
        return len(self.ds)
