"""``ds.loader()``: a DataLoader whose batches are gathered straight into their final, collated tensors."""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate, default_convert

from ._order import BatchOrder, EpochStart
from .collate import PadCollate
from .errors import WorkerStartError


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

    def stream_start(self, rank: int, ranks: int) -> tuple[int, int]: ...

    def stream_consumed(self, rank: int, ranks: int, epoch: int, k: int, stats: dict[str, int]) -> None: ...

    def stream_progress(self, rank: int) -> tuple[int, int] | None: ...

    def stream_seek(self, rank: int, ranks: int, epoch: int, k: int) -> None: ...

    def read_stream_batch(self, epoch: int, rank: int, ranks: int, k0: int, k1: int, pad: Any = None,
                          collate: Any = None) -> tuple[dict[str, int], Any]: ...

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
        return StreamLoader(ds, pad, **kwargs)
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
        reads: Dataset = _Batches(ds, pad, order.trusted)
    else:
        reads = _Samples(ds, collate, batched=batch_size is not None or batch_sampler is not None)
    # The order's generator also goes to the DataLoader: it draws the workers' base seed from it before the order
    # draws the permutation, exactly as DataLoader(ds, generator=...) does, so both shuffle alike.
    return CacheLoader(reads, batch_size=None, sampler=order, collate_fn=_identity, generator=order.generator,
                       **kwargs)


class CacheLoader(DataLoader):
    """The DataLoader ``ds.loader()`` returns: its batches are read by ``_Batches`` (one gather per field, straight
    into the collated tensors) or ``_Samples`` (the dataset's own samples and a ``collate_fn``), in the order of its
    ``sampler``, a ``BatchOrder`` (``mmapcache._order``: split across the ranks of a distributed job).

    Without workers (and without pinning), iterating it skips DataLoader's per-batch machinery (a profiler record
    per batch, a fetcher, the collate indirection): about half the time of a batch of tiny rows. It yields the same
    batches, after the same random draws (the base seed DataLoader draws from the generator, then the order's).

    ``state_dict()`` and ``load_state_dict()`` follow torchdata's ``StatefulDataLoader`` protocol (PyTorch Lightning
    saves and restores them in its checkpoints): a loader given the state of one interrupted mid-epoch yields the
    batches that epoch had left, then the same epochs after it.
    """

    def __iter__(self) -> Any:
        self._yielded, self._active = 0, False  # a new pass: an abandoned one's progress is gone
        self.sampler.started = None  # type: ignore[attr-defined]
        return self._counted()

    def _counted(self) -> Iterator[Any]:
        """The batches, counting those handed to the caller (what a state records: not a worker's prefetch)."""
        self._active = True
        batches = super().__iter__() if self.num_workers or self.pin_memory else self._direct()
        for batch in batches:
            self._yielded += 1
            yield batch
        self._active = False

    def _direct(self) -> Iterator[Any]:
        keys = iter(self.sampler)
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)  # DataLoader's base seed
        dataset = self.dataset
        for key in keys:
            yield dataset[key]

    # --- resuming ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: the epoch being read and the batches it yielded of it (or, between epochs, where the
        next starts), with what its order was drawn from (``mmapcache._order``). Picklable; ``torch.save`` stores it.
        """
        order: BatchOrder = self.sampler  # type: ignore[assignment]
        state = self._shape()
        start = order.started
        if getattr(self, "_active", False) and start is not None:
            state.update(epoch=start.epoch, batches=self._yielded, generator=start.generator, sampler=start.sampler)
        else:
            now = order._start()
            state.update(epoch=now.epoch, batches=0, generator=now.generator, sampler=now.sampler)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next iteration continue where the loader that saved ``state`` was: the rest of its epoch (the
        batches it had not yielded), or the epoch after a finished one.

        Raises:
            ValueError: ``state`` is not a loader state, or is that of a loader over another dataset length, batch
                size, world size or order (a silent reshuffle otherwise).
        """
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError(f"not a state of ds.loader() (format {_STATE_FORMAT!r}); pass what its state_dict() "
                             "returned")
        mine = self._shape()
        differ = [f"{key} {state.get(key)!r} in the state, {mine[key]!r} here" for key in mine
                  if state.get(key) != mine[key]]
        if differ:
            raise ValueError(f"this loader state was saved by a loader of another shape ({'; '.join(differ)}): "
                             "resuming from it would read another order. Resume with the same dataset length, "
                             "batch size, drop_last, shuffle and number of ranks, or start the epoch afresh")
        order: BatchOrder = self.sampler  # type: ignore[assignment]
        start = EpochStart(int(state["epoch"]), state.get("generator"), state.get("sampler"))
        if state["batches"]:
            order.resume = (start, int(state["batches"]))
            order.ds.set_epoch(start.epoch)
        else:
            order._restore(start)

    def _shape(self) -> dict[str, Any]:
        """What a state must match: the dataset's length, the batching and the split. Not the rank: every rank's
        state is the same (the epoch and the batches each yielded), and a trainer saves one (Lightning, rank 0's)
        from which each rank resumes its own part."""
        order: BatchOrder = self.sampler  # type: ignore[assignment]
        return {"format": _STATE_FORMAT, "length": len(order.ds), "batch_size": order.batch_size,
                "drop_last": order.drop_last, "shuffle": order.shuffle, "world_size": order.num_replicas,
                "batches_per_epoch": len(order)}


