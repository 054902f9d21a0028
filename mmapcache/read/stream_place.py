"""Where a reader of a stream is: its rank in the job, and its place among the ranks of the node whose ring it
reads (``store.split``), or why it cannot read that ring (a stream keeps the shape of the job that made it)."""

from __future__ import annotations

import numpy as np

from ..errors import CacheMismatchError
from ..store.ring import Ring

__all__ = ["reader_place"]

_MAX_RANKS = 256  # readers of one node's ring: two words each in ring.u64 (format.spec)


def reader_place(ring: Ring, rank: int | None, world_size: int | None) -> tuple[int, int, int, int]:
    """``(job rank, job size, local rank, local ranks)`` of a reader of ``ring``: its rank in the job (``rank=``/
    ``world_size=``, else the job's: ``store.share.job_rank_and_size``), and its place among the ranks of the node
    whose ring this is (``store.split``: all of them on one node).

    Raises:
        CacheMismatchError: the stream was made for another job: another number of nodes or ranks, or another node
            (its ring holds other positions), or one node's stream read by a job of several nodes (found in the
            environment), whose nodes would each compute the whole order.
        ValueError, TypeError: a rank outside the world size; one of ``rank``/``world_size`` without the other.
    """
    from ..store.share import job_rank_and_size, node_of_process

    if (rank is None) != (world_size is None):
        raise TypeError("ds.loader() takes both rank= and world_size=, or neither (for the environment's)")
    found = rank is None
    if rank is None or world_size is None:
        rank, world_size = job_rank_and_size()
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {value!r}")
    rank, world_size = int(rank), int(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of {world_size}: need 0 <= rank < world_size")
    split, path = ring.split, ring.store.path
    if split.nodes == 1:
        nodes = node_of_process()[1] if found and world_size > 1 else 1
        if nodes > 1:
            raise CacheMismatchError(
                f"the stream at {path} holds every position of the order, for a job of one node, but this process is "
                f"rank {rank} of a job of {nodes} nodes: each node would compute the whole order for its ranks' part "
                f"of it. Remove it (`mmapcache rm {path}`) and let the job create it (its ranks open it with "
                "stream=True: each node's then holds its ranks' part), or pass rank= and world_size= to read it as "
                "one node's ranks")
        if world_size > _MAX_RANKS:
            raise ValueError(f"a stream has at most {_MAX_RANKS} readers per node, not {world_size}")
        recorded = ring.readers()
        if recorded and (recorded != world_size if ring.takes else recorded > world_size):
            # Each rank's cursor is its place in its part of the order (rank + k * ranks): under another number of
            # ranks it names other positions, so the new ranks would read some of the epoch again and skip others,
            # and a rank of the old job that no longer reads would hold back the producers.
            raise CacheMismatchError(
                f"the stream at {path} is read by a job of {recorded} rank{'s' if recorded > 1 else ''} (each one's "
                f"cursor is its place in its part of the order); this process is rank {rank} of {world_size}. A "
                f"stream keeps the shape of the job that reads it: remove it (`mmapcache rm {path}`, or use a new "
                "path) when the number of ranks changes")
        return rank, world_size, rank, world_size
    nodes = node_of_process()[1] if found else split.nodes
    if nodes != split.nodes or world_size != split.world:
        # Every rank of the job is refused alike: a one-node job of 4 ranks on a 2-node stream of 2 ranks each had
        # its ranks 0 and 1 read node 0's part, and only ranks 2 and 3 refused.
        shape = f"{nodes} node{'s' if nodes > 1 else ''} x {world_size // nodes} ranks" if found else \
            f"{world_size} ranks"
        raise CacheMismatchError(
            f"the stream at {path} was made for a job of {split.nodes} nodes x {split.ranks} ranks (its ring holds "
            f"node {split.node}'s part); this job: {shape} (this process is rank {rank} of {world_size}). A stream "
            f"keeps the shape of the job that made it: remove it (`mmapcache rm {path}`, or use a new path) when the "
            "number of nodes or of ranks per node changes")
    if not split.first <= rank < split.first + split.ranks:
        raise CacheMismatchError(
            f"rank {rank} of {world_size} is not a rank of node {split.node} of {split.nodes} (ranks {split.first} "
            f"to {split.first + split.ranks - 1} of {split.world}), whose stream is at {path}: each node needs its own "
            "stream, on its own /dev/shm (or MMAPCACHE_DIR), and its ranks numbered node by node (torchrun's and "
            "SLURM's block order)")
    return rank, world_size, rank - split.first, split.ranks
