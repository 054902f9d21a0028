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
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler

from .collate import PadCollate
from .errors import WorkerStartError


class BatchReader(Protocol):
    """What the loader needs of a dataset (``MmapCachedDataset`` provides it)."""

    transform: Any

    @property
    def epoch(self) -> int: ...

    @property
    def reads_batches(self) -> bool: ...

    @property
    def fields(self) -> list[str]: ...

    @property
    def stream(self) -> bool: ...

    path: str

    def stream_start(self, rank: int, ranks: int) -> tuple[int, int]: ...

    def stream_consumed(self, rank: int, ranks: int, epoch: int, k: int, stats: dict[str, int]) -> None: ...

    def read_stream_batch(self, epoch: int, rank: int, ranks: int, k0: int, k1: int, pad: Any = None,
                          collate: Any = None) -> tuple[dict[str, int], Any]: ...

    def read_batch(self, indices: Sequence[int] | np.ndarray, epoch: int | None = None, pad: Any = None, *,
                   trusted: bool = False) -> Any: ...

    def __len__(self) -> int: ...

# DataLoader arguments that describe batching; the rest pass through unchanged.
_BATCHING = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "generator")


def make_loader(ds: BatchReader, **kwargs: Any) -> Any:
    _check_workers_can_import(ds, kwargs)
    collate = kwargs.get("collate_fn")
    pad = collate if isinstance(collate, PadCollate) else None  # fused into the gather: pads from the heaps
    if pad is not None:
        pad.check_fields(set(ds.fields))
    if ds.stream:
        return StreamLoader(ds, pad, **kwargs)
    if (collate is not None and pad is None) or not ds.reads_batches:
        return DataLoader(ds, **kwargs)  # type: ignore[arg-type]
    batch_size = kwargs.pop("batch_size", 1)
    shuffle = kwargs.pop("shuffle", False)
    sampler = kwargs.pop("sampler", None)
    batch_sampler = kwargs.pop("batch_sampler", None)
    drop_last = kwargs.pop("drop_last", False)
    generator = kwargs.pop("generator", None)
    kwargs.pop("collate_fn", None)
    if batch_sampler is None:
        if batch_size is None:
            return DataLoader(ds, batch_size=None, shuffle=shuffle, sampler=sampler, generator=generator,  # type: ignore[arg-type]
                              **kwargs)
        if sampler is None:
            sampler = RandomSampler(ds, generator=generator) if shuffle else SequentialSampler(ds)
        elif shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if type(sampler) in (RandomSampler, SequentialSampler) or hasattr(sampler, "epoch_indices"):
            batch_sampler = _ArrayBatches(sampler, batch_size, drop_last)
        else:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
    elif batch_size != 1 or shuffle or sampler is not None or drop_last:
        raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last")
    # The generator also goes to the outer DataLoader: it draws the workers' base seed from it before the sampler
    # draws the permutation, exactly as DataLoader(ds, generator=...) does, so both shuffle alike.
    trusted = isinstance(batch_sampler, _ArrayBatches)  # its batches are int64 arrays of valid indices
    return _GatherLoader(
        _Batches(ds, pad, trusted), batch_size=None, sampler=_EpochBatches(batch_sampler, ds), collate_fn=_identity,
        generator=generator, **kwargs
    )


class _GatherLoader(DataLoader):
    """The DataLoader ``ds.loader`` returns. Without workers (and without pinning), iterating it skips
    DataLoader's per-batch machinery (a profiler record per batch, a fetcher, the collate indirection): about
    half the time of a batch of tiny rows. It yields the same batches, after the same random draws (the base seed
    DataLoader draws from the generator, then the sampler's); with workers, it is DataLoader."""

    def __iter__(self) -> Any:
        if self.num_workers or self.pin_memory:
            return super().__iter__()
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        keys = iter(self.sampler)
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)  # DataLoader's base seed
        dataset = self.dataset
        for key in keys:
            yield dataset[key]


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


class _ArrayBatches(BatchSampler):
    """``BatchSampler`` over torch's own finite samplers (and ``ShareSampler``), yielding numpy arrays: the epoch's
    indices are drawn as one array (``epoch_indices``) instead of one Python ``next`` per index, in exactly the
    order (and with the same random draws) that ``BatchSampler(sampler, ...)`` would produce."""

    def __iter__(self) -> Iterator[np.ndarray]:  # type: ignore[override]
        indices = epoch_indices(self.sampler)
        count = len(indices)
        size = self.batch_size
        stop = count - count % size if self.drop_last else count
        for start in range(0, stop, size):
            yield indices[start:start + size]


def epoch_indices(sampler: Any) -> np.ndarray:
    """The indices ``iter(sampler)`` would yield, as one int64 array.

    ``RandomSampler`` draws exactly as its ``__iter__`` does (torch 2.x): a seed from the global generator when it
    has none of its own, then one ``randperm`` per pass over the data plus one for the remainder (without
    replacement), or ``randint`` in chunks of 32 (with): the same calls on the same generator, so the same order
    and the same generator state afterwards, without turning each index into a Python int.
    """
    own = getattr(sampler, "epoch_indices", None)  # ShareSampler: the epoch as one array
    if own is not None:
        return own()
    if type(sampler) is SequentialSampler:
        return np.arange(len(sampler), dtype=np.int64)
    if type(sampler) is RandomSampler:
        n, count = len(sampler.data_source), sampler.num_samples
        generator = sampler.generator
        if generator is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator()
            generator.manual_seed(seed)
        if sampler.replacement:
            parts = [torch.randint(high=n, size=(32,), dtype=torch.int64, generator=generator)
                     for _ in range(count // 32)]
            parts.append(torch.randint(high=n, size=(count % 32,), dtype=torch.int64, generator=generator))
        else:
            parts = [torch.randperm(n, generator=generator) for _ in range(count // n)]
            parts.append(torch.randperm(n, generator=generator)[:count % n])
        return torch.cat(parts).numpy().astype(np.int64, copy=False)
    return np.fromiter(iter(sampler), np.int64, count=len(sampler))


class _EpochBatches(Sampler):
    """Yields ``(epoch, indices)``: the epoch is read in the main process when iteration starts, so the variant
    choice reaches persistent workers too."""

    def __init__(self, batch_sampler: Any, ds: BatchReader) -> None:
        self.batch_sampler = batch_sampler
        self.ds = ds

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        epoch = self.ds.epoch
        for batch in self.batch_sampler:
            yield epoch, batch

    def __len__(self) -> int:
        return len(self.batch_sampler)


class _Batches(Dataset):
    """Maps ``(epoch, indices)`` to the collated batch."""

    def __init__(self, ds: BatchReader, pad: PadCollate | None = None, trusted: bool = False) -> None:
        self.ds = ds
        self.pad = pad
        self.trusted = trusted

    def __getitem__(self, key: tuple[int, list[int]]) -> Any:
        epoch, indices = key
        return self.ds.read_batch(indices, epoch, self.pad, trusted=self.trusted)

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
