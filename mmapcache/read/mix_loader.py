"""A mixture's ``loader()``: a DataLoader whose sampler (``MixtureOrder``) draws each epoch's order of the mixture
(``read.mix_order``), cuts the rank's batches from it (``read.epoch_split.blocks``), and whose dataset gathers each
batch from the sources (``read.mix_batches``); its state resumes exactly, on any number of ranks.

A pass of an epoch is drawn at its first batch from ``(epoch, pass, counts)``: the counts of the mixture's setting
then (weights changed between epochs apply from the next pass drawn). An epoch read again without ``set_epoch`` is
a new pass (a new order), as ``ds.loader`` does. Every rank of a job draws the same order and reads its own blocks:
over the job an epoch's order is read once (and ``DistributedSampler``'s padding), every rank the same number of
batches.

For sources that hold node shares, each node's ranks read a mixture of their node's shares (each source's count
split across the nodes, within one sample), every rank of every node the job's number of batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from ..store.share import Share, job_rank_and_size, local_rank_and_size, share_size
from . import arena
from .epoch_split import block_spans
from .loader import _Pass
from .mix_order import EpochPlan, MixPass, grouped, plan
from .mix_state import load, save
from .resume import no_base_seed

__all__ = ["MixPass", "MixtureLoader", "MixtureOrder", "node_counts"]


class _Mixture(Protocol):
    """What the order needs of the mixture (``mmapcache.Mixture`` provides it)."""

    names: list[str]
    paths: list[str]
    lengths: list[int]
    starts: np.ndarray
    seed: int
    per_batch: bool
    shares: list[Share] | None
    epoch: int
    epoch_sets: int  # set_epoch calls
    setting_sets: int  # set_weights calls
    identities: list[dict[str, Any]]  # each source's name, length and fingerprint

    def counts_now(self) -> tuple[int, ...]: ...

    def set_epoch(self, epoch: int) -> None: ...

    def restore_epoch(self, epoch: int) -> None: ...

    def setting(self) -> dict[str, Any]: ...

    def restore_setting(self, setting: Any) -> None: ...


def node_counts(counts: Sequence[int], lengths: Sequence[int], nodes: int) -> np.ndarray:
    """``(nodes, sources)`` counts: each source's count split across the nodes in proportion to their shares of it
    (``store.share.share_size``), so that a count of the source's length reads every node's share whole (each sample
    once: default weights) and one of ``r`` lengths reads each share ``r`` times. The rest of a count that is not a
    multiple of the length goes by largest remainder, ties taken in turn across sources (the nodes' totals close).
    Never more of a share than the count asks: a node asked for more of a source than its share holds would read
    some of its samples twice while another node left some unread."""
    out = np.zeros((nodes, len(counts)), np.int64)
    turn = 0
    for s, (count, length) in enumerate(zip(counts, lengths)):
        sizes = np.array([share_size(int(length), nodes, n) for n in range(nodes)], np.int64)
        whole, rest = divmod(int(count), int(length))
        base = whole * sizes + rest * sizes // length
        left = int(count) - int(base.sum())
        remainders = rest * sizes % length
        for n in sorted(range(nodes), key=lambda n: (-int(remainders[n]), (n - turn) % nodes))[:left]:
            base[n] += 1
        turn = (turn + left) % nodes
        out[:, s] = base
    return out


class MixtureOrder(DistributedSampler):
    """The batches of a mixture's loader, one ``(epoch, flat ids)`` per batch (see the module docstring). A
    ``DistributedSampler`` by class, so that trainers leave it in place and call its ``set_epoch``.

    Args:
        mixture: the mixture.
        batch_size, drop_last: as ``DataLoader``'s.
        rank, world_size: this process's place in the job (default: the job's; with node shares, the node's).
    """

    def __init__(self, mixture: _Mixture, *, batch_size: int, drop_last: bool, rank: int | None = None,
                 world_size: int | None = None) -> None:
        # DistributedSampler.__init__ is not called: the split is found per pass.
        self.mixture = mixture
        self.dataset = mixture  # type: ignore[assignment]
        self.batch_size, self.drop_last = batch_size, drop_last
        if (rank is None) != (world_size is None):
            raise TypeError("loader() takes both rank= and world_size=, or neither (to find them in the job)")
        if world_size is not None and not 0 <= rank < world_size:  # type: ignore[operator]
            raise ValueError(f"rank {rank} of {world_size}: need 0 <= rank < world_size")
        self._placement = None if rank is None else (int(rank), int(world_size))  # type: ignore[arg-type]
        self.started: MixPass | None = None  # the pass in flight
        self.base = 0  # where in its order the pass in flight started (a resumed one: read.epoch_split)
        self.pass_batches = 0  # its batches from ``base`` on
        # (pass, offset, ended): a loaded state's pass in flight, read from ``offset`` on (nothing if it had ended)
        # by the next pass of its epoch (``read.mix_state``).
        self.resume: tuple[MixPass, int, bool] | None = None
        self.sets_seen, self.settings_seen = mixture.epoch_sets, mixture.setting_sets
        self._passes: dict[tuple[int, int, int], tuple[int, int]] = {}  # (epoch, rank, size) -> (pass, sets then)
        self._cached: tuple[Any, Any] = (None, None)

    # --- the split ----------------------------------------------------------------------------------------------

    def placement(self) -> tuple[int, int]:
        """``(rank, ranks)`` of this process among those reading one order: the job's, or with node shares its
        node's."""
        if self._placement is not None:
            return self._placement
        if self.mixture.shares is not None:
            # Found once: with only a process group to say it, finding it is a collective call.
            self._placement = local_rank_and_size(self.mixture.paths[0])
            return self._placement
        return job_rank_and_size()

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return self.placement()[1]

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.placement()[0]

    @property
    def epoch(self) -> int:
        return self.mixture.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.mixture.set_epoch(value)

    def set_epoch(self, epoch: int) -> None:
        self.mixture.set_epoch(epoch)

    def _nodes(self) -> int:
        shares = self.mixture.shares
        return shares[0].nodes if shares is not None else 1

    def per_rank(self, counts: Sequence[int], world: int | None = None) -> int:
        """Positions each rank reads of an epoch of ``counts`` (``DistributedSampler``'s ``ceil(G / W)``, ``W`` the
        job's ranks). With node shares, each node reads its ``node_counts`` row over ``world`` ranks (the node's),
        and every rank of the job as many as the node with the most needs (the others pad), so none is left out."""
        world = self.num_replicas if world is None else world
        if self.mixture.shares is None:
            return math.ceil(sum(counts) / world)
        most = int(node_counts(counts, self.mixture.lengths, self._nodes()).sum(axis=1).max())
        return math.ceil(most / world)

    def batches_for(self, counts: Sequence[int], world: int | None = None, batch_size: int | None = None) -> int:
        per_rank, size = self.per_rank(counts, world), batch_size or self.batch_size
        return per_rank // size if self.drop_last else math.ceil(per_rank / size)

    def __len__(self) -> int:
        """Batches per epoch of the mixture's setting, for this process."""
        return self.batches_for(self.mixture.counts_now())

    # --- one pass -------------------------------------------------------------------------------------------------

    def next_pass(self) -> MixPass:
        """The pass the next iteration draws (the mixture's epoch, and a new pass of it if it was read in this process
        since ``set_epoch``), with the setting's counts."""
        key = (self.mixture.epoch, *self.placement())
        last = self._passes.get(key)
        repeat = last[0] + 1 if last is not None and last[1] == self.mixture.epoch_sets else 0
        return MixPass(self.mixture.epoch, repeat, self.mixture.counts_now(), self.batch_size)

    def record(self, drawn: MixPass) -> None:
        self._passes[(drawn.epoch, *self.placement())] = (drawn.repeat, self.mixture.epoch_sets)

    def plan(self, drawn: MixPass) -> EpochPlan:
        """The pass's plan (this node's, with node shares): kept while the pass is read."""
        if self._cached[0] == drawn:
            return self._cached[1]
        m = self.mixture
        if m.shares is None:
            made = plan(m.lengths, drawn.counts, m.seed, drawn.epoch, drawn.repeat, drawn.unit, m.per_batch)
        else:
            share = m.shares[0]
            pools = [s.indices(n, s.generation(drawn.epoch)) for s, n in zip(m.shares, m.lengths)]
            made = plan(m.lengths, node_counts(drawn.counts, m.lengths, share.nodes)[share.node], m.seed, drawn.epoch,
                        drawn.repeat, drawn.unit, m.per_batch, pools)
        self._cached = (drawn, made)
        return made

    def order(self, drawn: MixPass) -> np.ndarray:
        """The pass's order of flat ids (this node's, with node shares)."""
        return self.plan(drawn).order()

    def spans(self, drawn: MixPass, base: int = 0) -> list[tuple[int, int, int]]:
        """This rank's batches of the pass from position ``base`` of its order on (``read.epoch_split.blocks``), as
        ``(start, stop, step)`` of the order's rest from ``base``, padded (positions past the rest: the padding, which
        repeats the order from its start)."""
        rank, world = self.placement()
        rest = max(0, self.plan(drawn).total - base)
        padded = math.ceil(rest / world) * world
        if self.mixture.shares is not None:  # every rank of every node the job's number of steps
            padded = max(0, self.per_rank(drawn.counts) * world - base)
        return block_spans(padded, rank, world, self.batch_size, self.drop_last)

    def positions(self, drawn: MixPass, base: int = 0) -> list[np.ndarray]:
        """This rank's batches of the pass from position ``base`` of its order on, as positions of the order."""
        rest = max(0, self.plan(drawn).total - base)
        return [self._positions(span, base, rest, self.plan(drawn).total) for span in self.spans(drawn, base)]

    @staticmethod
    def _positions(span: tuple[int, int, int], base: int, rest: int, total: int) -> np.ndarray:
        # Past the order's end, the padding repeats it from its start, cyclically: where a resumed pass starts
        # inside the padding (a node of node shares with less to read than the job's steps), it goes on from there.
        at = base + np.arange(*span, dtype=np.int64)
        return np.where(at < total, at, (at - total) % max(total, 1))

    def batches(self, drawn: MixPass, base: int = 0) -> list[np.ndarray]:
        """This rank's batches of the pass from position ``base`` on, as flat ids."""
        made = self.plan(drawn)
        return [made.at(p) for p in self.positions(drawn, base)]

    def keys(self, drawn: MixPass, spans: list[tuple[int, int, int]], base: int) -> Iterator[tuple[np.ndarray,
                                                                                                   tuple[int, ...]]]:
        """Each batch as it is read (``(indices, bounds)``, grouped by source): a whole unit of the plan as it
        holds it; any other (the padded tail, a resume on other ranks or batch sizes) grouped from its flat ids."""
        made, starts, unit = self.plan(drawn), self.mixture.starts, drawn.unit
        total = made.total
        rest = max(0, total - base)
        for a, b, step in spans:
            start, stop = base + a, base + b
            if step == 1 and b <= rest and start % unit == 0 and stop == min(start + unit, total):
                yield made.unit_batch(start // unit)
            else:
                yield grouped([made.at(self._positions((a, b, step), base, rest, total))], starts)[0]

    def __iter__(self) -> Iterator[tuple[int, np.ndarray, tuple[int, ...]]]:
        resume, self.resume = self.resume, None
        self.sets_seen = self.mixture.epoch_sets
        if resume is not None and resume[0].epoch == self.mixture.epoch:
            drawn, base, ended = resume
        else:
            drawn, base, ended = self.next_pass(), 0, False
        self.record(drawn)
        spans = [] if ended else self.spans(drawn, base)
        self.started, self.base, self.pass_batches = drawn, base, len(spans)
        for indices, bounds in self.keys(drawn, spans, base):
            yield drawn.epoch, indices, bounds


class MixtureLoader(DataLoader):
    """The DataLoader a mixture's ``loader()`` returns (see the module docstring). Without workers its batches are
    read in this process with none of DataLoader's per-batch machinery, after the same random draw (the workers'
    base seed, from torch's global generator). ``state_dict()``/``load_state_dict()`` follow torchdata's
    ``StatefulDataLoader`` protocol (``read.mix_state``)."""

    def __iter__(self) -> Any:
        order: MixtureOrder = self.sampler  # type: ignore[assignment]
        order.started = None
        self._pass = _Pass(self._begin, len(self))
        return self._pass

    def _begin(self) -> Iterator[Any]:
        order: MixtureOrder = self.sampler  # type: ignore[assignment]
        if self.num_workers or self.pin_memory:
            with no_base_seed(self, order.resume is not None and order.resume[0].epoch == order.mixture.epoch):
                return arena.from_workers(self, super().__iter__) if self.num_workers else super().__iter__()
        if order.resume is None or order.resume[0].epoch != order.mixture.epoch:  # (the rest of a pass: drawn then)
            torch.empty((), dtype=torch.int64).random_()  # the draw DataLoader's iterator makes for its workers' seed
        return map(self.dataset.__getitem__, self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """The mixture's ``set_epoch(epoch)``: the next pass reads epoch ``epoch``'s plan (Hugging Face's ``Trainer``
        calls a loader's ``set_epoch`` each epoch)."""
        self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is (``read.mix_state``): picklable; ``torch.save`` stores it."""
        return save(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next pass continue where the loader that saved ``state`` was: the rest of its pass, on this job's
        ranks (another number of them too), if the next pass is of that epoch.

        Raises:
            ValueError: not a mixture loader's state, a state of another mixture (sources, their lengths or
                fingerprints, seed, per-batch composition), or a value no loader saves.
        """
        load(self, state)
