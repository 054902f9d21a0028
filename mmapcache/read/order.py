"""The order of ``ds.loader()``'s batches: which indices each epoch reads in this process, and where a resumed
epoch starts.

``BatchOrder`` is the sampler of the loader's DataLoader; it yields ``(epoch, indices)``, one batch at a time. Which
order:

- a ``sampler`` or ``batch_sampler`` the user passed: theirs, in this process only (they decide the split);
- otherwise, in a distributed job (an initialised process group, torchrun's or SLURM's environment, or the
  loader's ``rank``/``world_size``) of more than one process: exactly ``DistributedSampler(ds, shuffle=shuffle,
  seed=seed)`` with its ``set_epoch``: the same permutation of ``(seed, epoch)`` on every rank, padded by repeating
  its start to a multiple of the ranks, rank ``r`` taking positions ``r, r + W, ...``; batches cut from that;
- otherwise, with a ``generator``, ``RandomSampler(ds, generator=g)`` drawn as ``DataLoader(ds, shuffle=True,
  generator=g)`` draws it (the same calls on ``g``); without one, the one-process case of the above: the seeded
  permutation of ``(seed, epoch)``, whole. ``shuffle=False``: ``SequentialSampler``'s order.

The own shuffle's epoch ``e`` is always ``(seed, e)``'s order after ``set_epoch(e)`` (the loader's, a user
sampler's or the dataset's), in any process, however often. An epoch read again with no ``set_epoch`` since its last
pass is a permutation of ``(seed, epoch, pass)``, ``pass`` counting those passes by this process's loaders of the
dataset: a loop that never calls ``set_epoch``, or makes a loader per epoch, still gets a new order each time, as
with ``DataLoader(shuffle=True)``, and a restarted process reads them again from the first. So an epoch's order is
never of torch's global generator: a job restarted at an epoch's end (PyTorch Lightning restores no loader state
there, only calls ``set_epoch``) reads the epochs the uninterrupted job would have, seeded or not.

It is a ``DistributedSampler`` (by class; its attributes describe the current split): trainers that give a
loader's sampler to ``DistributedSampler`` unless it is one (PyTorch Lightning's ``use_distributed_sampler``) leave
it alone, and their ``set_epoch`` reaches it (it also sets the dataset's epoch, which picks variants).

A pass is drawn when its first batch is asked for, not at ``iter()``, also with workers (``CacheLoader`` starts
its DataLoader iterator then): a ``set_epoch`` between ``iter()`` and the first batch counts (PyTorch Lightning
calls it there on resume, after ``iter()``).

Resume (``ds.loader().state_dict()``, ``read.loader_state``): the order of a pass is a function of what it was drawn
from, recorded just before the draw as a ``read.resume.EpochStart``. A loaded state of a pass in flight (a
``read.resume.Resume``) is taken up by the next pass of its epoch: drawn again from its start, skipping the batches
already yielded, so it yields exactly what the interrupted pass had left (nothing, for a state taken after its last
batch) and leaves a generator of the loader's or the sampler's where the uninterrupted pass left it (torch's global
generator, which a sampler without one draws from, is put back as the resumed process had it). If the epoch is set
to another first (a trainer that moves on from a state taken after an epoch's last batch), the interrupted pass is
settled instead (``BatchOrder.settle``: its draw made again, for the generators) and the new epoch drawn as the
uninterrupted loader would have drawn it.
"""

from __future__ import annotations

import itertools
import math
import weakref
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
from .draws import epoch_indices, global_order
from .epoch_split import interleaved
from .lengths import by_length
from .resume import (
    EpochStart,
    Resume,
    draws_globally,
    global_rng,
    has_epoch,
    restore_sampler,
    sampler_state,
)

__all__ = ["BatchOrder", "epoch_indices"]


