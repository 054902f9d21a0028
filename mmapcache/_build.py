"""Parallel fill of a cache: ``build()``, shared by ``mmapcache build`` and by code.

Work is split into *chunks* of ``chunk_rows(rows)`` consecutive rows (row ``r = slot * variants + variant``). A
worker claims a chunk (a POSIX byte-range lock on byte ``chunk`` of the cache's ``lock`` file, dropped by the
kernel if the worker dies), fills the chunk's rows that are unfilled or stale, and releases it. Concurrent builds
on one cache therefore skip each other's chunks instead of computing the same samples; chunks found claimed are
revisited at the end (waiting for their holder), so a build returns only when its part is complete.

The workers are PyTorch DataLoader workers iterating a small dataset whose items are chunks: each builds its own
copy of the source from a ``DatasetSpec`` and writes straight into the shared cache, returning only counts.

``shard=(i, n)`` keeps the chunks ``c`` with ``c % n == i``: ``n`` disjoint parts that together cover every row,
each spread over the whole index range (so a partly filled cache still splits evenly). Under ``torchrun``
(``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` set), ``shard="auto"`` takes the local rank's part: each node has its own
``/dev/shm``, so the ranks of one node share the work of filling that node's cache.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ._filled import ChunkClaims
from ._sizes import format_size
from ._specs import DatasetSpec
from ._paths import resolve_path
from ._store import Store
from ._open import Request, Source, open_cache
from ._options import CreateOptions
from .errors import BuildWorkerDiedError, CacheReadOnlyError

__all__ = ["build", "BuildReport", "Failure", "chunk_rows", "auto_shard", "parse_shard", "parse_range"]

_POLL = 0.5  # seconds between scans for new work in follow mode
_CLAIM_POLL = 0.05  # seconds between attempts on a chunk another build holds


def chunk_rows(rows: int) -> int:
    """Rows per chunk (the unit of claims and of work handed to a worker). A function of the cache alone, so
    every build of one cache agrees on what chunk ``c`` is."""
    return max(1, min(64, rows // 256))


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
    or a concurrent process); ``failed``: samples whose source raised; ``bytes``: bytes of rows stored."""

    path: str
    filled: int = 0
    skipped: int = 0
    failed: list[Failure] = dataclasses.field(default_factory=list)
    elapsed: float = 0.0
    bytes: int = 0
    marked_stale: int = 0
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed and not self.interrupted

    def summary(self) -> str:
        rate = self.filled / self.elapsed if self.elapsed > 0 else 0.0
        state = " (interrupted)" if self.interrupted else ""
        return (f"{self.path}: filled {self.filled}, skipped {self.skipped} (already there), failed {len(self.failed)}, "
                f"{self.elapsed:.1f} s, {rate:.1f} samples/s, {format_size(self.bytes)} written{state}")


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``."""
    i, sep, n = text.partition("/")
    try:
        shard = (int(i), int(n))
    except ValueError:
        shard = (-1, 0)
    if not sep or not 0 <= shard[0] < shard[1]:
        raise ValueError(f"shard {text!r} is not I/N with 0 <= I < N; pass e.g. 0/4 for the first of four parts")
    return shard


def parse_range(text: str) -> tuple[int, int | None]:
    """``"A:B"`` (either side may be empty) -> ``(A, B or None)`` with ``0 <= A < B``."""
    a, sep, b = text.partition(":")
    try:
        start = int(a) if a.strip() else 0
        stop = int(b) if b.strip() else None
    except ValueError:
        start, stop = -1, None
    if not sep or start < 0 or (stop is not None and stop <= start):
        raise ValueError(f"indices {text!r} is not a range A:B of source indices with 0 <= A < B; pass e.g. 0:1000")
    return start, stop


def auto_shard() -> tuple[int, int] | None:
    """The local rank's part under torchrun (``LOCAL_RANK``/``LOCAL_WORLD_SIZE``), else None."""
    rank, size = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if rank is None or size is None:
        return None
    try:
        shard = (int(rank), int(size))
    except ValueError:
        return None
    return shard if 0 <= shard[0] < shard[1] else None


# --- the work, in DataLoader workers ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What every worker needs to know (picklable)."""

    path: str
    source: DatasetSpec
    chunk: int
    start: int
    stop: int | None
    fail_fast: bool


