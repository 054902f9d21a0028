"""``ds.loader()``: a DataLoader whose batches are gathered straight into their final, collated tensors."""

from __future__ import annotations

import copy
import multiprocessing
import os
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
from torch.utils.data import DataLoader, Dataset, default_collate, default_convert

from ..errors import WorkerStartError
from .collate import PadCollate
from .order import BatchOrder
from .resume import EpochStart, Resume, has_generator
from .stream import StreamLoader


class BatchReader(Protocol):
    """What the loader needs of a dataset (``MmapCachedDataset`` provides it)."""

    transform: Any
    seed: int

    @property
    def epoch(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

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
    collate = kwargs.get("collate_fn")
    pad = collate if isinstance(collate, PadCollate) else None  # fused into the gather: pads from the heaps
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
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None and (batch_size != 1 or shuffle or sampler is not None or drop_last):
        raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last")
    if batch_size is None and drop_last:
        raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")
    order = BatchOrder(ds, batch_size=None if batch_sampler is not None else batch_size, shuffle=bool(shuffle),
                       drop_last=drop_last, generator=generator, sampler=sampler, batch_sampler=batch_sampler,
                       **placement)
    if (collate is None or pad is not None) and ds.reads_batches and batch_size is not None:
        reads: _Reads = _Batches(ds, pad, order.trusted)
    else:
        reads = _Samples(ds, collate, batched=batch_size is not None or batch_sampler is not None)
    reads.order = order
    # A user's generator also goes to the DataLoader: it draws the workers' base seed from it before the order
    # draws the permutation, exactly as DataLoader(ds, generator=...) does, so both shuffle alike.
    return CacheLoader(reads, batch_size=None, sampler=order, collate_fn=_identity, generator=order.generator,
                       **kwargs)


class CacheLoader(DataLoader):
    """The DataLoader ``ds.loader()`` returns: its batches are read by ``_Batches`` (one gather per field, straight
    into the collated tensors) or ``_Samples`` (the dataset's own samples and a ``collate_fn``), in the order of its
    ``sampler``, a ``BatchOrder`` (``read.order``: split across the ranks of a distributed job).

    Without workers (and without pinning), iterating it skips DataLoader's per-batch machinery (a profiler record
    per batch, a fetcher, the collate indirection): about half the time of a batch of tiny rows. It yields the same
    batches, after the same random draws (the base seed DataLoader draws from the generator, then the order's).

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
        batches: Iterator[Any]
        if self.num_workers or self.pin_memory:
            order.draws_base_seed = False
            batches = super().__iter__()
        else:
            # No DataLoader iterator draws the workers' base seed from the generator: the order draws it first, at
            # the first batch, as DataLoader's iterator would just before (so both shuffle alike).
            order.draws_base_seed = True
            batches = map(self.dataset.__getitem__, order)
        self._pass = _Pass(batches, len(self))  # a new pass: an abandoned one's progress is gone
        return self._pass

    # --- resuming ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: the epoch being read and the batches it yielded of it (or, between epochs, where the
        next starts), with what its order was drawn from (``read.order``). Picklable; ``torch.save`` stores it. A
        loader given a state and not iterated since returns that state."""
        order: BatchOrder = self.sampler  # type: ignore[assignment]
        if self.num_workers and not getattr(self, "in_order", True):
            raise ValueError("ds.loader(in_order=False) with workers hands batches to the training loop out of order, "
                             "so no state can say which of an epoch's batches were trained on; pass in_order=True "
                             "(the default) to a loader whose state is saved")
        state = self._shape()
        current = getattr(self, "_pass", None)
        resume, start = order.resume, order.current() if current is not None and current.active else None
        # in_epoch: the state is of an epoch whose order was drawn (mid-epoch, or drawn by workers' prefetch before
        # its first batch was handed out), not of the next one.
        if resume is not None:
            start, batches, in_epoch = resume.start, resume.skip, resume.same_epoch
            epoch, persistent = start.epoch if in_epoch else order.epoch, not in_epoch
        elif start is not None:
            epoch, batches, persistent = start.epoch, order.skipped + current.yielded, False  # type: ignore[union-attr]
            in_epoch = True
        else:
            start = order.start()
            epoch, batches, in_epoch = start.epoch, 0, False
            # With persistent workers the next epoch draws no base seed for its workers (a resumed loader's first
            # does): the generator is then put back when the order is drawn, after that draw.
            persistent = bool(self.persistent_workers and self.num_workers and getattr(self, "_iterator", None))
        state.update(epoch=epoch, batches=batches, generator=start.generator, sampler=start.sampler,
                     repeat=start.repeat, rng=start.rng, in_epoch=in_epoch, persistent=persistent, drawn=order.drawn)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next iteration continue where the loader that saved ``state`` was: the rest of its epoch (the
        batches it had not yielded, and the dataset's epoch is that one), or, from a state taken between epochs,
        the next epoch (the one ``set_epoch`` sets, before or after this call) drawn as it would have been.

        Raises:
            ValueError: ``state`` is not a loader state, or is that of a loader over another dataset length, batch
                size, world size or order (a silent reshuffle otherwise).
        """
        if isinstance(state, dict) and state.get("format") == "mmapcache.loader/1":
            raise ValueError("this loader state was saved by mmapcache 0.3, whose loader drew its shuffle from a seed "
                             "taken from torch's global generator; this version draws it from (seed, epoch), so "
                             "resuming from it would read another order: start the epoch afresh (load no loader "
                             "state; the model's and optimizer's states are unaffected)")
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError(f"not a state of ds.loader() (format {_STATE_FORMAT!r}); pass what its state_dict() "
                             "returned")
        mine = self._shape()
        differ = [f"{key} {state.get(key)!r} in the state, {mine[key]!r} here" for key in mine
                  if state.get(key) != mine[key]]
        if differ:
            raise ValueError(f"this loader state was saved by a loader of another shape ({'; '.join(differ)}): "
                             "resuming from it would read another order. Resume with the same dataset length, "
                             "batch size, drop_last, shuffle, number of ranks, seed, sampler, generators and (with a "
                             "generator) persistent_workers, or start the epoch afresh")
        order: BatchOrder = self.sampler  # type: ignore[assignment]
        start = EpochStart(int(state["epoch"]), state.get("generator"), state.get("sampler"),
                           int(state.get("repeat", 0)), state.get("rng"))
        batches = int(state["batches"])
        drawn = state.get("drawn")
        if drawn is not None:
            order.record_draw(int(drawn[0]), int(drawn[1]))
        in_epoch = bool(state["in_epoch"])
        if in_epoch or state.get("persistent"):
            order.resume = Resume(start, batches, same_epoch=in_epoch)
            if in_epoch:
                order.ds.set_epoch(start.epoch)
        else:
            order.resume = None
            order.restore(start, epoch=False)

    def _shape(self) -> dict[str, Any]:
        """What a state must match: the dataset's length, the batching, the split and what draws the order. Not
        the rank: every rank's state is the same (the epoch and the batches each yielded), and a trainer saves one
        (Lightning, rank 0's) from which each rank resumes its own part."""
        order: BatchOrder = self.sampler  # type: ignore[assignment]
        shape = {"format": _STATE_FORMAT, "length": len(order.ds), "batch_size": order.batch_size,
                 "drop_last": order.drop_last, "shuffle": order.shuffle, "world_size": order.num_replicas,
                 "batches_per_epoch": len(order),
                 "seed": order.seed if order.own and order.shuffle and (
                     order.generator is None or order.num_replicas > 1) else None,
                 "sampler_kinds": [_kind(order.user_sampler), _kind(order.user_batch_sampler)],
                 "generators": [order.generator is not None, has_generator(order.user_sampler),
                                has_generator(getattr(order.user_batch_sampler, "sampler", None))]}
        if order.own and order.shuffle and order.generator is not None:
            # A generator= also gives the workers their base seed: once with persistent workers, else each epoch.
            shape["seeds_workers_once"] = bool(self.num_workers and self.persistent_workers)
        return shape


def _kind(sampler: Any) -> str | None:
    return None if sampler is None else f"{type(sampler).__module__}.{type(sampler).__qualname__}"


_STATE_FORMAT = "mmapcache.loader/2"  # 1: 0.3, whose own shuffle drew its seed from torch's global generator


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
    handed to the caller (what a state records: not a worker's prefetch)."""

    def __init__(self, batches: Iterator[Any], length: int) -> None:
        self._next, self._length = batches.__next__, length
        self.yielded, self.active = 0, True

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

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "order": None}


class _Batches(_Reads):
    """Maps ``(epoch, indices)`` to the collated batch, gathered in one step per field (``read_batch``)."""

    def __init__(self, ds: BatchReader, pad: PadCollate | None = None, trusted: bool = False) -> None:
        self.ds = ds
        self.pad = pad
        self.trusted = trusted

    def __getitem__(self, key: tuple[int, Any]) -> Any:
        try:
            epoch, indices = key
        except (TypeError, ValueError):
            raise _not_a_batch_key(key) from None
        return self.ds.read_batch(indices, epoch, self.pad, trusted=self.trusted)

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
            _, indices = key
        except (TypeError, ValueError):
            raise _not_a_batch_key(key) from None
        if not self.batched:
            return self.collate(self.ds[indices])
        return self.collate(self.ds.__getitems__(indices.tolist()))

    def __len__(self) -> int:
        return len(self.ds)
