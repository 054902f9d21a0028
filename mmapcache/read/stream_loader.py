"""``ds.loader()`` over a stream: each iteration hands a rank's next epoch of the stream's order to the training loop
in batches, read by an inner DataLoader (and its workers) through ``read.stream.StreamReads``, moves the rank's
cursor as the loop receives each batch, and saves and loads it as a loader state. One process reads a rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import CacheInUseError, StreamBypassWarning, StreamPositionWarning, warn
from ..store.ring import Ring
from . import arena
from .collate import PadCollate
from .lending import Lending
from .stream import StreamReads
from .stream_place import reader_place

__all__ = ["StreamLoader"]


class _StreamDataset(Protocol):
    """What the stream loader needs of a dataset (``MmapCachedDataset`` provides it)."""

    path: str
    transform: Callable[[Any], Any] | None
    epoch_sets: int  # set_epoch calls in this process

    @property
    def epoch(self) -> int: ...

    def stream_reads(self) -> StreamReads: ...

    def __len__(self) -> int: ...


class StreamLoader:
    """``ds.loader()`` over a stream: each iteration yields this rank's next epoch of the stream's order (or the
    rest of the epoch it was reading), in batches, and moves the rank's cursor past each batch as the training loop
    receives it. The batches are read by an inner DataLoader (its workers, if any); see ``store.ring`` and
    ``StreamReads``.

    Takes DataLoader's arguments except those that choose the order (``shuffle``, ``sampler``, ``batch_sampler``,
    ``generator``: the stream's seeded order is fixed), plus ``rank``/``world_size``: this process's place in the
    job (default: the job's, as ``ds.loader`` finds it: a process group, torchrun, SLURM), whose part of each epoch
    it reads, as ``DistributedSampler`` splits it (``reader_place``). One process reads a rank: a second reader of it
    is refused (``CacheInUseError``) while the first one's loader lives.
    """

    def __init__(self, ds: _StreamDataset, pad: PadCollate | None, **kwargs: Any) -> None:
        for name in ("shuffle", "sampler", "batch_sampler", "generator"):
            if kwargs.get(name) not in (None, False):
                raise ValueError(f"{name}= chooses an order, and a stream reads its own seeded order (the seed= it "
                                 f"was created with); leave {name} out of ds.loader()")
            kwargs.pop(name, None)
        if kwargs.get("num_workers") and not kwargs.get("in_order", True):  # (DataLoader tests it for truth)
            raise ValueError("ds.loader(in_order=False) with workers hands a stream's batches to the training loop out "
                             "of order, while the rank's cursor says which of its positions were handed over (a "
                             "restarted reader would skip the batches still on their way, and read others twice); "
                             "leave in_order out (True, the default) for a stream")
        batch_size = kwargs.pop("batch_size", 1)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1 for a stream, got {batch_size!r}")
        ring = ds.stream_reads().ring
        self.job_rank, self.job_size, rank, ranks = reader_place(ring, kwargs.pop("rank", None),
                                                                 kwargs.pop("world_size", None))
        self.ds, self.rank, self.ranks = ds, rank, ranks  # (this node's ranks that read its ring)
        self._warned_position = False
        self.batch_size, self.drop_last = batch_size, bool(kwargs.pop("drop_last", False))
        # A batch of every rank spans batch_size * world_size positions, and a rank reads the batch in use and
        # num_workers * prefetch_factor more ahead of its cursor; producers may work at most `slots` ahead of the
        # slowest cursor, so a smaller ring has readers reach positions no producer could fill yet, and compute
        # them. (With one more batch of room, producers can also work ahead of the readers.)
        workers = kwargs.get("num_workers") or 0
        batches = 2 + workers * (kwargs.get("prefetch_factor") or 2)
        slots = ring.slots
        if slots < min(batches * batch_size * ranks, ring.length):  # a ring of a whole epoch is never too small
            warn(f"the stream at {ds.path} holds {slots} samples in its ring, fewer than the {batches} batches of all "
                 f"its node's readers that they read ahead and use ({batches} x {batch_size} x {ranks}; 2 + "
                 "num_workers x prefetch_factor batches): readers will compute many samples themselves while "
                 "producers' work goes unread; create the stream with a larger max_bytes", StreamBypassWarning)
        collate = kwargs.pop("collate_fn", None)
        self.per_rank = ring.per_rank(ranks)
        self._reading: weakref.finalize | None = None
        self._plan = _Plan()
        self._loader = DataLoader(_StreamReads(ds, rank, ranks, pad, None if pad is not None else collate),
                                  batch_size=None, sampler=self._plan, collate_fn=_whole, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        reads = self.ds.stream_reads()
        self._hold(reads.ring)
        asked = self.ds.epoch
        epoch, start = reads.start(self.rank, self.ranks)
        if epoch > asked and self.ds.epoch_sets and not self._warned_position:
            self._warned_position = True
            warn(f"set_epoch({asked}) asked for epoch {asked} of the stream at {self.ds.path}, but rank {self.rank} "
                 f"had already read it up to epoch {epoch}: it goes on from there (a stream serves each computation "
                 "once; the epochs it has passed are gone). To read from the start again, remove the stream "
                 "(`mmapcache rm`) and create it anew; to resume a job exactly, load its loader state "
                 "(loader.load_state_dict)", StreamPositionWarning)
        stop = self._stop(start)
        if start and start == stop < self.per_rank:  # a state after an epoch's last batch, its short tail dropped
            reads.consumed(self.rank, self.ranks, epoch, self.per_rank, {})
            epoch, start = reads.start(self.rank, self.ranks)
            stop = self._stop(start)
        self._plan.items = [(epoch, a, min(a + self.batch_size, stop)) for a in range(start, stop, self.batch_size)]
        loader = self._loader
        for (epoch, _, end), (stats, batch) in zip(
                self._plan.items, arena.from_workers(loader, loader.__iter__) if loader.num_workers else loader):
            # The epoch's last batch passes its dropped tail too (drop_last): a state saved on that step, or a
            # reader stopped after it, goes on with the next epoch, not the empty rest of this one.
            reads.consumed(self.rank, self.ranks, epoch, self.per_rank if end == stop else end, stats)
            yield batch
        if stop < self.per_rank:  # (no batch at all: an epoch shorter than one)
            reads.consumed(self.rank, self.ranks, epoch, self.per_rank, {})

    def _stop(self, start: int) -> int:
        """Where this rank's reading of an epoch stops, from ``start``: its end, or with ``drop_last`` the end of
        the last whole batch."""
        return self.per_rank - (self.per_rank - start) % self.batch_size if self.drop_last else self.per_rank

    def __len__(self) -> int:
        """Batches in one whole epoch of this rank."""
        return self.per_rank // self.batch_size if self.drop_last else -(-self.per_rank // self.batch_size)

    def _hold(self, ring: Ring) -> None:
        """Takes this rank's reader lock for as long as this loader lives (``Ring.hold_reader``)."""
        if self._reading is not None and self._reading.alive:
            return
        key = (ring.store.path, self.rank)
        if key not in _held:
            claims, other = ring.hold_reader(self.rank)
            if claims is None:
                who = f"process {other}" if other > 0 else "another process"
                raise CacheInUseError(
                    f"rank {self.job_rank} of {self.job_size} of the stream at {ring.store.path} is being read by "
                    f"{who}: two readers of one rank would each be served values the other was served (each moves "
                    "the rank's one cursor). Run each rank once (the same script started twice is two readers), or "
                    "give the other job its own stream (another path)", users=(other,) if other > 0 else ())
            _held[key] = [0, claims]
        _held[key][0] += 1
        self._reading = weakref.finalize(self, _release, key)

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is in the stream: its epoch and the positions handed to the training loop (its cursor,
        which the ring also keeps). ``CacheLoader``'s protocol."""
        epoch, position = self.ds.stream_reads().progress(self.rank) or (self.ds.epoch, 0)
        return {"format": _STREAM_STATE_FORMAT, "length": len(self.ds), "world_size": self.job_size,
                "rank": self.job_rank, "batch_size": self.batch_size, "epoch": epoch, "position": position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Moves this rank's cursor to where ``state`` was (a checkpoint restored after the run went on: the
        positions read since are read again, computed afresh where the ring no longer holds them). A state saved by
        another rank of the same job moves this rank's cursor to the same epoch and position of its own part.

        Raises:
            ValueError: not a stream loader's state, or one of another dataset length, batch size or rank count.
        """
        if not isinstance(state, dict) or state.get("format") != _STREAM_STATE_FORMAT:
            raise ValueError(f"not a state of a stream's ds.loader() (format {_STREAM_STATE_FORMAT!r}); pass what its "
                             "state_dict() returned")
        # Not the rank: ranks read their parts in step, and a trainer saves one rank's state (Lightning, rank 0's),
        # from which each rank resumes its own cursor at the same position.
        mine = {"length": len(self.ds), "world_size": self.job_size, "batch_size": self.batch_size}
        differ = [f"{key} {state.get(key)!r} in the state, {value!r} here" for key, value in mine.items()
                  if state.get(key) != value]
        if differ:
            raise ValueError(f"this loader state was saved by a loader of another shape ({'; '.join(differ)}): "
                             "resuming from it would read other positions")
        reads = self.ds.stream_reads()
        epoch = _state_int(state, "epoch", reads.ring.last_epoch())
        position = _state_int(state, "position", self.per_rank)
        reads.seek(self.rank, self.ranks, epoch, position)


_STREAM_STATE_FORMAT = "mmapcache.stream_loader/1"  # world_size and rank: the job's (on one node, the node's)


def _state_int(state: dict[str, Any], key: str, high: int) -> int:
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= high:
        raise ValueError(f"stream loader state key {key!r}: {value!r}, expected an int from 0 to {high}; load what "
                         "ds.loader().state_dict() returned, unedited")
    return int(value)


# Reader locks this process holds, by (stream path, local rank): how many of its loaders hold each, and the claims
# (a descriptor of their own: Ring.hold_reader) that hold it until the last of those loaders goes. Not a dataset's
# ring's: a loader of another dataset of the same path, or of a dataset closed meanwhile, shares the lock.
_held: dict[tuple[str, int], list[Any]] = {}


def _release(key: tuple[str, int]) -> None:
    entry = _held.get(key)
    if entry is None:
        return
    entry[0] -= 1
    if not entry[0]:
        del _held[key]
        entry[1].close()




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

    lending: Lending | None = None  # while its loader starts workers (``read.lending``)

    def __init__(self, ds: _StreamDataset, rank: int, ranks: int, pad: PadCollate | None, collate: Any) -> None:
        self.ds, self.rank, self.ranks, self.pad, self.collate = ds, rank, ranks, pad, collate

    def __getitem__(self, key: tuple[int, int, int]) -> tuple[dict[str, int], Any]:
        epoch, k0, k1 = key
        return arena.read(self.lending, self.ds.stream_reads().read, epoch, self.rank, self.ranks, k0, k1, self.pad,
                          self.collate, self.ds.transform)

    def __len__(self) -> int:
        return len(self.ds)


def _whole(batch: Any) -> Any:
    return batch  # each item is already a collated batch


