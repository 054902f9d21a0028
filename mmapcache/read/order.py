"""The order of ``ds.loader()``'s batches: which indices each epoch reads in this process, and where a resumed
epoch starts.

``BatchOrder`` is the sampler of the loader's DataLoader; it yields ``(epoch, indices)``, one batch at a time. The
epoch's order is drawn when its first batch is asked for (not when iteration starts), so a ``set_epoch`` between
``iter()`` and the first batch still counts (Lightning calls it there on resume). Which order:

- a ``sampler`` or ``batch_sampler`` the user passed: theirs, in this process only (they decide the split);
- otherwise, in a distributed job (an initialised process group, torchrun's or SLURM's environment, or the
  loader's ``rank``/``world_size``) of more than one process: exactly ``DistributedSampler(ds, shuffle=shuffle,
  seed=seed)`` with its ``set_epoch``: the same permutation of ``(seed, epoch)`` on every rank, padded by repeating
  its start to a multiple of the ranks, rank ``r`` taking positions ``r, r + W, ...``; batches cut from that;
- otherwise ``RandomSampler(ds, generator=g)`` or ``SequentialSampler``, drawn as ``DataLoader(ds, shuffle=...,
  generator=g)`` draws them (the same calls on ``g``). Without a ``generator``, the loader makes its own, seeded
  once from torch's global generator when the loader is made: later epochs never depend on the global generator.

It is a ``DistributedSampler`` (by class; its attributes describe the current split): trainers that give a
loader's sampler to ``DistributedSampler`` unless it is one (PyTorch Lightning's ``use_distributed_sampler``) leave
it alone, and their ``set_epoch`` reaches it (it also sets the dataset's epoch, which picks variants).

Resume (``ds.loader().state_dict()``): the order of an epoch is a function of what it was drawn from: the epoch,
and the generator's state just before the draw (ours, or a user sampler's ``generator``; a user sampler with its own
``state_dict`` is asked for it; a ``DistributedSampler``-like one for its ``epoch``). ``EpochStart`` records those
when an epoch is drawn; a resumed epoch draws again from them and skips the batches already yielded, so it yields
exactly what the interrupted epoch had left, and leaves the generator where the uninterrupted epoch left it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import (
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from ..errors import DistributedOrderWarning, warn
from ..store.share import job_rank_and_size

__all__ = ["BatchOrder", "EpochStart", "epoch_indices"]


class _Ordered(Protocol):
    """What the order needs of the dataset (``MmapCachedDataset`` provides it)."""

    seed: int

    @property
    def epoch(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def __len__(self) -> int: ...


# Samplers that give every process the whole dataset: in a distributed job, every rank would read it all.
_WHOLE = (RandomSampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler)


@dataclasses.dataclass
class EpochStart:
    """What an epoch's order was drawn from: the dataset's epoch, and the states of the generator and of a user's
    sampler just before the draw."""

    epoch: int
    generator: torch.Tensor | None = None
    sampler: dict[str, Any] | None = None


class BatchOrder(DistributedSampler):
    """The batches of ``ds.loader()``, one ``(epoch, indices)`` per batch (see the module docstring).

    Args:
        ds: the cache.
        batch_size: indices per batch; None yields single indices (``DataLoader(batch_size=None)``).
        shuffle, drop_last, generator: as ``DataLoader``'s.
        sampler, batch_sampler: a user's sampler or batch sampler (then ``shuffle`` is False).
        rank, world_size: this process's place in the job (default: found per epoch, ``job_rank_and_size``).
        seed: the distributed shuffle's seed, the same on every rank (default: the dataset's ``seed``).
    """

    def __init__(self, ds: _Ordered, *, batch_size: int | None, shuffle: bool, drop_last: bool, generator: Any,
                 sampler: Any = None, batch_sampler: Any = None, rank: int | None = None,
                 world_size: int | None = None, seed: int | None = None) -> None:
        # DistributedSampler.__init__ is not called: it fixes the split now, and here it is found per epoch.
        self.ds = ds
        self.dataset = ds  # type: ignore[assignment]
        self.batch_size, self.shuffle, self.drop_last = batch_size, bool(shuffle), bool(drop_last)
        self.user_sampler, self.user_batch_sampler = sampler, batch_sampler
        self.seed = ds.seed if seed is None else int(seed)
        if shuffle and generator is None and sampler is None and batch_sampler is None:
            # One draw from the global generator now; every later epoch from this one (see the module docstring).
            generator = torch.Generator()
            generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        self.generator = generator
        if (rank is None) != (world_size is None):
            raise TypeError("ds.loader() takes both rank= and world_size=, or neither (to find them in the job)")
        if world_size is not None and not 0 <= rank < world_size:  # type: ignore[operator]
            raise ValueError(f"rank {rank} of {world_size}: need 0 <= rank < world_size")
        self._placement = None if rank is None else (int(rank), int(world_size))  # type: ignore[arg-type]
        self.trusted = sampler is None and batch_sampler is None  # our own indices: int64 arrays, in range
        self.started: EpochStart | None = None  # the epoch being iterated, as drawn
        self.resume: tuple[EpochStart, int] | None = None  # an epoch to draw again, and the batches to skip
        self._last: int | None = None  # the epoch of the last distributed shuffle (to warn of a repeat)
        self._warned = False

    # --- the split -----------------------------------------------------------------------------------------------

    def placement(self) -> tuple[int, int]:
        """``(rank, world_size)`` of this process for the loader's own order (ignored by a user's sampler)."""
        return self._placement if self._placement is not None else job_rank_and_size()

    @property
    def own(self) -> bool:
        return self.user_sampler is None and self.user_batch_sampler is None

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return self.placement()[1] if self.own else 1

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.placement()[0] if self.own else 0

    @property
    def epoch(self) -> int:
        return int(self.ds.epoch)

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.set_epoch(value)

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        """Indices this process reads per epoch (``DistributedSampler``'s meaning)."""
        if self.user_batch_sampler is not None:
            return sum(len(b) for b in self.user_batch_sampler)
        if self.user_sampler is not None:
            return len(self.user_sampler)
        return math.ceil(len(self.ds) / self.num_replicas)

    @property
    def total_size(self) -> int:  # type: ignore[override]
        return self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next order is drawn for: the dataset's epoch (it picks variants) and a user sampler's."""
        self.ds.set_epoch(epoch)
        for sampler in (self.user_sampler, getattr(self.user_batch_sampler, "sampler", None)):
            if sampler is not None and callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches per epoch in this process."""
        if self.user_batch_sampler is not None:
            return len(self.user_batch_sampler)
        count = self.num_samples
        if self.batch_size is None:
            return count
        return count // self.batch_size if self.drop_last else math.ceil(count / self.batch_size)

    # --- one epoch -------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if not self.own:
            self._warn_if_whole()
        resume, self.resume = self.resume, None
        start = resume[0] if resume is not None else self._start()
        if resume is not None:
            self._restore(start)
        self.started = start
        if self.user_batch_sampler is not None:
            batches: Any = (np.asarray(b, dtype=np.int64) for b in self.user_batch_sampler)
        else:
            indices = self._indices(start.epoch)
            size = self.batch_size
            if size is None:
                batches = iter(indices.tolist())
            else:
                stop = len(indices) - len(indices) % size if self.drop_last else len(indices)
                batches = (indices[a:a + size] for a in range(0, stop, size))
        skip = resume[1] if resume is not None else 0
        for number, batch in enumerate(batches):
            if number >= skip:
                yield start.epoch, batch

    def _start(self) -> EpochStart:
        """What this epoch is drawn from, recorded before the draw."""
        generator = self._generator()
        return EpochStart(self.epoch, None if generator is None else generator.get_state(),
                          _sampler_state(self.user_sampler or self.user_batch_sampler))

    def _restore(self, start: EpochStart) -> None:
        """Puts the generator and the user's sampler back where they were when ``start`` was recorded."""
        self.ds.set_epoch(start.epoch)
        generator = self._generator()
        if generator is not None and start.generator is not None:
            generator.set_state(start.generator)
        _restore_sampler(self.user_sampler or self.user_batch_sampler, start.sampler)

    def _generator(self) -> Any:
        """The generator the epoch's order is drawn from: ours, or a user sampler's."""
        if self.own:
            return self.generator
        sampler = self.user_sampler if self.user_sampler is not None else getattr(
            self.user_batch_sampler, "sampler", None)
        return getattr(sampler, "generator", None)

    def _indices(self, epoch: int) -> np.ndarray:
        """This process's indices of ``epoch``, in reading order (int64)."""
        n = len(self.ds)
        if not self.own:
            return epoch_indices(self.user_sampler)
        rank, size = self.placement()
        if size == 1:
            if not self.shuffle:
                return np.arange(n, dtype=np.int64)
            return epoch_indices(RandomSampler(range(n), generator=self.generator))
        if self.shuffle:
            if self._last == epoch and not self._warned:
                self._warned = True
                warn(f"ds.loader(shuffle=True) in a job of {size} processes read epoch {epoch}'s order again: as "
                     "with DistributedSampler, the order changes with the epoch; call loader.sampler.set_epoch(epoch) "
                     "(or ds.set_epoch(epoch)) before each epoch", DistributedOrderWarning)
            self._last = epoch
        return distributed_indices(n, rank, size, self.shuffle, self.seed, epoch)


    def _warn_if_whole(self) -> None:
        """Warns (once) when a user's sampler gives every rank of a distributed job the whole dataset."""
        sampler = self.user_sampler if self.user_sampler is not None else getattr(
            self.user_batch_sampler, "sampler", None)
        if self._warned or not isinstance(sampler, _WHOLE):
            return
        size = self.placement()[1]
        if size > 1:
            self._warned = True
            which = "sampler" if self.user_sampler is not None else "batch_sampler over a"
            warn(f"ds.loader({which} {type(sampler).__name__}) in a job of {size} processes: that sampler gives "
                 "every rank the whole dataset, so the ranks train on the same samples. Leave the sampler out "
                 "(ds.loader(shuffle=True) splits each epoch across the ranks), or pass ds.sampler() or a "
                 "DistributedSampler", DistributedOrderWarning)


def distributed_indices(n: int, rank: int, size: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """What ``DistributedSampler(dataset of n, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed)`` yields
    after ``set_epoch(epoch)`` (``drop_last=False``), as one int64 array: the same draws."""
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=generator).numpy().astype(np.int64, copy=False)
    else:
        order = np.arange(n, dtype=np.int64)
    total = math.ceil(n / size) * size
    order = np.resize(order, total)  # pads by repeating from the start, as DistributedSampler does
    return order[rank:total:size]


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


def _sampler_state(sampler: Any) -> dict[str, Any] | None:
    """What decides a user sampler's next order: its own ``state_dict``, else its generator's state and epoch."""
    if sampler is None:
        return None
    if callable(getattr(sampler, "state_dict", None)) and callable(getattr(sampler, "load_state_dict", None)):
        return {"state_dict": sampler.state_dict()}
    state: dict[str, Any] = {}
    inner = getattr(sampler, "sampler", None)  # a batch sampler's
    for name, obj in (("", sampler), ("sampler_", inner)):
        if obj is None:
            continue
        if isinstance(getattr(obj, "generator", None), torch.Generator):
            state[name + "generator"] = obj.generator.get_state()
        if callable(getattr(obj, "set_epoch", None)) and isinstance(getattr(obj, "epoch", None), int):
            state[name + "epoch"] = obj.epoch
    return state


def _restore_sampler(sampler: Any, state: dict[str, Any] | None) -> None:
    if sampler is None or not state:
        return
    if "state_dict" in state:
        sampler.load_state_dict(state["state_dict"])
        return
    inner = getattr(sampler, "sampler", None)
    for name, obj in (("", sampler), ("sampler_", inner)):
        if obj is None:
            continue
        if name + "generator" in state:
            obj.generator.set_state(state[name + "generator"])
        if name + "epoch" in state:
            obj.set_epoch(state[name + "epoch"])
