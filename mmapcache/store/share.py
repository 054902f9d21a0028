"""Where this process is in a job, and node shares: its rank in the job (``job_rank_and_size``) and among the ranks of
its node that share a cache (``local_rank_and_size``), which node it is on, and which part of the dataset each
node of a multi-node job caches.

A dataset larger than one node's memory is partitioned: every node caches only its *share*, the ``node``-th of
``nodes`` near-equal parts of a seeded permutation of the indices (``format.spec`` defines it byte for byte), so the
nodes together hold one copy of the dataset instead of each holding the same first part. The partition is a
function of ``(length, nodes, seed, generation)`` alone: every node computes the same one without talking to the
others. With ``rotate_every=E`` the partition is drawn again every ``E`` epochs (generation ``epoch // E``), so
over a long run each node sees other samples, at the price of refilling its cache.

Which node a process is on comes from, in order: torchrun's environment (``GROUP_RANK`` or ``NODE_RANK``, with
``WORLD_SIZE / LOCAL_WORLD_SIZE`` nodes, else ``RANK // LOCAL_WORLD_SIZE``), SLURM's (``SLURM_NODEID`` of
``SLURM_NNODES``), or an initialised ``torch.distributed`` process group (ranks grouped by host name). A process
that none of these describe is the only node. Its rank among the node's ranks: torchrun's ``LOCAL_RANK``/
``LOCAL_WORLD_SIZE``, SLURM's ``SLURM_LOCALID``/``SLURM_NTASKS_PER_NODE``, or the process group (ranks grouped by host
name and the cache's parent directory, one collective call).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any

import numpy as np

__all__ = ["Share", "env_int", "node_of_process", "share_of", "share_option"]


@dataclasses.dataclass(frozen=True)
class Share:
    """This node's share: part ``node`` of ``nodes``, drawn with ``seed``, redrawn every ``rotate_every`` epochs
    (None: never). Recorded in ``meta.json`` as ``share``."""

    node: int
    nodes: int
    seed: int = 0
    rotate_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("node", "nodes", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"share {name} must be an int, got {type(value).__name__} ({value!r})")
        if self.nodes < 1 or not 0 <= self.node < self.nodes:
            raise ValueError(f"node {self.node} of {self.nodes}: need 0 <= node < nodes")
        rotate = self.rotate_every
        if rotate is not None and (isinstance(rotate, bool) or not isinstance(rotate, (int, np.integer))
                                   or rotate < 1):
            raise ValueError(f"rotate_every must be None or an integer >= 1 (epochs), got {rotate!r}")

    def to_json(self) -> dict[str, Any]:
        return {"node": int(self.node), "nodes": int(self.nodes), "seed": int(self.seed),
                "rotate_every": None if self.rotate_every is None else int(self.rotate_every)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Share:
        return cls(obj["node"], obj["nodes"], obj["seed"], obj["rotate_every"])

    def generation(self, epoch: int) -> int:
        """Which partition epoch ``epoch`` reads: ``epoch // rotate_every``, always 0 without rotation."""
        return 0 if self.rotate_every is None else int(epoch) // self.rotate_every

    def size(self, length: int) -> int:
        """How many indices the share holds (the same in every generation)."""
        return share_size(length, self.nodes, self.node)

    def indices(self, length: int, generation: int = 0) -> np.ndarray:
        """The share of ``generation``, sorted (int64)."""
        return share_of(length, self.nodes, self.node, self.seed, generation)

    def describe(self, length: int) -> str:
        rotation = f", drawn again every {self.rotate_every} epochs" if self.rotate_every else ""
        return f"node {self.node} of {self.nodes}: {self.size(length)} of {length} indices (seed {self.seed}{rotation})"


def share_option(node_share: Any, rotate_every: Any, seed: int) -> Share | None:
    """The ``node_share``/``rotate_every`` arguments (``MmapCachedDataset``, ``build``) as a ``Share``, or None.
    ``node_share=True`` asks the environment (``node_of_process``)."""
    if node_share is False:
        if rotate_every is not None:
            raise ValueError("rotate_every rotates a node share: pass node_share=True with it")
        return None
    if node_share is True:
        node, nodes = node_of_process()
    elif isinstance(node_share, tuple) and len(node_share) == 2:
        node, nodes = node_share
    else:
        raise TypeError(f"node_share must be True, False or (node, nodes), got {node_share!r}")
    return Share(node, nodes, seed, rotate_every)


def share_size(length: int, nodes: int, node: int) -> int:
    """How many of ``length`` indices part ``node`` of ``nodes`` holds (``share_of``'s slice of the permutation)."""
    return (node + 1) * length // nodes - node * length // nodes