class _Worker:
    """A worker process's open cache, source and claims (made on its first task, kept for its lifetime: closing
    any descriptor of the lock file would drop this process's claims)."""

    def __init__(self, plan: _Plan) -> None:
        from ._reader import RowReader

        self.store = Store(plan.path)
        self.reader = RowReader(self.store, recompute_stale=True)
        self.claims = ChunkClaims(plan.path)
        self.dataset = plan.source()
        self.variants = self.store.variants
        self.set_epoch = getattr(self.dataset, "set_epoch", None) if self.variants > 1 else None


class _Filler:
    """A map-style dataset whose item ``t`` fills chunk ``chunks[t]`` and returns counts (DataLoader protocol)."""

    def __init__(self, plan: _Plan, chunks: Sequence[int], wait: bool) -> None:
        self.plan = plan
        self.chunks = list(chunks)
        self.wait = wait
        self._worker: _Worker | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, task: int) -> dict[str, Any]:
        if self._pid != os.getpid():
            self._worker, self._pid = _Worker(self.plan), os.getpid()
        worker = self._worker
        chunk = self.chunks[task]
        result: dict[str, Any] = {"chunk": chunk, "busy": False, "filled": 0, "skipped": 0, "failed": []}
        while not worker.claims.try_claim(chunk):
            if not self.wait:
                result["busy"] = True
                return result
            time.sleep(_CLAIM_POLL)
        try:
            self._fill_chunk(worker, chunk, result)
        finally:
            worker.claims.release(chunk)
        return result

    def _fill_chunk(self, worker: _Worker, chunk: int, result: dict[str, Any]) -> None:
        plan, state, reader = self.plan, worker.store.state, worker.reader
        rows = _chunk_targets(worker.store, plan, chunk)
        todo = ~state.filled_rows(rows) | state.stale_rows(rows)
        result["skipped"] += int((~todo).sum())
        slot_index = worker.store.slot_index
        for row in rows[todo].tolist():
            slot, variant = divmod(row, worker.variants)
            index = slot if slot_index is None else int(slot_index[slot])
            try:
                if worker.set_epoch is not None:
                    worker.set_epoch(variant)  # sources that key their augmentation on the epoch
                values = reader.check(worker.dataset[index], index)
                stored = state.publish(row, lambda: reader.write(row, values))
            except Exception as exc:  # a bad sample must not stop the others (unless fail_fast)
                result["failed"].append((index, variant, f"{type(exc).__name__}: {exc}"))
                if plan.fail_fast:
                    return
                continue
            result["filled" if stored else "skipped"] += 1


def _chunk_targets(store: Store, plan: _Plan, chunk: int) -> np.ndarray:
    """The rows of ``chunk`` whose source index is in the plan's range."""
    rows = np.arange(chunk * plan.chunk, min((chunk + 1) * plan.chunk, store.rows), dtype=np.int64)
    return rows[_in_range(store, plan, rows)]


def _in_range(store: Store, plan: _Plan, rows: np.ndarray) -> np.ndarray:
    slots = rows // store.variants
    index = slots if store.slot_index is None else store.slot_index[slots]
    keep = index >= plan.start
    if plan.stop is not None:
        keep &= index < plan.stop
    return keep


def _identity(x: Any) -> Any:
    return x


# --- the driver, in the calling process ------------------------------------------------------------------------


