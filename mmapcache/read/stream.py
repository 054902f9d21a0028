"""Reading a stream: a rank's positions of each epoch's order, from the ring where a producer has filled them,
computed where not (each once on the node) or waited for.

``StreamReads`` is one process's reading side of an open stream (made by the dataset when it opens one): where a
rank starts (its cursor, so a restarted reader resumes), the batch of positions ``k0 .. k1-1``, and the cursor's
moves. ``read.stream_loader.StreamLoader`` is what ``ds.loader()`` returns for a stream. The ring itself (order,
cursors, counters) is ``store.ring``, who computes which position ``store.ring_claims``; the producers are
``fill.producer``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import (
    SampleNotCachedError,
    StreamBypassWarning,
    StreamTimeoutError,
    warn,
)
from ..store.ring import Ring, producers_of
from .gather import column_alloc

__all__ = ["StreamReads", "read_positions", "warn_bypass"]


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
        alloc = column_alloc(reader.fields, len(positions))
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


_bypassed: set[str] = set()


def warn_bypass(path: str) -> None:
    """Warns once per stream that it was read by index, which bypasses the ring."""
    if path not in _bypassed:
        _bypassed.add(path)
        warn(f"the stream at {path} was read by index (ds[i], DataLoader(ds)): that computes every sample from the "
             "source and never reads the ring; read a stream through ds.loader()", StreamBypassWarning)