_STATE_FORMAT = "mmapcache.loader/1"


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


class _Batches(Dataset):
    """Maps ``(epoch, indices)`` to the collated batch, gathered in one step per field (``read_batch``)."""

    def __init__(self, ds: BatchReader, pad: PadCollate | None = None, trusted: bool = False) -> None:
        self.ds = ds
        self.pad = pad
        self.trusted = trusted

    def __getitem__(self, key: tuple[int, Any]) -> Any:
        epoch, indices = key
        return self.ds.read_batch(indices, epoch, self.pad, trusted=self.trusted)

    def __len__(self) -> int:
        return len(self.ds)


class _Samples(Dataset):
    """Maps ``(epoch, indices)`` to ``collate_fn([ds[i] for i in indices])`` (through ``__getitems__``), or, not
    batched, ``(epoch, i)`` to ``collate_fn(ds[i])``: what ``DataLoader(ds)`` does with a ``collate_fn``, a
    ``transform`` or fields default collation cannot stack (default: ``default_collate``, or ``default_convert``
    when not batched)."""

    def __init__(self, ds: Any, collate: Any, batched: bool) -> None:
        self.ds, self.batched = ds, batched
        self.collate = collate if collate is not None else default_collate if batched else default_convert

    def __getitem__(self, key: tuple[int, Any]) -> Any:
        _, indices = key
        if not self.batched:
            return self.collate(self.ds[indices])
        return self.collate(self.ds.__getitems__(indices.tolist()))

    def __len__(self) -> int:
        return len(self.ds)


