"""Driving a build from the calling process: rounds of DataLoader workers over the chunks that have work, the
report, progress, and what happens when a worker dies (see ``fill.workers`` for the workers' side).

Concurrent builds on one cache skip each other's chunks (claims); chunks found claimed are revisited at the end,
waiting for their holder, so a build returns only when its part is complete. A sample that kills its worker is
found by redoing the dead worker's chunks one row at a time, named, and skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import CacheNotFoundError
from ..format.sizes import format_size
from ..store.rows import RowMap
from ..store.store import Store
from .parent import die_with_parent
from .workers import Filler, Plan, Task, chunk_targets, in_range

__all__ = ["Driver", "BuildReport", "Failure"]

_POLL = 0.5  # seconds between scans for new work in follow mode
_PREFETCH = 2  # tasks a DataLoader worker holds at once (its prefetch_factor): what a dead worker may have held


@dataclasses.dataclass(frozen=True)
class Failure:
    """A sample whose computation or storing raised."""

    index: int
    variant: int
    error: str

    def __str__(self) -> str:
        variant = f" (variant {self.variant})" if self.variant else ""
        return f"sample {self.index}{variant}: {self.error}"


@dataclasses.dataclass
class BuildReport:
    """What a build did. ``filled``: rows this build stored; ``skipped``: rows already filled (by an earlier run
    or a concurrent process); ``failed``: samples whose source raised; ``bytes``: bytes of the values stored (the
    rows' fixed fields, and ragged values as their heaps hold them)."""

    path: str
    filled: int = 0
    skipped: int = 0
    failed: list[Failure] = dataclasses.field(default_factory=list)
    elapsed: float = 0.0
    bytes: int = 0
    marked_stale: int = 0
    refresh_seed: int | None = None
    interrupted: bool = False
    share: str | None = None  # the node share the cache holds, described (node k of N: M indices)
    no_room: int = 0  # rows not stored because a heap had no room (max_bytes, or the file system)
    stream: bool = False  # a stream's producers ran: ``filled`` counts values produced, ``skipped`` those too late
    # Rows stored between the first chunk's result and the last, and the seconds between: the fill's own rate,
    # without starting the workers and building their sources (the benchmark's marginal cost per sample).
    steady: tuple[int, float] = (0, 0.0)

    @property
    def ok(self) -> bool:
        return not self.failed and not self.interrupted

    def summary(self) -> str:
        rate = self.filled / self.elapsed if self.elapsed > 0 else 0.0
        state = " (interrupted)" if self.interrupted else ""
        if self.stream and self.share:  # (a stream's "share": a local rank that leaves producing to local rank 0)
            return f"{self.path}: {self.share}"
        if self.stream:
            return (f"{self.path}: produced {self.filled}, {self.skipped} too late for their reader, "
                    f"{self.elapsed:.1f} s, {rate:.1f} samples/s{state}")
        return (f"{self.path}: filled {self.filled}, skipped {self.skipped} (already there), "
                f"failed {len(self.failed)}, "
                + (f"not stored for lack of heap room {self.no_room} (raise --max-bytes or free space), "
                   if self.no_room else "")
                + f"{self.elapsed:.1f} s, {rate:.1f} samples/s, {format_size(self.bytes)} written{state}"
                + (f"; share: {self.share}" if self.share else ""))



def _identity(x: Any) -> Any:
    return x


class Driver:
    """Runs rounds of DataLoader workers over the chunks that have work, and keeps the report and progress."""

    def __init__(self, store: Store, plan: Plan, workers: int, shard: tuple[int, int] | None, report: BuildReport,
                 progress: bool, out: Any, started: float) -> None:
        self.store, self.plan, self.workers, self.report = store, plan, workers, report
        self.rowmap = RowMap.of(store)
        self.out, self.started = out, started
        self._first_result: tuple[float, int] | None = None  # when the first chunk reported, and the rows then
        n_chunks = -(-store.rows // plan.chunk)
        chunks = np.arange(n_chunks, dtype=np.int64)
        if shard is not None:
            chunks = chunks[chunks % shard[1] == shard[0]]
        rows = (chunks[:, None] * plan.chunk + np.arange(plan.chunk)).reshape(-1)
        rows = rows[rows < store.rows]
        self.rows = rows[in_range(self.rowmap, plan, rows)]  # every row this build is responsible for
        self.row_bytes = store.layout.row_bytes + sum(8 * len(f.shape) for f in store.layout.fields if f.variable)
        self.failed_rows: set[int] = set()
        self.progress = progress
        self.bar: Any = None
        self.last_line = started
        self.total = 0
        self.following = False
        self.missing = 0
        self.reported = 0  # tasks the current pass has reported so far
        self.made: dict[int, int] = {}  # chunk -> rows this build stored when it created the cache

    def created(self) -> None:
        """This build created the cache: the rows filled now (its first sample and layout probes) are filled by this
        build, not skipped, wherever the count of their chunk's done rows arrives from (or never, if interrupted)."""
        state = self.store.state
        # (not the stale ones: refresh= marked them before this build began, and its workers refill them)
        rows = self.rows[state.filled_rows(self.rows, self.rowmap.keys_of(self.rows)) & ~state.stale_rows(self.rows)]
        self.report.filled += len(rows)
        self.report.bytes += self._bytes_of(rows)
        chunks, counts = np.unique(rows // self.plan.chunk, return_counts=True)
        self.made = dict(zip(chunks.tolist(), counts.tolist()))

    def _skipped(self, done: int, chunks: Iterable[int]) -> None:
        """Counts ``done`` rows of ``chunks`` found done as skipped, less those this build stored creating it."""
        self.report.skipped += done - sum(self.made.pop(int(c), 0) for c in chunks)

    def _todo_chunks(self) -> tuple[np.ndarray, int, int]:
        """Chunks holding rows that are unfilled or stale (failed ones excluded); how many of this build's rows
        those chunks hold (workers report each of them), and how many done rows lie outside them."""
        state = self.store.state
        todo = ~state.filled_rows(self.rows, self.rowmap.keys_of(self.rows)) | state.stale_rows(self.rows)
        if self.failed_rows:
            todo &= ~np.isin(self.rows, np.fromiter(self.failed_rows, np.int64))
        chunk_of = self.rows // self.plan.chunk
        chunks = np.unique(chunk_of[todo])
        in_chunks = np.isin(chunk_of, chunks)
        self.missing = int(todo.sum())
        return chunks, int(in_chunks.sum()), int((~in_chunks).sum())

    def run(self, follow: bool) -> None:
        chunks, self.total, done = self._todo_chunks()
        # the rows in `chunks` that are done are counted by the workers
        self._skipped(done, set(self.made) - set(chunks.tolist()))
        try:
            self._start_progress()
            busy = self._round(chunks, wait=False)
            if not self._stop() and busy:
                self._round(busy, wait=True)  # chunks another build held: wait for it, fill what it left
            self.following = True  # from now on, rows found filled are not news: count only what is refilled
            while follow:
                chunks, rows, _ = self._todo_chunks()
                if len(chunks):
                    self.total += rows
                    busy = self._round(chunks, wait=False)
                    if len(busy) == len(chunks):
                        time.sleep(_POLL)  # all held by other builds: let them work instead of respawning workers
                else:
                    time.sleep(_POLL)
        except KeyboardInterrupt:
            self.report.interrupted = True
        finally:
            if self.bar is not None:
                self.bar.close()

    def _stop(self) -> bool:
        return self.plan.fail_fast and bool(self.report.failed)

    def _round(self, chunks: Sequence[int] | np.ndarray, wait: bool) -> list[int]:
        """Fills the given chunks with the worker processes; returns the chunks found claimed by others.

        A worker that dies (a sample that crashes native code, calls ``os._exit``, or draws the OOM killer) takes
        no other work down: the chunks it may have held (those not reported yet, up to the loader's prefetch
        depth) are redone one row at a time (``_isolate``), which names the killing sample; the rest go on.
        """
        tasks: list[Task] = [(int(c), -1) for c in chunks]
        busy: list[int] = []
        while tasks:
            workers = min(self.workers, len(tasks))
            todo_before = self._todo_mask()
            try:
                reported, died = self._pass(tasks, wait, workers, busy)
            except KeyboardInterrupt:
                # The workers are shut down: what they stored for tasks they never reported is this build's too.
                self._count_lost_results(tasks[self.reported:self.reported + workers * _PREFETCH], todo_before)
                raise
            if not died or self._stop():
                break
            in_flight = tasks[reported:reported + workers * _PREFETCH]
            self._count_lost_results(in_flight, todo_before)
            self._isolate(in_flight)
            tasks = tasks[reported + len(in_flight):]
        return busy

    def _todo_mask(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Over ``rows`` (default: every row of the build), whether each is still to store: not filled with its
        sample, or stale."""
        rows = self.rows if rows is None else rows
        state = self.store.state
        return ~state.filled_rows(rows, self.rowmap.keys_of(rows)) | state.stale_rows(rows)

    def _count_lost_results(self, tasks: list[Task], todo_before: np.ndarray) -> None:
        """Counts the rows of tasks whose results died with their loader: stored since ``todo_before`` (filled by
        this build's workers) or done before (skipped)."""
        mask = np.isin(self.rows // self.plan.chunk, [chunk for chunk, _ in tasks])
        done_now = ~self._todo_mask()[mask]
        was_todo = todo_before[mask]
        stored = was_todo & done_now
        self.report.filled += int(stored.sum())
        self.report.bytes += self._bytes_of(self.rows[mask][stored])
        if not self.following:
            self._skipped(int((~was_todo).sum()), [chunk for chunk, _ in tasks])

    def _pass(self, tasks: list[Task], wait: bool, workers: int, busy: list[int]) -> tuple[int, bool]:
        """Runs ``tasks`` on ``workers`` DataLoader workers; returns how many reported, and whether one died.
        Results arrive in task order, so the first ``reported`` tasks are done."""
        from torch.utils.data import DataLoader

        # Filler is a map-style dataset by protocol (__len__, __getitem__), not by torch's base class.
        loader: DataLoader[dict[str, Any]] = DataLoader(
            Filler(self.plan, tasks, wait), batch_size=None, shuffle=False,  # type: ignore[arg-type]
            num_workers=workers, collate_fn=_identity, prefetch_factor=_PREFETCH,
            worker_init_fn=functools.partial(_watch_parent, os.getpid()))
        reported = self.reported = 0
        it: Iterator[dict[str, Any]] = iter(loader)
        try:
            for result in it:
                reported = self.reported = reported + 1
                if result["removed"]:
                    raise CacheNotFoundError(
                        f"the cache at {self.plan.path} was removed while this build filled it (`mmapcache rm "
                        f"--force`?); nothing more was written. Build it again to fill a new one ({result['removed']})"
                    )
                if result["busy"]:
                    busy.append(result["chunk"])
                self._account(result)
                now = time.monotonic()
                if self._first_result is None:
                    self._first_result = (now, self.report.filled)
                else:
                    self.report.steady = (self.report.filled - self._first_result[1], now - self._first_result[0])
                if self._stop():
                    break
        except RuntimeError as exc:
            if "DataLoader worker" not in str(exc):
                raise
            return reported, True  # killed or exited: what it stored is consistent (the seqlock)
        finally:
            # Shut the workers down now. On an interrupt, dropping the iterator is not enough: the traceback's
            # frames hold it, and its workers would go on storing rows after the build counted them.
            getattr(it, "_shutdown_workers", lambda: None)()
            del it
        return reported, False

    def _isolate(self, tasks: list[Task]) -> None:
        """Redoes ``tasks`` (chunks a dead worker may have held) one row at a time in one fresh worker: when it
        dies, the row after the last one it stored killed it. That sample is listed as failed and skipped.

        Not simply the first row it did not report: a result the worker had queued just before it died can die
        with it (its queue's feeder thread had not written it yet), and the row it stands for was stored.
        """
        rows: list[Task] = []
        for chunk, _ in tasks:
            targets = chunk_targets(self.rowmap, self.plan, chunk)
            rows += [(chunk, int(r)) for r in self._todo(targets) if int(r) not in self.failed_rows]
        while rows:
            before = self._todo(np.array([r for _, r in rows], np.int64))
            reported, died = self._pass(rows, True, 1, [])
            if not died or self._stop():
                return
            pending = rows[reported:]
            targets = np.array([r for _, r in pending], np.int64)
            stored = np.isin(targets, before) & ~np.isin(targets, self._todo(targets))
            # The worker takes its rows in order: it died on the one after the last it stored. Rows before that one
            # it left unstored (a source error whose report died with it) are tried again.
            at = int(np.flatnonzero(stored)[-1]) + 1 if stored.any() else 0
            self.report.filled += int(stored.sum())
            self.report.bytes += self._bytes_of(targets[stored])
            if at == len(pending):
                return
            killer = pending[at][1]
            index, variant = (int(x[0]) for x in self.rowmap.index_and_variant(np.array([killer])))
            self.report.failed.append(Failure(index, variant, "its build worker died computing it (a crash in "
                                              "native code, os._exit, or the OOM killer); skipped"))
            self.failed_rows.add(killer)
            rows = [task for task, done in zip(pending[:at], stored[:at]) if not done] + pending[at + 1:]

    def _bytes_of(self, rows: np.ndarray) -> int:
        """Bytes of the values ``rows`` hold, as a worker counts what it writes: their fixed fields, and each ragged
        value's elements in its heap (read from the index rows, for rows stored without a result: the cache's
        creation, or a worker that died before reporting)."""
        total = len(rows) * self.row_bytes
        for field, index in zip(self.store.layout.fields, self.store.index):
            if index is not None and len(rows):
                shapes = index[rows, 2:]
                total += int(np.prod(shapes, axis=1, dtype=np.int64).sum()) * field.value_itemsize
        return total

    def _todo(self, targets: np.ndarray) -> np.ndarray:
        """The rows of ``targets`` still to store."""
        return targets[self._todo_mask(targets)]

    def _account(self, result: dict[str, Any]) -> None:
        report = self.report
        report.filled += result["filled"]
        if not self.following and not result["busy"]:
            self._skipped(result["skipped"], [result["chunk"]])
        report.bytes += result["filled"] * self.row_bytes + result["heap_bytes"]
        report.no_room += len(result["no_room"])
        self.failed_rows.update(result["no_room"])  # not tried again in this build (--follow would spin on them)
        for index, variant, error in result["failed"]:
            report.failed.append(Failure(index, variant, error))
            self.failed_rows.add(self.rowmap.slot(index) * self.rowmap.variants + variant)
        self._show(result["filled"] + result["skipped"] + len(result["failed"]) + len(result["no_room"]))

    # --- progress ----------------------------------------------------------------------------------------------

    def _start_progress(self) -> None:
        if not self.progress:
            return
        if getattr(self.out, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="sample", file=self.out, dynamic_ncols=True,
                            desc=os.path.basename(self.plan.path))
        else:
            workers = f"{self.workers} worker" + ("s" if self.workers > 1 else "")
            print(f"{self.plan.path}: {self.missing} of {len(self.rows)} rows to fill, {workers}", file=self.out,
                  flush=True)

    def _show(self, n: int) -> None:
        if not self.progress:
            return
        if self.bar is not None:
            if self.bar.total != self.total:
                self.bar.total = self.total
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last_line >= 5.0:
            self.last_line = now
            elapsed = now - self.started
            done = self.report.filled + len(self.report.failed)
            rate = self.report.filled / elapsed if elapsed > 0 else 0.0
            left = max(0, self.total - done)
            eta = f"{left / rate:.0f} s" if rate > 0 else "?"
            print(f"{self.plan.path}: {done}/{self.total} rows ({self.report.filled} filled, {len(self.report.failed)} "
                  f"failed), {rate:.1f} samples/s, ETA {eta}", file=self.out, flush=True)


def _watch_parent(parent: int, worker_id: int) -> None:
    """A build worker exits as soon as the build that started it dies (torch's own watch waits for its task to
    end: a whole chunk of samples computed for nobody)."""
    die_with_parent(parent)
