"""``ds.sampler()``: the distributed sampler of a cache, which keeps each rank on what its node holds.

For a cache that holds a node share (``node_share=True``), each epoch:

1. this node's share of the epoch's generation is shuffled with ``(seed, epoch)`` (every rank of the node draws
   the same order);
2. it is padded by repeating its own start (or cut, with ``drop_last``) to ``L * per_rank`` indices, where ``L``
   is the number of ranks on the node and ``per_rank = ceil(N / W)`` (``floor`` with ``drop_last``) for the job's
   ``W`` ranks, exactly as ``DistributedSampler`` sizes ranks, so every rank of every node takes the same number
   of steps;
3. local rank ``r`` reads positions ``r, r + L, ...`` of it.

So every index of the dataset is read once per epoch across the job (plus ``DistributedSampler``'s padding: at
most ``W`` repeated reads, each from the node that holds the index), a rank never reads outside its node's share,
and a global batch is a stratified sample of the dataset: each node contributes a random batch of its share.

For a cache without a share (a full copy on every node) it is ``DistributedSampler`` over the job's ranks: rank
``R`` of ``W`` reads positions ``R, R + W, ...`` of the padded shuffled ``0 .. N-1``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
from torch.utils.data import Sampler

from ..store.share import Share, env_int, job_rank_and_size

__all__ = ["ShareSampler"]


class _Cache(Protocol):
    path: str

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    @property
    def share(self) -> Share | None: ...


class ShareSampler(Sampler[int]):
    """The indices one rank reads each epoch (see the module docstring). Made by ``MmapCachedDataset.sampler``.

    Args:
        ds: the cache.
        shuffle: shuffle each epoch (seeded by ``seed`` and the epoch), else read in index order.
        seed: the shuffle's seed; the same on every rank.
        drop_last: cut each rank to ``floor(N / W)`` indices instead of padding to ``ceil(N / W)``.
        rank, world_size: this process's rank among the ranks reading the cache and their number: for a node
            share, the *local* rank and the ranks on this node (default: ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, SLURM's,
            or the process group's, as ``prefill`` finds them); for a full copy, the job's rank and world size
            (default: an initialised process group's, else ``RANK``/``WORLD_SIZE`` or SLURM's).

    ``set_epoch(e)`` selects the epoch's order, and sets the dataset's epoch too (which a rotating share needs to
    map indices to rows). ``epoch_indices()`` returns the epoch's indices as one array (what ``ds.loader`` uses).
    """

    def __init__(self, ds: _Cache, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 rank: int | None = None, world_size: int | None = None) -> None:
        self.ds = ds
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.length = len(ds)
        self.share = ds.share
        if (rank is None) != (world_size is None):
            raise TypeError("sampler() takes both rank= and world_size=, or neither (to read them from the "
                            "environment)")
        if rank is None:
            rank, world_size = _local(ds.path) if self.share is not None else job_rank_and_size()
        elif self.share is not None and self.share.nodes > 1:
            _refuse_job_place(rank, world_size)
        assert world_size is not None  # both given or both found
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of {world_size}: need 0 <= rank < world_size")
        self.rank, self.world_size = int(rank), int(world_size)
        ranks = self.world_size * (self.share.nodes if self.share is not None else 1)
        self.per_rank = self.length // ranks if drop_last else math.ceil(self.length / ranks)
        if self.per_rank == 0:
            raise ValueError(f"{self.length} samples over {ranks} ranks with drop_last=True leaves none per rank")
        self.epoch = 0
        self._pool: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order ``__iter__`` yields next; also ``ds.set_epoch(epoch)``."""
        self.epoch = int(epoch)
        self.ds.set_epoch(epoch)

    def epoch_indices(self) -> np.ndarray:
        """This rank's indices of the current epoch, in reading order (int64)."""
        share = self.share
        if share is None:
            pool = np.arange(self.length, dtype=np.int64)
        else:
            generation = share.generation(self.epoch)
            if self._pool[0] != generation:  # drawn once per generation, not per epoch
                self._pool = (generation, share.indices(self.length, generation))
            pool = self._pool[1]
        if self.shuffle:
            pool = pool[np.random.default_rng([self.seed, self.epoch]).permutation(len(pool))]
        total = self.per_rank * self.world_size
        pool = np.resize(pool, total)  # pads by repeating the start, or cuts (drop_last)
        return pool[self.rank::self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_indices().tolist())

    def __len__(self) -> int:
        return self.per_rank


def _refuse_job_place(rank: int, world_size: Any) -> None:
    """A node share's sampler given the job's rank and size where the launcher's variables say this node's differ
    (``DistributedSampler(num_replicas=WORLD_SIZE, rank=RANK)``'s habit): each node's ranks would read only part of
    its share, and the job part of the data, silently."""
    env = os.environ
    for job, local in ((("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")),
                       (("SLURM_PROCID", "SLURM_NTASKS"), ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"))):
        if not all(name in env for name in (*job, *local)):
            continue
        job_place, local_place = (env_int(job[0]), env_int(job[1])), (env_int(local[0]), env_int(local[1]))
        if (rank, world_size) == job_place != local_place:
            raise ValueError(
                f"sampler(rank={rank}, world_size={world_size}) on a node share takes this node's ranks, not the "
                f"job's ({job[0]}/{job[1]}): here rank={local_place[0]}, world_size={local_place[1]} "
                f"({local[0]}/{local[1]}); or leave both out, to read them from the environment")


def _local(path: str) -> tuple[int, int]:
    from ..store.share import local_rank_and_size

    return local_rank_and_size(path)
