"""Cooperative filling of a node-local cache by the processes (ranks) of a distributed job.

Every rank of a node opens the same cache path (on the node's own ``/dev/shm``), so a node holds one copy that
its ranks share; nothing crosses the network, and each node of a multi-node job builds its own copy. Creation
races between ranks are settled by the store (a ``flock`` on the parent directory, then an atomic rename): all
ranks end up on one cache. ``prefill`` then splits the cacheable samples between the ranks of the node, so each
sample is computed once per node instead of once per rank, and waits for the others before the first epoch.

Which ranks share a node comes from, in order: the ``rank``/``world_size`` arguments; torchrun's
``LOCAL_RANK``/``LOCAL_WORLD_SIZE``; an initialised ``torch.distributed`` process group (ranks are grouped by
host name and by the identity of the cache's parent directory, one collective call); SLURM's ``SLURM_LOCALID``/
``SLURM_NTASKS_PER_NODE``; otherwise this process is alone (``store.share.local_rank_and_size``). The public face
of this module is ``mmapcache.distributed``.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..store.share import checked_rank, initialised_dist, local_rank_and_size


class Fillable(Protocol):
    """What ``prefill`` needs of a dataset (``MmapCachedDataset`` provides it)."""

    path: str

    def cacheable_indices(self) -> np.ndarray: ...

    def missing_indices(self, indices: Sequence[int] | np.ndarray | None = None) -> np.ndarray: ...

    def fill(self, indices: Sequence[int] | np.ndarray | None = None) -> int: ...

    @property
    def uncached_by_heap(self) -> int: ...

__all__ = ["DEFAULT_PATIENCE", "prefill"]

# How long the cache-based barrier (no process group) waits without seeing any new sample filled before it
# concludes that a peer died or was never started, and fills what is left itself.
DEFAULT_PATIENCE = 60.0
_POLL = 0.05
# Without progress for this long after a heap ran out of room, the rest is taken as unstorable (see _wait_filled):
# a few of fill()'s batches (each of about 0.5 s of the source's time at most: fill.contents).
_HEAP_FULL_PATIENCE = 2.0


def prefill(
    ds: Fillable,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    barrier: bool = True,
    patience: float = DEFAULT_PATIENCE,
) -> int:
    """Fills the cache cooperatively: each process of the node computes its own disjoint share of the samples
    the next epoch reads, then (``barrier=True``) waits until the others are done.

    Call it on every rank after opening the cache and before the first epoch; the ranks of a node then compute
    each sample once in total. Samples already filled are skipped, so calling it on a warm cache is cheap.

    Args:
        ds: the cache, opened with its source dataset on every rank (same path on the node).
        rank: this process's index among the processes sharing the cache; default from the environment (see
            ``local_rank_and_size``). Give both ``rank`` and ``world_size`` or neither.
        world_size: the number of processes sharing the cache (the ranks of one node, not of the job).
        barrier: wait for the others at the end. With an initialised ``torch.distributed`` process group this is
            ``torch.distributed.barrier()`` (all ranks of the job); without one, the cache is the barrier: wait
            until every sample is filled, and fill the rest ourselves if no progress is seen for ``patience``
            seconds (a peer that crashed or was never started).
        patience: see ``barrier``.

    Returns:
        How many samples this process computed and stored.

    Safe across processes: every sample is published under the cache's writer lock, so overlapping shares
    (wrong ``rank``/``world_size``) cost duplicate work, never a wrong sample.
    """
    if (rank is None) != (world_size is None):
        raise TypeError("prefill() takes both rank= and world_size=, or neither (to read them from the environment)")
    if rank is None:
        rank, world_size = local_rank_and_size(ds.path)
    else:
        rank, world_size = checked_rank(_as_int(rank, "rank"), _as_int(world_size, "world_size"), "rank/world_size")
    if isinstance(patience, bool) or not isinstance(patience, (int, float)) or patience < 0:
        raise ValueError(f"patience must be a number of seconds >= 0, got {patience!r}")
    indices = ds.cacheable_indices()
    uncached = ds.uncached_by_heap
    stored = ds.fill(indices[rank::world_size])
    if not barrier:
        return stored
    dist = initialised_dist()
    if dist is not None:
        dist.barrier()
        return stored
    return stored + _wait_filled(ds, indices, patience, uncached)


def _wait_filled(ds: Fillable, indices: np.ndarray, patience: float, uncached: int) -> int:
    """Waits until the rows the next epoch reads are all filled; fills the rest after ``patience`` idle seconds,
    or returns after ``_HEAP_FULL_PATIENCE`` if a heap ran out of room since the prefill began (``uncached``: the
    samples served uncached before it; a heap full once, long ago, says nothing of what a peer stores now)."""
    missing_count = -1
    last_progress = time.monotonic()
    while True:
        missing = ds.missing_indices(indices)
        if len(missing) == 0:
            return 0
        now = time.monotonic()
        if len(missing) != missing_count:
            missing_count, last_progress = len(missing), now
        elif now - last_progress >= patience:
            return ds.fill(missing)
        elif now - last_progress >= _HEAP_FULL_PATIENCE and ds.uncached_by_heap > uncached:
            return 0  # a heap ran out of room (max_bytes): what is missing may never be stored; don't wait for it
        time.sleep(_POLL)


def _as_int(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
