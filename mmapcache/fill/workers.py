"""The work of a build, in its worker processes: claiming chunks of rows and filling them from the source.

Work is split into *chunks* of ``chunk_rows(rows, row_bytes)`` consecutive rows. A worker claims a chunk (a
byte-range lock on byte ``chunk`` of the cache's ``lock`` file, ``store.lock.ChunkClaims``, dropped by the kernel if
the worker dies), fills
the chunk's rows that are unfilled or stale (computed, checked and stored as one batch), and releases it. A *task*
is a chunk, or one row of a chunk (how ``fill.build`` finds a sample that kills its worker: see
``fill.build._Driver._isolate``).

The workers are PyTorch DataLoader workers iterating a ``Filler``, a small dataset whose items are tasks: each
builds its own copy of the source from a ``DatasetSpec`` and writes straight into the shared cache, returning only
counts and failures.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any

import numpy as np

from ..errors import CacheFormatError, CacheNotFoundError
from ..read.reader import RowReader
from ..store.lock import ChunkClaims
from ..store.rows import RowMap
from ..store.state import NoRoom
from ..store.store import Store
from ..store.writer import RowWriter
from .misses import Misses
from .specs import DatasetSpec

__all__ = ["Plan", "Filler", "chunk_rows", "chunk_targets", "Task"]

_CLAIM_POLL = 0.05  # seconds between attempts on a chunk another build holds

Task = tuple[int, int]  # (chunk, row): row -1 means every row of the chunk


def chunk_rows(rows: int, row_bytes: int = 0) -> int:
    """Rows per chunk (the unit of claims and of work handed to a worker, computed, checked and stored as one
    batch): at least 64 chunks (for the workers to share), at most 1,024 rows and about 4 MB of fixed-size fields
    (``row_bytes`` a row). A function of the cache alone, so every build of one cache agrees on what chunk ``c``
    is. (Before 0.5: at most 64 rows, at least 256 chunks; a chunk's work costs about the same whatever its size, so
    the per-row cost of small ones came from their count.)"""
    return max(1, min(1024, rows // 64, (4 << 20) // max(1, row_bytes)))


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every worker needs to know (picklable)."""

    path: str
    source: DatasetSpec
    chunk: int
    start: int
    stop: int | None
    fail_fast: bool
    check_finite: bool = False  # refuse samples holding NaN or infinities (each a failed sample)


def chunk_targets(rows: RowMap, plan: Plan, chunk: int) -> np.ndarray:
    """The rows of ``chunk`` whose source index is in the plan's range."""
    targets = np.arange(chunk * plan.chunk, min((chunk + 1) * plan.chunk, rows.rows), dtype=np.int64)
    return targets[in_range(rows, plan, targets)]


def in_range(rows: RowMap, plan: Plan, targets: np.ndarray) -> np.ndarray:
    """Which of the rows ``targets`` hold a source index in ``[plan.start, plan.stop)``."""
    index, _ = rows.index_and_variant(targets)
    keep = index >= plan.start
    if plan.stop is not None:
        keep &= index < plan.stop
    return keep


class _Worker:
    """A worker process's open cache, source and claims (made on its first task, kept for its lifetime)."""

    def __init__(self, plan: Plan) -> None:
        self.store = Store(plan.path)
        self.rows = RowMap.of(self.store)
        self.reader = RowReader(self.store, recompute_stale=True)
        self.writer = RowWriter(self.store)
        self.claims = ChunkClaims(plan.path, self.store.state.lock.identity)
        self.dataset = plan.source()
        self.misses = Misses(self.dataset, self.store, self.rows, self.reader, check_finite=plan.check_finite)
        self.set_epoch = getattr(self.dataset, "set_epoch", None) if self.store.variants > 1 else None

    def heap_bytes(self) -> int:
        """Bytes of ragged values this worker has written into the heaps so far."""
        return self.writer.heap_bytes + self.misses.writer.heap_bytes


