"""Reading a stream: a rank's positions of each epoch's order, from the ring where a producer has filled them,
computed where not (or waited for), and the loader that hands them to a training loop and moves the rank's cursor.

``StreamReads`` is one process's reading side of an open stream (made by the dataset when it opens one): where a
rank starts (its cursor, so a restarted reader resumes), the batch of positions ``k0 .. k1-1``, and the cursor's
moves. ``StreamLoader`` is what ``ds.loader()`` returns for a stream. The ring itself (order, cursors, claims,
counters) is ``store.ring``; the producers are ``fill.producer``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import (
    CacheInUseError,
    SampleNotCachedError,
    StreamBypassWarning,
    StreamPositionWarning,
    StreamTimeoutError,
    warn,
)
from ..store.ring import Ring, producers_of
from .collate import PadCollate
from .gather import alloc_shared
from .stream_place import reader_place

__all__ = ["StreamLoader", "StreamReads", "read_positions"]


class _StreamDataset(Protocol):
    """What the stream loader needs of a dataset (``MmapCachedDataset`` provides it)."""

    path: str
    transform: Callable[[Any], Any] | None
    epoch_sets: int  # set_epoch calls in this process

    @property
    def epoch(self) -> int: ...

    def stream_reads(self) -> StreamReads: ...

    def __len__(self) -> int: ...


class StreamReads:
    """The reading side of one open stream in one process. Safe across processes and threads.

    Args:
        ring: the stream's ring.
        reader: the cache's reader.
        compute: ``index -> values``: the source's checked sample (a miss), or None without a source.
        epoch: the dataset's shared epoch cell (a one-element int64 view), which a rank's start moves.
        wait, timeout: ``on_miss="wait"`` and ``wait_timeout``.
    """

    def __init__(self, ring: Ring, reader: Any, compute: Callable[[int], list[Any]] | None, epoch: Any,
                 wait: bool, timeout: float) -> None:
        self.ring, self.reader, self.compute, self.epoch = ring, reader, compute, epoch
        self.wait, self.timeout = wait, timeout
        self.seconds_each = 0.0  # this process's computations of a sample, on average (recent ones count most)

    def start(self, rank: int, ranks: int) -> tuple[int, int]:
        """Where rank ``rank`` of ``ranks`` starts reading: its position ``(epoch, k)`` in the stream, recorded as
        its cursor. That is this epoch's start (``set_epoch``), or later if the rank already read part of it (a
        restarted reader resumes; nothing it was served is served again)."""
        ring = self.ring
        per_rank = ring.per_rank(ranks)
        start = (int(self.epoch[0]), 0)
        progress = ring.progress(rank)
        if progress is not None and progress > start:
            start = progress
        if start[1] >= per_rank:
            start = (start[0] + 1, 0)
        ring.set_progress(rank, ranks, *start)
        ring.start_taking(rank, ranks)
        self.epoch[0] = start[0]
        return start

    def consumed(self, rank: int, ranks: int, epoch: int, k: int, stats: dict[str, int]) -> None:
        """Records that rank ``rank`` was handed its positions up to ``k`` of ``epoch`` (moves its cursor, counts
        ``stats``). Called in the process that iterates the loader."""
        self.ring.set_progress(rank, ranks, epoch, k)
        self.ring.count(**stats)

    def progress(self, rank: int) -> tuple[int, int] | None:
        """``(epoch, k)``: rank ``rank`` was handed its first ``k`` positions of ``epoch``; None if it never read."""
        return self.ring.progress(rank)

    def seek(self, rank: int, ranks: int, epoch: int, k: int) -> None:
        """Moves rank ``rank``'s cursor to its position ``k`` of ``epoch`` (a restored checkpoint's); the dataset's
        epoch follows."""
        self.ring.set_progress(rank, ranks, epoch, k)
        self.ring.start_taking(rank, ranks)
        self.epoch[0] = epoch

    def read(self, epoch: int, rank: int, ranks: int, k0: int, k1: int, pad: Any = None,
             collate: Callable[[list[Any]], Any] | None = None,
             transform: Callable[[Any], Any] | None = None) -> tuple[dict[str, int], Any]:
        """Positions ``k0 .. k1-1`` of rank ``rank`` of ``ranks`` in epoch ``epoch``, collated (the gathered batch;
        with ``collate`` or a ``transform``, ``collate([transform(sample), ...])``), and the counts of values
        served, computed and the time waited."""
        reader = self.reader
        positions = rank + np.arange(k0, k1, dtype=np.int64) * ranks
        alloc = alloc_shared if torch.utils.data.get_worker_info() is not None else np.empty
        columns, stats = read_positions(self.ring, reader, epoch, positions, self._compute, wait=self.wait,
                                        timeout=self.timeout, alloc=alloc, rank=rank,
                                        patience=max(_PATIENCE, 3 * self.seconds_each))
        if reader.variable:
            samples = [reader.sample_from_values([c[k] for c in columns]) for k in range(len(positions))]
        elif collate is not None or transform is not None:
            samples = reader.samples(columns)
        else:
            return stats, reader.collate(columns, pad)
        if transform is not None:
            samples = [transform(sample) for sample in samples]
        return stats, (collate or pad or torch.utils.data.default_collate)(samples)

    def _compute(self, index: int) -> list[Any]:
        if self.compute is None:
            path = self.ring.store.path
            raise SampleNotCachedError(
                f"sample {index} of the stream at {path} is not in its ring (no producer has computed it), and the "
                "stream was opened without a source dataset; open it with MmapCachedDataset(path, dataset, "
                "stream=True) to compute such samples, or start producers (`mmapcache build PATH --dataset SPEC "
                "--follow`)")
        started = time.perf_counter()
        values = self.compute(index)
        self.seconds_each += 0.2 * (time.perf_counter() - started - self.seconds_each)
        return values


# How often a reader waiting for a producer looks again (seconds): short first, longer as the wait goes on.
_WAIT_POLL = (0.0005, 0.02)
# How long a reader that computes what it does not find waits for a producer computing a position (seconds), at least
# (and at least 3 of its own computations): a producer publishes a run of positions together, about 2 ms of its work
# or one sample, and claims past where its readers will be by then, so a reader seldom waits. Past that (a producer
# stopped, or starved of CPU) the reader computes the position itself, and the rest of its batch; the producer's
# value, published late, is counted as skipped.
_PATIENCE = 0.05


def read_positions(ring: Ring, reader: Any, epoch: int, positions: np.ndarray, compute: Any, *, wait: bool,
                   timeout: float, alloc: Any = np.empty, rank: int | None = None,
                   patience: float = _PATIENCE) -> tuple[list[Any], dict[str, int]]:
    """The values of ``positions`` of ``epoch`` (rank ``rank``'s, in order) as gathered columns, and what it took.

    A position whose row holds its sequence number is copied from the ring (``served``); one that does not is
    computed here with ``compute(index) -> values`` (``computed``). Each is computed once on the node: without
    ``wait``, the rank takes the batch's positions first (``Ring.take``: no producer claims them afterwards), and a
    position a producer claimed before is waited for (up to ``patience`` seconds; a producer that does not deliver
    by then leaves it, and the rest of the batch, to this reader). With ``wait``, the reader waits for producers up
    to ``timeout`` seconds (counted in ``waited_ns``), and computes at once a position no producer will store (one
    given up, or one no producer may fill before this rank moves on). Padding positions (past ``N``) are always
    computed. Nothing is stored.

    Raises:
        StreamTimeoutError: ``wait`` and no producer published a position within ``timeout``.
    """
    slots = ring.slots
    indices, qs = ring.sequence(epoch, positions)
    if rank is not None and not wait and len(qs) and int(qs.max()) >= 0:
        ring.take(rank, int(qs.max()) + 1)
    rows = np.where(qs >= 0, qs % slots, -1)
    if reader.variable:  # max_shapes fields: read one position at a time
        columns, missing = _per_position(reader, len(positions)), list(range(len(positions)))
    else:
        columns, missing = reader.gather(rows, alloc, qs)
    stats = {"served": len(positions) - len(missing), "computed": 0, "waited_ns": 0}
    stalled = False  # a producer did not deliver within patience: this reader computes the rest of its batch
    for k in missing:
        q, row, index = int(qs[k]), int(rows[k]), int(indices[k])
        values = reader.read_values(row, q) if q >= 0 else None  # rewritten during the gather: read again
        if values is None and q >= 0 and (wait or not stalled):
            started = time.monotonic_ns()
            if wait:
                values = _wait_for_producers(ring, reader, q, row, started, stats["waited_ns"], timeout, index)
            else:
                values, stalled = _while_produced(ring, reader, q, row, started, patience)
            stats["waited_ns"] += time.monotonic_ns() - started
        if values is None:
            values = compute(index)
            stats["computed"] += 1
        else:
            stats["served"] += 1
        for column, value in zip(columns, values):
            column[k] = value
    return columns, stats


def _while_produced(ring: Ring, reader: Any, q: int, row: int, started: int,
                    patience: float) -> tuple[list[Any] | None, bool]:
    """Position ``q``'s values once the producer that claimed it publishes them (None if there is none, or it gives
    the position up), and whether it did not deliver within ``patience`` seconds."""
    if not ring.producer_holds(q):
        return reader.read_values(row, q), False  # (published just before the test, or nobody's: ours to compute)
    poll = _WAIT_POLL[0]
    said = ring.wait_for(q)  # a producer holding it for heap room gives it up at once
    try:
        while ring.producer_holds(q):
            said = said or ring.wait_for(q)
            if time.monotonic_ns() - started > patience * 1e9:
                return None, True
            time.sleep(poll)
            poll = min(poll * 2, patience / 8)
    finally:
        if said:
            ring.done_waiting(q)
    return reader.read_values(row, q), False


def _wait_for_producers(ring: Ring, reader: Any, q: int, row: int, started: int, waited: int, timeout: float,
                        index: int) -> list[Any] | None:
    """``on_miss="wait"``: position ``q``'s values once a producer publishes them, or None once none will (it was
    given up, or no producer may fill it before this rank moves on: the reader computes it)."""
    values = None
    poll = _WAIT_POLL[0]
    said = ring.wait_for(q)
    try:
        while values is None and q < ring.low() + ring.slots and not ring.abandoned(q):
            # (Taken again if it was not: a producer tests the lock by taking it for an instant, and a reader that
            # found it taken then, and said nothing, waited for a producer holding q for room.)
            said = said or ring.wait_for(q)
            if time.monotonic_ns() - started > timeout * 1e9:
                # (The batch's counts are added when it is handed over, which this one never is.)
                ring.count(waited_ns=waited + time.monotonic_ns() - started)
                raise StreamTimeoutError(_timeout_message(ring, q, index, timeout))
            time.sleep(poll)
            poll = min(poll * 2, _WAIT_POLL[1])
            values = reader.read_values(row, q)
    finally:
        if said:
            ring.done_waiting(q)
    return values


class _Column(list):
    """A column of one value per position, for layouts ``gather`` cannot batch (``max_shapes`` fields). It keeps a
    copy of each array put in it: the value may be a view of a buffer the source refills for its next sample."""

    def __setitem__(self, position: Any, value: Any) -> None:
        super().__setitem__(position, value.copy() if isinstance(value, np.ndarray) else value)


def _per_position(reader: Any, count: int) -> list[Any]:
    return [_Column([None] * count) for _ in reader.fields]


def _timeout_message(ring: Ring, q: int, index: int, timeout: float) -> str:
    producers = producers_of(ring.store.path)
    running = (f"producer(s) {', '.join(map(str, producers))} are running but did not keep up (the ring holds "
               f"{ring.slots} samples; add producer workers)") if producers else \
        "no producer is running for it (none started, or all exited or were killed)"
    return (f"waited {timeout:g} s for position {q % ring.length} of epoch {q // ring.length} (sample {index}) of the "
            f"stream at {ring.store.path}: {running}. Start one with `mmapcache build {ring.store.path} --dataset "
            "SPEC --follow --workers N` or ds.produce(workers=N), or read with on_miss='compute' to compute what is "
            "not ready")


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
        stop = self.per_rank - (self.per_rank - start) % self.batch_size if self.drop_last else self.per_rank
        self._plan.items = [(epoch, a, min(a + self.batch_size, stop)) for a in range(start, stop, self.batch_size)]
        for (epoch, _, end), (stats, batch) in zip(self._plan.items, self._loader):
            reads.consumed(self.rank, self.ranks, epoch, end, stats)
            yield batch
        if stop < self.per_rank:  # drop_last: the short tail is not read, but it is passed
            reads.consumed(self.rank, self.ranks, epoch, self.per_rank, {})

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

    def __init__(self, ds: _StreamDataset, rank: int, ranks: int, pad: PadCollate | None, collate: Any) -> None:
        self.ds, self.rank, self.ranks, self.pad, self.collate = ds, rank, ranks, pad, collate

    def __getitem__(self, key: tuple[int, int, int]) -> tuple[dict[str, int], Any]:
        epoch, k0, k1 = key
        return self.ds.stream_reads().read(epoch, self.rank, self.ranks, k0, k1, self.pad, self.collate,
                                           self.ds.transform)

    def __len__(self) -> int:
        return len(self.ds)


def _whole(batch: Any) -> Any:
    return batch  # each item is already a collated batch


_bypassed: set[str] = set()


def warn_bypass(path: str) -> None:
    """Warns once per stream that it was read by index, which bypasses the ring."""
    if path not in _bypassed:
        _bypassed.add(path)
        warn(f"the stream at {path} was read by index (ds[i], DataLoader(ds)): that computes every sample from the "
             "source and never reads the ring; read a stream through ds.loader()", StreamBypassWarning)
