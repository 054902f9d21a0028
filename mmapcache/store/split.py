"""A stream's node split: which positions of each epoch's order one node's ring holds, in a job of several nodes.

A job of ``nodes`` nodes of ``ranks`` ranks each (``W = nodes * ranks``) reads epoch ``e``'s order as
``DistributedSampler`` splits it: job rank ``g`` reads positions ``g, g + W, g + 2W, ...``. Ranks are numbered node by
node (torchrun numbers them so, as does SLURM's default block distribution): node ``n`` runs ranks ``n * ranks + i``,
``i < ranks``, its local ranks. Its ring holds exactly the positions those ranks read, in order: the node's sequence
position ``j`` is the order's position ``n * ranks + j % ranks + W * (j // ranks)``, and local rank ``i`` reads
sequence positions ``i, i + ranks, ...``. Nothing crosses nodes: every node computes the same order from the seed
and produces only its part. One node (``nodes == 1``) holds every position, whatever its ranks: ``j`` is the
position (the stream of one machine, and every stream before multi-node streams existed).

Recorded in ``meta.json`` as ``stream.split`` (``format.spec``, "Stream mode") when ``nodes > 1``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["StreamSplit"]
@dataclasses.dataclass(frozen=True)
class StreamSplit:
    """Node ``node`` of ``nodes`` nodes of ``ranks`` ranks each (see the module docstring)."""

    node: int = 0
    nodes: int = 1
    ranks: int = 1

    def __post_init__(self) -> None:
        for name in ("node", "nodes", "ranks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"stream split {name} must be an int, got {type(value).__name__} ({value!r})")
        if self.nodes < 1 or self.ranks < 1 or not 0 <= self.node < self.nodes:
            raise ValueError(f"node {self.node} of {self.nodes} nodes of {self.ranks} ranks: need 0 <= node < nodes "
                             "and ranks >= 1")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks

    @property
    def first(self) -> int:
        """The job rank of this node's local rank 0."""
        return self.node * self.ranks

    def positions(self, length: int) -> int:
        """How many of an epoch's ``length`` positions this node holds."""
        if self.nodes == 1:
            return length
        return sum(max(0, -(-(length - self.first - i) // self.world)) for i in range(self.ranks))

    def position(self, j: np.ndarray) -> np.ndarray:
        """The order's positions of sequence positions ``j`` (int64; past ``positions(length)`` they are
        ``DistributedSampler``'s padding, at or past the length)."""
        if self.nodes == 1:
            return j
        return self.first + j % self.ranks + self.world * (j // self.ranks)

    def to_json(self) -> dict[str, int]:
        return {"node": int(self.node), "nodes": int(self.nodes), "ranks": int(self.ranks)}

    @classmethod
    def from_json(cls, obj: dict[str, Any] | None) -> StreamSplit:
        return cls() if obj is None else cls(obj["node"], obj["nodes"], obj["ranks"])

    def describe(self, length: int) -> str:
        if self.nodes == 1:
            return "one node: every position"
        return (f"node {self.node} of {self.nodes} (ranks {self.first} to {self.first + self.ranks - 1} of "
                f"{self.world}): {self.positions(length)} of {length} positions per epoch")


def stream_split_option(node_share: Any, path: str | None = None) -> StreamSplit | None:
    """The split a new stream is made with (``MmapCachedDataset(stream=True)``, ``build(stream=True)``), None for one
    node. A stream lives on one node's ``/dev/shm``: under a job of several nodes it always holds its node's part,
    found in the job's environment (``store.share.node_of_process``; ``node_share`` True or False alike), or with
    ``node_share=(node, nodes)`` for that node; the ranks per node are the job's (``local_rank_and_size``). Every
    rank of the job calls it (with only a process group to describe the job, it is a collective call).

    Raises:
        ValueError: the environment describes a job whose world size is not its nodes times its ranks per node.
    """
    from .share import job_rank_and_size, local_rank_and_size, node_of_process

    if isinstance(node_share, bool):
        node, nodes = node_of_process()
    elif isinstance(node_share, tuple) and len(node_share) == 2:
        node, nodes = node_share
    else:
        raise TypeError(f"node_share must be True, False or (node, nodes), got {node_share!r}")
    if nodes == 1:
        return None
    ranks = local_rank_and_size(path)[1]
    world = job_rank_and_size()[1]
    if world not in (1, nodes * ranks):
        raise ValueError(f"this job has {world} ranks, but {nodes} nodes of {ranks} ranks each: a stream split over "
                         "nodes needs the same number of ranks on every node, numbered node by node; fix the launch")
    return StreamSplit(node, nodes, ranks)