def alloc_shared(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A numpy array over a fresh shared-memory tensor storage: a worker's batch then crosses to the main process
    without the copy that sending an ordinary tensor costs (torch's default collate does the same)."""
    tensor = torch.from_numpy(np.empty(0, dtype))
    count = math.prod(shape)
    storage = tensor.untyped_storage()._new_shared(count * dtype.itemsize)
    return tensor.new(storage).view(-1)[:count].view(shape).numpy() if count else np.empty(shape, dtype)


# --- stream mode ---------------------------------------------------------------------------------------------------


class StreamLoader:
    """``ds.loader()`` over a stream: each iteration yields this rank's next epoch of the stream's order (or the
    rest of the epoch it was reading), in batches, and moves the rank's cursor past each batch as the training loop
    receives it. The batches are read by an inner DataLoader (its workers, if any); see ``mmapcache._stream``.

    Takes DataLoader's arguments except those that choose the order (``shuffle``, ``sampler``, ``batch_sampler``,
    ``generator``: the stream's seeded order is fixed), plus ``rank``/``world_size`` (default: the local rank and
    the ranks of this node that share the ring, as ``prefill`` finds them).
    """

    def __init__(self, ds: BatchReader, pad: PadCollate | None, **kwargs: Any) -> None:
        for name in ("shuffle", "sampler", "batch_sampler", "generator"):
            if kwargs.get(name) not in (None, False):
                raise ValueError(f"{name}= chooses an order, and a stream reads its own seeded order (the seed= it "
                                 f"was created with); leave {name} out of ds.loader()")
            kwargs.pop(name, None)
        batch_size = kwargs.pop("batch_size", 1)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1 for a stream, got {batch_size!r}")
        rank, world_size = kwargs.pop("rank", None), kwargs.pop("world_size", None)
        if (rank is None) != (world_size is None):
            raise TypeError("ds.loader() takes both rank= and world_size=, or neither (for the environment's)")
        if rank is None:
            from .distributed import local_rank_and_size

            rank, world_size = local_rank_and_size(ds.path)
        if not 0 <= rank < world_size <= _MAX_RANKS:
            raise ValueError(f"rank {rank} of {world_size}: need 0 <= rank < world_size <= {_MAX_RANKS}")
        self.ds, self.rank, self.ranks = ds, rank, world_size
        self.batch_size, self.drop_last = batch_size, bool(kwargs.pop("drop_last", False))
        collate = kwargs.pop("collate_fn", None)
        self.per_rank = -(-len(ds) // world_size)
        self._plan = _Plan()
        self._loader = DataLoader(_StreamReads(ds, rank, world_size, pad, None if pad is not None else collate),
                                  batch_size=None, sampler=self._plan, collate_fn=_identity, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self.ds.stream_start(self.rank, self.ranks)
        stop = self.per_rank - (self.per_rank - start) % self.batch_size if self.drop_last else self.per_rank
        self._plan.items = [(epoch, a, min(a + self.batch_size, stop)) for a in range(start, stop, self.batch_size)]
        for (epoch, _, end), (stats, batch) in zip(self._plan.items, self._loader):
            self.ds.stream_consumed(self.rank, self.ranks, epoch, end, stats)
            yield batch
        if stop < self.per_rank:  # drop_last: the short tail is not read, but it is passed
            self.ds.stream_consumed(self.rank, self.ranks, epoch, self.per_rank, {})

    def __len__(self) -> int:
        """Batches in one whole epoch of this rank."""
        return self.per_rank // self.batch_size if self.drop_last else -(-self.per_rank // self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is in the stream: its epoch and the positions handed to the training loop (its cursor,
        which the ring also keeps). ``CacheLoader``'s protocol."""
        epoch, position = self.ds.stream_progress(self.rank) or (self.ds.epoch, 0)
        return {"format": _STREAM_STATE_FORMAT, "length": len(self.ds), "world_size": self.ranks, "rank": self.rank,
                "batch_size": self.batch_size, "epoch": epoch, "position": position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Moves this rank's cursor to where ``state`` was (a checkpoint restored after the run went on: the
        positions read since are read again, computed afresh where the ring no longer holds them).

        Raises:
            ValueError: not a stream loader's state, or one of another dataset length, batch size or rank count.
        """
        if not isinstance(state, dict) or state.get("format") != _STREAM_STATE_FORMAT:
            raise ValueError(f"not a state of a stream's ds.loader() (format {_STREAM_STATE_FORMAT!r}); pass what its "
                             "state_dict() returned")
        mine = {"length": len(self.ds), "world_size": self.ranks, "rank": self.rank, "batch_size": self.batch_size}
        differ = [f"{key} {state.get(key)!r} in the state, {value!r} here" for key, value in mine.items()
                  if state.get(key) != value]
        if differ:
            raise ValueError(f"this loader state was saved by a loader of another shape ({'; '.join(differ)}): "
                             "resuming from it would read other positions")
        self.ds.stream_seek(self.rank, self.ranks, int(state["epoch"]), int(state["position"]))


_STREAM_STATE_FORMAT = "mmapcache.stream_loader/1"


_MAX_RANKS = 256


class _Plan(Sampler):
    """The batches of the current iteration, set by ``StreamLoader`` before the inner DataLoader starts it."""

    def __init__(self) -> None:
        self.items: list[tuple[int, int, int]] = []

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return iter(list(self.items))

    def __len__(self) -> int:
        return len(self.items)


class _StreamReads(Dataset):
    """Maps ``(epoch, k0, k1)`` to ``(stats, batch)``: this rank's positions ``k0 .. k1-1``."""

    def __init__(self, ds: BatchReader, rank: int, ranks: int, pad: PadCollate | None, collate: Any) -> None:
        self.ds, self.rank, self.ranks, self.pad, self.collate = ds, rank, ranks, pad, collate

    def __getitem__(self, key: tuple[int, int, int]) -> tuple[dict[str, int], Any]:
        epoch, k0, k1 = key
        return self.ds.read_stream_batch(epoch, self.rank, self.ranks, k0, k1, self.pad, self.collate)

    def __len__(self) -> int:
        return len(self.ds)