def build(
    path: str | os.PathLike[str],
    source: str | Callable[[], Any] | DatasetSpec,
    *,
    kwargs: dict[str, Any] | None = None,
    workers: int | None = None,
    shard: tuple[int, int] | str | None = "auto",
    indices: tuple[int, int | None] | None = None,
    fingerprint: str | None = None,
    max_bytes: int | str | None = None,
    variants: int | None = None,
    max_shapes: dict[str, Sequence[int]] | None = None,
    refresh: float | None = None,
    follow: bool = False,
    fail_fast: bool = False,
    deterministic: bool = True,
    progress: bool = False,
    out: Any = None,
) -> BuildReport:
    """Fills every unfilled (or stale) row of a cache in parallel, creating the cache if it is missing.

    Safe to run while other builds and training processes use the cache: chunk claims keep builds from
    computing the same samples, and the cache's publication protocol keeps every row consistent. Interrupting a
    build (Ctrl-C, SIGKILL) leaves a consistent cache; running it again fills only what is missing.

    Args:
        path: the cache directory (a bare name resolves under ``$MMAPCACHE_DIR``).
        source: a spec (``package.module:name`` or ``path/to/file.py:name``) or a callable returning the
            source dataset; each worker calls it to make its own copy.
        kwargs: keyword arguments for the spec or callable.
        workers: worker processes (default: usable CPUs, divided among local ranks under torchrun).
        shard: ``(i, n)``: fill only the i-th of n disjoint parts (see the module docstring); ``"auto"``: the
            local rank's part under torchrun, else everything; None: everything.
        indices: ``(start, stop)``: only source indices in ``[start, stop)`` (stop None: to the end).
        fingerprint, max_bytes, variants, max_shapes: as for ``MmapCachedDataset``: used when the cache is
            created; checked against an existing cache (fingerprint, variants).
        refresh: first mark this fraction of the filled rows stale, then refill them.
        follow: after filling, keep refilling rows that become unfilled or stale (another process's
            ``refresh``), polling every 0.5 s, until interrupted (KeyboardInterrupt; the CLI maps SIGTERM to it).
        fail_fast: stop at the first sample whose source raises.
        deterministic: whether the source returns the same sample for the same index every time. Without a
            fingerprint, opening an existing cache recomputes its first sample and refuses the cache if the bytes
            differ (a changed source); a source with random augmentation, or one that changed on purpose before a
            ``refresh``, is declared ``deterministic=False`` (its layout is still checked).
        progress: print progress to ``out`` (a tqdm bar on a terminal, else a line every 5 s).
        out: stream for progress (default ``sys.stdout``).

    Returns:
        A ``BuildReport``; ``report.interrupted`` is set when a KeyboardInterrupt ended the build.
    """
    started = time.monotonic()
    path = resolve_path(path)
    spec = source if isinstance(source, DatasetSpec) else DatasetSpec(source, kwargs)
    if shard == "auto":
        shard = auto_shard()
        if shard is not None and workers is None:
            workers = max(1, len(os.sched_getaffinity(0)) // shard[1])
    if workers is None:
        workers = len(os.sched_getaffinity(0))
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if refresh is not None and (isinstance(refresh, bool) or not 0 <= refresh <= 1):
        raise ValueError(f"refresh must be a fraction in [0, 1], got {refresh!r}")
    store = _open_or_create(path, spec, fingerprint=fingerprint, max_bytes=max_bytes, variants=variants,
                            max_shapes=max_shapes, deterministic=deterministic)
    report = BuildReport(path)
    try:
        if refresh:
            report.marked_stale = _mark_stale(store, refresh, None)
        start, stop = indices if indices is not None else (0, None)
        plan = _Plan(path, spec, chunk_rows(store.rows), start, stop, fail_fast)
        driver = _Driver(store, plan, workers, shard, report, progress, out or sys.stdout, started)
        driver.run(follow)
    finally:
        _release(store)
        report.elapsed = time.monotonic() - started
    return report


def _open_or_create(path: str, spec: DatasetSpec, *, fingerprint: str | None, max_bytes: Any,
                    variants: int | None, max_shapes: dict[str, Sequence[int]] | None, deterministic: bool) -> Store:
    """Opens the cache, checking that it matches the source (its first sample's layout, and its bytes without a
    fingerprint: before any worker starts), or creates it. Returns it registered as used by this process."""
    dataset = spec()

    def fetch(index: int) -> Any:
        try:
            return dataset[index]
        except Exception as exc:
            exc.add_note(f"mmapcache: raised by the source dataset computing sample {index} for the cache at {path}")
            raise

    request = Request(path, fingerprint, CreateOptions(max_bytes, None, variants, max_shapes))
    store, _ = open_cache(request, Source(len(dataset), fetch, deterministic=deterministic))
    if not store.writable:
        _release(store)
        raise CacheReadOnlyError(f"the cache at {path} is read-only for this process (file permissions or a "
                                 "read-only mount); run the build as the cache's owner")
    return store


def _release(store: Store) -> None:
    store.close()
    store.detach()


def _mark_stale(store: Store, fraction: float, seed: int | None) -> int:
    """Marks a random ``fraction`` of the filled rows stale (``seed`` None: a fresh choice every call)."""
    filled = np.flatnonzero(store.state.filled_mask())
    rows = np.random.default_rng(seed).choice(filled, size=int(round(fraction * len(filled))), replace=False)
    return store.state.mark_stale(rows)


class _Driver:
    """Runs rounds of DataLoader workers over the chunks that have work, and keeps the report and progress."""

    def __init__(self, store: Store, plan: _Plan, workers: int, shard: tuple[int, int] | None, report: BuildReport,
                 progress: bool, out: Any, started: float) -> None:
        self.store, self.plan, self.workers, self.report = store, plan, workers, report
        self.out, self.started = out, started
        n_chunks = -(-store.rows // plan.chunk)
        chunks = np.arange(n_chunks, dtype=np.int64)
        if shard is not None:
            chunks = chunks[chunks % shard[1] == shard[0]]
        rows = (chunks[:, None] * plan.chunk + np.arange(plan.chunk)).reshape(-1)
        rows = rows[rows < store.rows]
        self.rows = rows[_in_range(store, plan, rows)]  # every row this build is responsible for
        self.row_bytes = store.layout.row_bytes + sum(8 * len(f.shape) for f in store.layout.fields if f.variable)
        self.failed_rows: set[int] = set()
        self.progress = progress
        self.bar: Any = None
        self.last_line = started
        self.total = 0
        self.following = False
        self.missing = 0

    def _todo_chunks(self) -> tuple[np.ndarray, int, int]:
        """Chunks holding rows that are unfilled or stale (failed ones excluded); how many of this build's rows
        those chunks hold (workers report each of them), and how many done rows lie outside them."""
        state = self.store.state
        todo = ~state.filled_rows(self.rows) | state.stale_rows(self.rows)
        if self.failed_rows:
            todo &= ~np.isin(self.rows, np.fromiter(self.failed_rows, np.int64))
        chunk_of = self.rows // self.plan.chunk
        chunks = np.unique(chunk_of[todo])
        in_chunks = np.isin(chunk_of, chunks)
        self.missing = int(todo.sum())
        return chunks, int(in_chunks.sum()), int((~in_chunks).sum())

    def run(self, follow: bool) -> None:
        chunks, self.total, done = self._todo_chunks()
        self.report.skipped += done  # the rows in `chunks` that are done are counted by the workers
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

    def _round(self, chunks: Sequence[int], wait: bool) -> list[int]:
        """Fills the given chunks with the worker processes; returns the chunks found claimed by others."""
        from torch.utils.data import DataLoader

        if not len(chunks):
            return []
        filler = _Filler(self.plan, [int(c) for c in chunks], wait)
        loader = DataLoader(filler, batch_size=None, shuffle=False, num_workers=min(self.workers, len(chunks)),
                            collate_fn=_identity)
        busy = []
        it: Iterator[dict[str, Any]] = iter(loader)
        try:
            for result in it:
                if result["busy"]:
                    busy.append(result["chunk"])
                self._account(result)
                if self._stop():
                    break
        except RuntimeError as exc:
            if "DataLoader worker" not in str(exc):
                raise
            # Killed by a signal (the OOM killer, a crash in native code): what it stored is consistent.
            raise BuildWorkerDiedError(f"a build worker died ({exc}); the cache is consistent: rerun the same command to "
                                 "fill what is missing, with fewer --workers if memory ran out") from exc
        finally:
            del it  # shuts the workers down now, also on interrupt
        return busy

    def _account(self, result: dict[str, Any]) -> None:
        report = self.report
        report.filled += result["filled"]
        if not self.following:
            report.skipped += result["skipped"]
        report.bytes += result["filled"] * self.row_bytes
        variants = self.store.variants
        lookup = self.store.slot_lookup() if result["failed"] else None  # an array of N: only when needed
        for index, variant, error in result["failed"]:
            report.failed.append(Failure(index, variant, error))
            slot = index if lookup is None else int(lookup[index])
            self.failed_rows.add(slot * variants + variant)
        self._show(result["filled"] + result["skipped"] + len(result["failed"]))

    # --- progress ----------------------------------------------------------------------------------------------

    def _start_progress(self) -> None:
        if not self.progress:
            return
        if getattr(self.out, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="sample", file=self.out, dynamic_ncols=True,
                            desc=os.path.basename(self.plan.path))
        else:
            print(f"{self.plan.path}: {self.missing} of {len(self.rows)} rows to fill, {self.workers} workers",
                  file=self.out, flush=True)

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