class _Ordered(Protocol):
    """What the order needs of the dataset (``MmapCachedDataset`` provides it)."""

    seed: int
    epoch_sets: int  # set_epoch calls in this process

    @property
    def epoch(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def restore_epoch(self, epoch: int) -> None: ...

    def __len__(self) -> int: ...


# The last pass drawn of each (epoch, rank, world size) by the own shuffles of a dataset's loaders in this process,
# with the dataset's count of set_epoch calls then: a loader made anew for an epoch already read, with no set_epoch
# since, draws its next pass, as one loader iterated again does (a loop that makes a loader per epoch and never calls
# set_epoch still reshuffles); after a set_epoch, pass 0. A new process starts at pass 0: a restart reads the same
# order.
_passes: weakref.WeakKeyDictionary[Any, dict[tuple[int, int, int], tuple[int, int]]] = weakref.WeakKeyDictionary()

# Samplers that give every process the whole dataset: in a distributed job, every rank would read it all.
_WHOLE = (RandomSampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler)


class BatchOrder(DistributedSampler):
    """The batches of ``ds.loader()``, one ``(epoch, indices)`` per batch (see the module docstring).

    Args:
        ds: the cache.
        batch_size: indices per batch; None yields single indices (``DataLoader(batch_size=None)``).
        shuffle, drop_last, generator: as ``DataLoader``'s.
        sampler, batch_sampler: a user's sampler or batch sampler (then ``shuffle`` is False).
        rank, world_size: this process's place in the job (default: found per epoch, ``job_rank_and_size``).
        seed: the own shuffle's seed, the same on every rank (default: the dataset's ``seed``).
        group_by_length: a field whose lengths (``ds.lengths``) order each run of ``group_size`` positions of the
            own order longest first, before the split; ``group_size`` defaults to 50 steps of the job (50 x batch
            size x ranks).
    """

    def __init__(self, ds: _Ordered, *, batch_size: int | None, shuffle: bool, drop_last: bool, generator: Any,
                 sampler: Any = None, batch_sampler: Any = None, rank: int | None = None,
                 world_size: int | None = None, seed: int | None = None, group_by_length: str | None = None,
                 group_size: int | None = None) -> None:
        # DistributedSampler.__init__ is not called: it fixes the split now, and here it is found per epoch.
        self.ds = ds
        self.dataset = ds  # type: ignore[assignment]
        self.batch_size, self.shuffle, self.drop_last = batch_size, bool(shuffle), bool(drop_last)
        self.user_sampler, self.user_batch_sampler = sampler, batch_sampler
        self.seed = ds.seed if seed is None else int(seed)
        self.generator = generator  # a user's: the order's, and DataLoader's for its workers' base seeds
        if (rank is None) != (world_size is None):
            raise TypeError("ds.loader() takes both rank= and world_size=, or neither (to find them in the job)")
        if world_size is not None and not 0 <= rank < world_size:  # type: ignore[operator]
            raise ValueError(f"rank {rank} of {world_size}: need 0 <= rank < world_size")
        self._placement = None if rank is None else (int(rank), int(world_size))  # type: ignore[arg-type]
        self.trusted = sampler is None and batch_sampler is None  # our own indices: int64 arrays, in range
        self.started: EpochStart | None = None  # the epoch being iterated, as drawn
        self.skipped = 0  # the batches of ``started`` skipped by a resume (yielded before the interruption)
        # Where the pass in flight started in the epoch's order (positions the job had read: a resume of another
        # job's state, read.epoch_split), the job size whose rule drew that order (None: this one's), and how many
        # batches the pass has from there.
        self.base, self.pass_batches = 0, 0
        self.drawn_by: int | None = None
        self.draws_base_seed = False  # set by a loader without workers: draw DataLoader's workers' base seed first
        self.group_field, self.group_given = group_by_length, group_size
        self.drawn_group: int | None = None  # the group size the pass in flight was drawn with (a resumed one's)
        self.resume: Resume | None = None  # set by CacheLoader.load_state_dict
        self.sets_seen = ds.epoch_sets  # the dataset's set_epoch count when this order was made or last began a pass
        self._warned = False
        self._warned_share = False  # (ds.loader() without a sampler over a node share)
        self._epochs = self._epoch_pair()  # (the dataset's, the user sampler's) when last in step

    def over(self, sampler: Any) -> BatchOrder:
        """This order's batching over another sampler's indices (for a trainer that rebuilds the loader with its
        own sampler)."""
        if self.user_batch_sampler is not None:
            raise TypeError(f"this loader's batches come from its batch_sampler; it cannot take another sampler "
                            f"({type(sampler).__name__}): build a new ds.loader(sampler=...) instead")
        rank, size = self._placement if self._placement is not None else (None, None)
        return BatchOrder(self.ds, batch_size=self.batch_size, shuffle=False, drop_last=self.drop_last,
                          generator=None, sampler=sampler, rank=rank, world_size=size, seed=self.seed)

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
        """Indices this process reads per epoch (``DistributedSampler``'s meaning; with a user's batch sampler,
        those of its sampler, which it need not use whole)."""
        if self.user_batch_sampler is not None:
            return len(getattr(self.user_batch_sampler, "sampler", self.ds))
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
        if self.draws_base_seed and not (resume is not None and resume.same_epoch):
            # (Not for the rest of a pass: the loader that saved it drew as the pass began, before its state and a
            # trainer's checkpoint of torch's generators were taken, so a resumed run's random numbers go on as the
            # uninterrupted run's did.)
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        self.sets_seen = self.ds.epoch_sets
        if resume is None:
            start = self.start()
        elif resume.same_epoch:
            start = resume.start
            self.restore(start)
        else:  # between passes, with persistent workers: the generators put back after the workers' base seed
            self.restore(resume.start, epoch=False)
            start = self.start()
        skip = resume.skip if resume is not None and resume.same_epoch else 0
        # Read from another position of the order than a whole number of this job's batches (read.epoch_split): a
        # state of another number of ranks or batch size, or of a pass that itself resumed one.
        elastic = resume is not None and resume.same_epoch and resume.offset is not None
        self.base = resume.offset if elastic and resume.offset is not None else 0  # type: ignore[union-attr]
        self.drawn_by = resume.world if elastic else None  # type: ignore[union-attr]
        self.drawn_group = resume.group if elastic else None  # type: ignore[union-attr]
        self.started, self.skipped = start, skip
        self.record_draw(start.epoch, start.repeat)
        # A resumed epoch whose sampler drew from torch's global generator draws again from the recorded state.
        again = start.rng if resume is not None and resume.same_epoch else None
        if self.user_batch_sampler is not None:
            batches: Any = (np.asarray(b, dtype=np.int64) for b in self.user_batch_sampler)
            if again is not None:
                with global_rng(again):
                    batches = list(batches)
        else:
            with global_rng(again):
                indices = self._indices(start, self.base, self.drawn_by, self.drawn_group)
            size = self.batch_size
            if size is None:
                batches = indices.tolist()
            else:
                stop = len(indices) - len(indices) % size if self.drop_last else len(indices)
                batches = [indices[a:a + size] for a in range(0, stop, size)]
            self.pass_batches = len(batches)
        yield from zip(itertools.repeat(start.epoch), itertools.islice(batches, skip, None))

    def settle(self) -> None:
        """Before a pass draws anything: a loaded state of a pass in flight whose epoch is no longer the current one
        (set to another since) is not resumed; its pass is drawn again, unread, so that the generators it drew from
        are where the uninterrupted loader left them, and the next pass is drawn as that loader's would be."""
        resume = self.resume
        if resume is None or not resume.same_epoch:
            return
        self._sync_epoch()
        if resume.start.epoch == self.epoch:
            return
        self.resume = None
        self.restore(resume.start, epoch=False)
        with global_rng(resume.start.rng):  # a sampler without a generator: this process's own is left alone
            if self.user_batch_sampler is not None:
                for _ in self.user_batch_sampler:
                    pass
            elif not self.own or (self.shuffle and self.generator is not None and
                                  (resume.world or self.placement()[1]) == 1):
                self._indices(resume.start, world=resume.world, group=resume.group)

    def start(self) -> EpochStart:
        """What this epoch is drawn from, recorded before the draw (``read.resume``)."""
        self._sync_epoch()
        generator = self._generator()
        return EpochStart(self.epoch, None if generator is None else generator.get_state(),
                          sampler_state(self._chosen()), self._repeat(self.epoch),
                          torch.get_rng_state() if not self.own and draws_globally(self._chosen()) else None)

    def current(self) -> EpochStart | None:
        """The epoch being iterated, unless the epoch has been set to another since it started (a loop that broke
        out of it and went on to the next)."""
        self._sync_epoch()
        return self.started if self.started is not None and self.started.epoch == self.epoch else None

    def _repeat(self, epoch: int) -> int:
        """The pass of ``epoch`` its next iteration draws (the loader's own shuffle; 0 for other orders): the one
        after the last drawn in this process, unless ``set_epoch`` was called since."""
        if not (self.own and self.shuffle):
            return 0
        last = _passes.get(self.ds, {}).get((epoch, *self.placement()))
        return last[0] + 1 if last is not None and last[1] == self.ds.epoch_sets else 0

    def record_draw(self, epoch: int, repeat: int) -> None:
        """Records that pass ``repeat`` of ``epoch`` was drawn (or, from a loaded state, had been: ``repeat`` -1
        for none, the next drawn is pass 0)."""
        if self.own and self.shuffle:
            _passes.setdefault(self.ds, {})[(epoch, *self.placement())] = (repeat, self.ds.epoch_sets)

    def restore(self, start: EpochStart, epoch: bool = True) -> None:
        """Puts the generator and the user's sampler back where they were when ``start`` was recorded, and with
        ``epoch`` the dataset's epoch."""
        if epoch:
            self.ds.restore_epoch(start.epoch)
        generator = self._generator()
        if generator is not None and start.generator is not None:
            generator.set_state(start.generator)
        restore_sampler(self._chosen(), start.sampler, epoch)
        self._epochs = self._epoch_pair()

    def _chosen(self) -> Any:
        """The user's sampler or batch sampler, or None."""
        return self.user_sampler if self.user_sampler is not None else self.user_batch_sampler

    def _sampler(self) -> Any:
        """The user's sampler, or their batch sampler's, or None."""
        if self.user_sampler is not None:
            return self.user_sampler
        return getattr(self.user_batch_sampler, "sampler", None)

    def _epoch_sampler(self) -> Any:
        """The user's sampler that has an epoch (``DistributedSampler``, ``ds.sampler()``), or None."""
        sampler = self._sampler()
        return sampler if has_epoch(sampler) else None

    def _epoch_pair(self) -> tuple[int, int] | None:
        sampler = self._epoch_sampler()
        return None if sampler is None else (self.epoch, sampler.epoch)

    def _sync_epoch(self) -> None:
        """Brings the dataset's epoch and a user sampler's into step before a draw, whichever was set: the
        sampler's own ``set_epoch`` (the usual ``DistributedSampler`` loop) then also picks the dataset's variants,
        and ``ds.set_epoch`` also reaches the sampler. Set both, differently, and the sampler's counts."""
        sampler, last = self._epoch_sampler(), self._epochs
        if sampler is None or last is None:
            return
        ours, theirs = self.epoch, sampler.epoch
        if ours != theirs:
            if theirs == last[1]:  # only the dataset's epoch moved
                sampler.set_epoch(ours)
            else:
                self.ds.set_epoch(theirs)
        self._epochs = self._epoch_pair()

    def _generator(self) -> Any:
        """The generator the epoch's order is drawn from: ours, or a user sampler's."""
        if self.own:
            return self.generator
        sampler = self._sampler()
        return getattr(sampler, "generator", None)

    def _indices(self, start: EpochStart, offset: int = 0, world: int | None = None,
                 group: int | None = None) -> np.ndarray:
        """This process's indices of the epoch ``start`` describes, in reading order (int64): of a user's sampler,
        or its part of the own order from position ``offset`` on, the order drawn as a job of ``world`` ranks draws
        it (default: this job's; another for a state saved by another number of ranks: ``read.epoch_split``), its
        runs of ``group`` positions sorted by length with ``group_by_length`` (default: this loader's size)."""
        n, epoch = len(self.ds), start.epoch
        if not self.own:
            return epoch_indices(self.user_sampler)
        rank, size = self.placement()
        share = getattr(self.ds, "share", None)
        if share is not None and share.nodes > 1 and not self._warned_share:
            self._warned_share = True
            warn(f"ds.loader() without a sampler over the node share at {getattr(self.ds, 'path', '?')}: it splits "
                 f"each epoch across the job's ranks, so about {share.nodes - 1} in {share.nodes} of this rank's "
                 "samples lie outside this node's share and are computed from the source every epoch; pass "
                 "sampler=ds.sampler(shuffle=True), which keeps each rank on its node's share", DistributedOrderWarning)
        drawn = size if world is None else world
        if drawn > 1 and self.shuffle and start.repeat and not self._warned:
            self._warned = True
            warn(f"ds.loader(shuffle=True) in a job of {drawn} processes read epoch {epoch}'s order again: as with "
                 "DistributedSampler, the order changes with the epoch; call loader.sampler.set_epoch(epoch) (or "
                 "ds.set_epoch(epoch)) before each epoch", DistributedOrderWarning)
        order = global_order(n, shuffle=self.shuffle, seed=self.seed, epoch=epoch, repeat=start.repeat, world=drawn,
                             generator=self.generator)
        if self.group_field is not None:
            lengths = self.ds.lengths(self.group_field, epoch)  # type: ignore[attr-defined]
            order = by_length(order, lengths, group or self.group_for(drawn, self.batch_size) or 1)
        return interleaved(order, offset, rank, size)

    def group_for(self, world: int, batch_size: int | None) -> int | None:
        """The length groups' size in a job of ``world`` ranks with batches of ``batch_size`` (None: no grouping)."""
        if self.group_field is None:
            return None
        return self.group_given or 50 * (batch_size or 1) * world

    def batches_for(self, world: int, batch_size: int | None) -> int:
        """Batches per epoch of the own order in a job of ``world`` ranks with batches of ``batch_size``."""
        count = math.ceil(len(self.ds) / world)
        if batch_size is None:
            return count
        return count // batch_size if self.drop_last else math.ceil(count / batch_size)

    def _warn_if_whole(self) -> None:
        """Warns (once) when a user's sampler gives every rank of a distributed job the whole dataset."""
        sampler = self._sampler()
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