class Filler:
    """A map-style dataset whose item ``t`` performs task ``tasks[t]`` and returns counts (DataLoader protocol).

    A result is ``{"chunk", "busy", "filled", "skipped", "failed": [(index, variant, error)], "removed",
    "no_room": [row], "heap_bytes"}`` (rows not stored for lack of heap room; bytes of ragged values written):
    ``busy`` when the chunk was claimed by another build (and ``wait`` is off), ``removed`` (a message) when the
    cache was removed or replaced under the build, which then stops.
    """

    def __init__(self, plan: Plan, tasks: list[Task], wait: bool) -> None:
        self.plan = plan
        self.tasks = list(tasks)
        self.wait = wait
        self._worker: _Worker | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, task: int) -> dict[str, Any]:
        if self._pid != os.getpid():
            self._worker, self._pid = _Worker(self.plan), os.getpid()
        worker = self._worker
        assert worker is not None  # made just above
        chunk, row = self.tasks[task]
        result: dict[str, Any] = {"chunk": chunk, "busy": False, "filled": 0, "skipped": 0, "failed": [],
                                  "removed": None, "no_room": [], "heap_bytes": 0}
        try:
            while not worker.claims.try_claim(chunk):
                if not self.wait:
                    result["busy"] = True
                    return result
                time.sleep(_CLAIM_POLL)
        except CacheFormatError as exc:  # the lock file replaced: removed under us (`mmapcache rm --force`)?
            if not worker.store.moved():
                raise
            result["removed"] = str(exc)
            return result
        written = worker.heap_bytes()
        try:
            self._fill(worker, chunk, row, result)
        finally:
            worker.claims.release(chunk)
            result["heap_bytes"] = worker.heap_bytes() - written
        return result

    def _fill(self, worker: _Worker, chunk: int, only: int, result: dict[str, Any]) -> None:
        """Computes the chunk's rows that are unfilled or stale, checks them together and stores them under one
        acquisition of the writer lock (``Misses.fill``, the loader's path), a variant at a time; a sample that
        fails is recorded and the others stored."""
        plan, state = self.plan, worker.store.state
        targets = chunk_targets(worker.rows, plan, chunk)
        if only >= 0:
            targets = targets[targets == only]
        todo = ~state.filled_rows(targets, worker.rows.keys_of(targets)) | state.stale_rows(targets)
        result["skipped"] += int((~todo).sum())
        rows = targets[todo]
        indices, variants = worker.rows.index_and_variant(rows)
        for variant in np.unique(variants).tolist() if worker.set_epoch is not None else [None]:
            group = slice(None) if variant is None else variants == variant
            if worker.set_epoch is not None:
                worker.set_epoch(variant)  # sources that key their augmentation on the epoch
            if not self._fill_rows(worker, indices[group], rows[group], variants[group], result):
                return

    def _fill_rows(self, worker: _Worker, indices: np.ndarray, rows: np.ndarray, variants: np.ndarray,
                   result: dict[str, Any]) -> bool:
        """Fills ``rows`` (of source ``indices``) as a batch; False when the build must stop (a removed cache, or
        a failure under ``fail_fast``)."""
        plan, variant = self.plan, int(variants[0]) if len(variants) else 0
        failed: list[int] = []

        def record(index: int, exc: Exception) -> None:
            failed.append(index)
            result["failed"].append((index, variant, f"{type(exc).__name__}: {exc}"))
            if plan.fail_fast:
                raise _Stop

        no_room: list[int] = []
        columns = worker.misses.empty_columns(len(rows))
        try:
            stored = worker.misses.fill(indices, rows, columns, list(range(len(rows))), rewrite_stale=True,
                                        on_error=record, no_room=no_room)
        except _Stop:  # the samples computed before the failure were stored (Misses.fill's own finally)
            done = worker.store.state.filled_rows(rows, worker.rows.keys_of(rows)) & ~worker.store.state.stale_rows(
                rows)
            result["filled"] += int(done.sum())
            return False
        except (CacheFormatError, CacheNotFoundError) as exc:
            if worker.store.moved():  # removed under us (`mmapcache rm --force`): not a sample's fault
                result["removed"] = str(exc)
                return False
            # Damage met while storing (a heap's extent): each row again alone, so that it names its sample.
            return self._fill_each(worker, indices, rows, variant, result)
        result["filled"] += stored
        result["no_room"] += no_room
        result["skipped"] += len(rows) - stored - len(failed) - len(no_room)
        return True

    def _fill_each(self, worker: _Worker, indices: np.ndarray, rows: np.ndarray, variant: int,
                   result: dict[str, Any]) -> bool:
        """Fills ``rows`` one at a time, each published alone (where a batch met damage)."""
        plan, state, reader = self.plan, worker.store.state, worker.reader
        for row, index in zip(rows.tolist(), indices.tolist()):
            try:
                values = worker.misses.checked(reader, worker.dataset[index], index)
                try:
                    stored = state.publish(row, index, functools.partial(worker.writer.write, row, values))
                except NoRoom:
                    result["no_room"].append(row)  # the heap is full: reported, not an error of the sample
                    continue
            except (CacheFormatError, CacheNotFoundError) as exc:
                if worker.store.moved():
                    result["removed"] = str(exc)
                    return False
                result["failed"].append((index, variant, f"{type(exc).__name__}: {exc}"))
                if plan.fail_fast:
                    return False
                continue
            except Exception as exc:  # a bad sample must not stop the others (unless fail_fast)
                result["failed"].append((index, variant, f"{type(exc).__name__}: {exc}"))
                if plan.fail_fast:
                    return False
                continue
            result["filled" if stored else "skipped"] += 1
        return True


class _Stop(Exception):
    """A failure under ``fail_fast``: the chunk's fill stops there."""