def share_of(length: int, nodes: int, node: int, seed: int, generation: int = 0) -> np.ndarray:
    """Part ``node`` of the partition of ``0 .. length-1`` into ``nodes`` parts (see ``format.spec``), sorted."""
    order = np.random.default_rng([seed, generation]).permutation(length) if nodes > 1 else np.arange(length)
    part = order[node * length // nodes:(node + 1) * length // nodes]
    return np.sort(part).astype(np.int64)


def job_rank_and_size() -> tuple[int, int]:
    """This process's rank in the job and the job's size: an initialised ``torch.distributed`` process group's (the
    authority once there is one: Lightning sets no ``RANK``), else torchrun's ``RANK``/``WORLD_SIZE``, else SLURM's
    ``SLURM_PROCID``/``SLURM_NTASKS``, else ``(0, 1)``. Never a collective call.

    Raises:
        ValueError: an environment variable that is not an integer, or a rank outside the size.
    """
    dist = initialised_dist()
    if dist is not None:
        return dist.get_rank(), dist.get_world_size()
    env = os.environ
    for rank, size in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank in env and size in env:
            found = env_int(rank), env_int(size)
            if not 0 <= found[0] < found[1]:
                raise ValueError(f"{rank}={found[0]} is not a rank of {size}={found[1]}; fix the launcher's "
                                 "environment")
            return found
    return 0, 1


def node_of_process() -> tuple[int, int]:
    """``(node, nodes)`` of this process (see the module docstring); ``(0, 1)`` when nothing describes a job.

    Not a collective call, except when only an initialised process group describes the job: then every rank
    must call it.

    Raises:
        ValueError: the environment is inconsistent (a node rank outside the node count, a world size that is not
            a multiple of the local one); the message names the variables.
    """
    env = os.environ
    if "WORLD_SIZE" in env and "LOCAL_WORLD_SIZE" in env:
        world, local = env_int("WORLD_SIZE"), env_int("LOCAL_WORLD_SIZE")
        if local < 1 or world % local:
            raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: nodes with "
                             "different numbers of processes cannot share the dataset evenly; fix the launcher")
        nodes = world // local
        for name in ("GROUP_RANK", "NODE_RANK"):
            if name in env:
                return _checked(env_int(name), nodes, f"{name}, of WORLD_SIZE/LOCAL_WORLD_SIZE nodes")
        if "RANK" in env:
            return _checked(env_int("RANK") // local, nodes, "RANK // LOCAL_WORLD_SIZE")
    if "SLURM_NODEID" in env and "SLURM_NNODES" in env:
        return _checked(env_int("SLURM_NODEID"), env_int("SLURM_NNODES"), "SLURM_NODEID/SLURM_NNODES")
    group = _process_group_nodes()
    if group is not None:
        return group
    return 0, 1


def _process_group_nodes() -> tuple[int, int] | None:
    """``(node, nodes)`` from an initialised process group: nodes are the distinct host names, in rank order."""
    dist = initialised_dist()
    if dist is None:
        return None
    hosts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    order = list(dict.fromkeys(hosts))
    return order.index(socket.gethostname()), len(order)


def env_int(name: str) -> int:
    """An integer environment variable set by a launcher; ValueError naming it if it is not one."""
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; unset it or fix the "
                         "launcher") from None


def _checked(node: int, nodes: int, source: str) -> tuple[int, int]:
    if nodes < 1 or not 0 <= node < nodes:
        raise ValueError(f"{source} = {node}/{nodes}: need 0 <= node < nodes; fix the launcher's environment")
    return node, nodes


def local_rank_and_size(path: str | None = None) -> tuple[int, int]:
    """This process's rank among the processes of its node that share the cache, and their number.

    Args:
        path: the cache path; only used when the ranks are grouped through ``torch.distributed`` (ranks whose
            host and cache parent directory are the same share a cache).

    Returns ``(0, 1)`` when nothing says this process has peers. Not a collective call, except when a process
    group is initialised and neither torchrun's nor SLURM's variables are set: then every rank must call it.
    """
    env = os.environ
    if "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" in env:
        return checked_rank(env_int("LOCAL_RANK"), env_int("LOCAL_WORLD_SIZE"), "LOCAL_RANK/LOCAL_WORLD_SIZE")
    if "SLURM_LOCALID" in env and "SLURM_NTASKS_PER_NODE" in env:
        return checked_rank(env_int("SLURM_LOCALID"), env_int("SLURM_NTASKS_PER_NODE"),
                        "SLURM_LOCALID/SLURM_NTASKS_PER_NODE")
    group = _process_group_local(path)
    if group is not None:
        return group
    return 0, 1


def initialised_dist():  # -> the torch.distributed module, or None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def _process_group_local(path: str | None) -> tuple[int, int] | None:
    """Local rank and size from an initialised process group: ranks on the same host sharing the cache's parent."""
    dist = initialised_dist()
    if dist is None:
        return None
    where = os.path.dirname(path) if path else ""
    try:
        st = os.stat(where) if where else None
    except OSError:
        st = None
    key = (socket.gethostname(), where, None if st is None else (st.st_dev, st.st_ino))
    keys: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, key)
    peers = [r for r, k in enumerate(keys) if k == key]
    return peers.index(dist.get_rank()), len(peers)


def checked_rank(rank: int, size: int, source: str) -> tuple[int, int]:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"{source} = {rank}/{size}: need 0 <= rank < world_size and world_size >= 1")
    return rank, size
