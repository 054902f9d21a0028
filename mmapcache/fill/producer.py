"""Producers of a stream: processes that compute the next positions of the order into the ring, ahead of readers.

Each producer process opens the stream, registers itself (a shared ``flock`` on ``producers``, which the kernel
drops when it dies), makes its own copy of the source, and loops: claim the next sequence numbers (``Ring.claim``:
a run of them, at most ``S`` ahead of the slowest reader; or one position a dead producer claimed and lost),
compute their samples (checked together, as the loader's batched misses: ``_Runs``),
publish them together (``Ring.publish``/``publish_rows``: those whose reader has already passed them are skipped).
A run is as long as the producer computes in about ``_RUN_SECONDS``, its rows claimed with one byte-range lock.
When the ring is full it polls, backing off to ``_IDLE_POLL``. It stops when told (``Producer.stop``, SIGINT/SIGTERM
for the command line), or when the cache is removed.

``ds.produce(workers=N)`` and ``mmapcache build PATH --dataset SPEC --follow --workers N`` both start them; several
producers (of one or several commands) share the work without computing a position twice.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CacheFormatError, CacheNotFoundError
from ..format.batch import FILLED, SHARED
from ..read.ragged import RaggedColumn
from ..read.reader import RowReader
from ..store.ring import Ring, register_producer
from ..store.store import Store
from ..store.writer import RowWriter
from .misses import all_finite, checker
from .parent import die_with_parent, own_signals

__all__ = ["Producer", "SourceFactory", "StopFlag", "produce"]

_IDLE_POLL = (0.0005, 0.02)  # seconds between claims while the ring is full: from, and at most
# A producer claims, computes and publishes runs of consecutive positions (one writer-lock acquisition each to claim
# and to publish a run, instead of three a position), as many as it computes in about 2 ms (at most a loader's
# batch): a cheap source is not held back by the lock, and a reader never waits much longer for a position than its
# own computation would take.
_RUN_SECONDS = 0.002
_RUN_MAX = 256


class SourceFactory:
    """A picklable ``() -> dataset`` over a dataset object (a spec string's ``DatasetSpec`` is one already)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self) -> Any:
        return self.dataset


def produce(path: str, make_source: Callable[[], Any], stop: Any = None, check_finite: bool = False) -> dict[str, int]:
    """Runs one producer in this process until ``stop`` (an Event) is set, the cache is removed, or
    KeyboardInterrupt. Returns what it did: ``{"produced", "skipped", "failed"}``. With ``check_finite``, a sample
    holding NaN or infinities is not stored (its reader computes it, and refuses it there)."""
    store = Store(path)
    store.attach()  # a user of the cache while it runs (`mmapcache rm` refuses, `ls` counts it)
    reader = RowReader(store, recompute_stale=True)
    ring = Ring(store)
    registration = register_producer(path)
    writer = RowWriter(store)
    writer.passed = ring.passed_rows  # a value without heap room first takes the room of values readers passed
    runs = _Runs(ring, reader, writer, make_source(), check_finite)
    done = {"produced": 0, "skipped": 0, "failed": 0}
    poll, run, seconds_each = _IDLE_POLL[0], 1, 0.0
    try:
        while stop is None or not stop.is_set():
            # Past the positions its readers reach while it computes and publishes the run (with a margin).
            qs = ring.claim(run, horizon=1.5 * run * seconds_each + _IDLE_POLL[0])
            if not qs:
                if store.moved():
                    break
                time.sleep(poll)
                poll = min(2 * poll, _IDLE_POLL[1])
                continue
            started, failed = time.perf_counter(), done["failed"]
            publish = runs.compute(qs, done)
            seconds_each = (time.perf_counter() - started) / len(qs)
            run = _next_run(ring.slots, seconds_each)
            stored, offered, left = publish()
            if left:
                stored += _publish_when_room(ring, writer, left, stop, store)
            done["produced"] += stored
            done["skipped"] += offered - stored
            if left or (done["failed"] > failed and not stored):
                # A full heap (max_bytes) or a sample that fails: the position is abandoned or released, and its
                # reader computes it. While the ring is full it is the one position to claim again: back off
                # instead of spinning on it. Short of heap room, claim one position at a time: every position
                # held for room is one a reader reaching it computes itself.
                time.sleep(poll)
                poll = min(2 * poll, _IDLE_POLL[1])
                run = 1
            else:
                poll = _IDLE_POLL[0]
    except (CacheNotFoundError, CacheFormatError):
        if not store.moved():
            raise
    finally:
        os.close(registration)
        ring.close()
        store.close()
        store.detach()
    return done


# Publishes a computed run: (stored, offered, the items left for want of heap room, still claimed: Ring.publish).
Publish = Callable[[], tuple[int, int, list[tuple[int, Any]]]]


def _publish_when_room(ring: Ring, writer: RowWriter, left: list[tuple[int, Any]], stop: Any, store: Store) -> int:
    """Publishes ``left`` (claimed positions whose values found no heap room) as readers pass the positions before
    them and their values' room is given back, polling with back-off; gives up what still finds none once readers
    reach them (``Ring.room_may_come``), or when told to stop. The ring's heaps, not only its slots, then bound how
    far ahead producers are: planned from a few probes, a ring may have more slots than the heaps hold values.
    A position a reader waits for is given up at once (``Ring.waited_for``), and all of them once a reader waits for
    a position no producer has claimed (``Ring.waited_past_claims``). Returns how many it published; the
    claims of the rest are released (their readers compute them), and they are counted as passing through uncached
    (``RowWriter.gave_up``)."""
    stored, poll, low = 0, _IDLE_POLL[0], ring.low()

    def give_up(items: list[tuple[int, Any]]) -> None:
        for q, _ in items:
            ring.release(q)
            writer.gave_up(writer.waiting.pop(q % ring.slots, writer.ragged[0]))
    try:
        while left and not (stop is not None and stop.is_set()):
            # A waiting reader's cursor cannot move until it is served: room comes no sooner. It computes a
            # position it waits for; one that no producer claimed (they hold theirs) is claimed once these go.
            if ring.waited_past_claims():
                break
            wanted = [ring.waited_for(q) for q, _ in left]
            if any(wanted):
                give_up([item for item, want in zip(left, wanted) if want])
                left = [item for item, want in zip(left, wanted) if not want]
                continue
            if not ring.room_may_come([q for q, _ in left]):
                # Every position before them is passed: all that room is given back at this last try.
                published, left = ring.publish(left)
                stored += published
                break
            time.sleep(poll)
            if ring.low() == low:
                poll = min(2 * poll, _IDLE_POLL[1])
                if store.moved():
                    break
                continue
            low, poll = ring.low(), _IDLE_POLL[0]
            published, left = ring.publish(left)
            stored += published
    finally:
        give_up(left)
        writer.waiting.clear()
    return stored


class _Runs:
    """Computes a claimed run of positions and returns how to publish it. A run is checked together, as the
    loader's batched misses are (``RowReader.fill_batch``): fixed-size fields stacked into columns, ragged ones
    concatenated once into each field's column. A run of fixed-size fields is then published with vectorised steps;
    one with ragged fields a row at a time from those columns (a ring's rows hold earlier values, whose heap extents
    a new value reuses or frees: ``RowWriter.write``), so that values finding no heap room wait as one sample's do
    (``_publish_when_room``). Layouts the batch check does not take (lists, ``max_shapes``), and runs it declines,
    are checked one sample at a time, each value copied (the source may refill one buffer). A sample that raises (or
    holds NaN with ``check_finite``) is given up alone: its position is released unpublished, and its reader computes
    it and sees the error there."""

    def __init__(self, ring: Ring, reader: RowReader, writer: RowWriter, source: Any, check_finite: bool) -> None:
        self.ring, self.reader, self.writer, self.source = ring, reader, writer, source
        self.check_finite, self.checked = check_finite, checker(check_finite)
        # Off for good once the source is seen to refill one buffer for every sample (as Misses.batched).
        self.batched = reader.fill_batch is not None

    def compute(self, qs: list[int], done: dict[str, int]) -> Publish:
        indices = self.ring.indices_of(qs)
        samples = None
        if self.batched and len(qs) > 1:
            publish, samples = self._together(qs, indices)
            if publish is not None:
                return publish
        return self._each(qs, indices, samples, done)

    def _together(self, qs: list[int], indices: list[int]) -> tuple[Publish | None, list[Any] | None]:
        """The run checked and stacked at once; or no publication, with the samples if they may be checked one by
        one (None if they must be computed again: one raised, and a buffer the source refills may hold its bytes)."""
        try:
            samples = [self.source[index] for index in indices]
        except Exception:
            return None, None
        reader = self.reader
        columns = reader.gather(np.full(len(qs), -1, np.int64))[0]
        outcome = reader.fill_batch(samples, columns, None)  # type: ignore[misc]  # (batched: not None)
        if outcome == SHARED:
            self.batched = False
            return None, None
        if outcome != FILLED or (self.check_finite and not all_finite(reader.fields, columns, None)):
            return None, samples
        if reader.ragged:
            return self._rows_of(qs, columns), None
        keys = np.array(qs, np.int64)
        rows, positions = keys % self.ring.slots, np.arange(len(qs))

        def write(todo: np.ndarray) -> None:
            self.writer.write_rows(rows, columns, positions[todo])

        def publish() -> tuple[int, int, list[tuple[int, Any]]]:
            return self.ring.publish_rows(keys, write), len(keys), []
        return publish, None

    def _rows_of(self, qs: list[int], columns: list[Any]) -> Publish:
        """A checked run of a layout with ragged fields, published a row at a time from its columns (each row's
        values: views of the run's own arrays, which nothing else holds)."""
        parts = [column.parts() if isinstance(column, RaggedColumn) else column for column in columns]
        write, slots = self.writer.write, self.ring.slots
        return self._one_by_one([(q, functools.partial(write, q % slots, [values[k] for values in parts]))
                                 for k, q in enumerate(qs)])

    def _each(self, qs: list[int], indices: list[int], samples: list[Any] | None, done: dict[str, int]) -> Publish:
        items = []
        for k, (q, index) in enumerate(zip(qs, indices)):
            try:
                values = self.checked(self.reader, self.source[index] if samples is None else samples[k], index)
            except Exception:
                self.ring.release(q)
                done["failed"] += 1
                continue
            if len(qs) > 1:  # kept until the run is published: not a view of a buffer the source refills
                values = [v.copy() if type(v) is np.ndarray else v for v in values]
            items.append((q, functools.partial(self.writer.write, q % self.ring.slots, values)))
        return self._one_by_one(items)

    def _one_by_one(self, items: list[tuple[int, Any]]) -> Publish:
        """Publishes ``(position, write)`` items, each row's write called under the writer lock (``Ring.publish``)."""
        def publish() -> tuple[int, int, list[tuple[int, Any]]]:
            stored, left = self.ring.publish(items)
            return stored, len(items), left
        return publish


def _next_run(slots: int, seconds_each: float) -> int:
    """How many positions to claim next: as many as take about ``_RUN_SECONDS`` to compute (claimed positions are
    published together, so a reader reaching one waits for the whole run), at most ``_RUN_MAX`` and a sixteenth
    of the ring."""
    return max(1, min(_RUN_MAX, slots // 16, int(_RUN_SECONDS / max(seconds_each, 1e-9))))


def _run(path: str, make_source: Callable[[], Any], stop: Any, parent: int, check_finite: bool, seed: int) -> None:
    own_signals()
    die_with_parent(parent)  # a producer whose starter was killed must not produce for nobody, forever
    reseed(seed)
    # (a cache removed before this producer opened it: its supervisor sees the removal too, and says so)
    with contextlib.suppress(KeyboardInterrupt, CacheNotFoundError):
        produce(path, make_source, stop, check_finite)


def draw_seed() -> int:
    """A seed for a new producer process, drawn from this process's torch generator, as ``DataLoader`` draws its
    workers' base seed (a job that calls ``torch.manual_seed`` draws the same ones)."""
    import torch

    return int(torch.empty((), dtype=torch.int64).random_().item())


def reseed(seed: int) -> None:
    """Seeds Python's, numpy's and torch's global generators in a producer process, as ``DataLoader`` does in its
    workers. A forked process inherits its parent's numpy and torch generators: without this, every producer (and
    the process that started them) drew the same random augmentations, and a stream served copies of one
    augmentation as different samples. (Spawned producers are seeded the same way.)"""
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])


class StopFlag:
    """The flag that tells producer processes to stop, shared with them and taking no lock. A
    ``multiprocessing.Event`` takes a lock shared by every process in ``is_set()``, which producers ask once a run: one
    SIGKILLed while it held it left it held for good, and the other producers, ``replace_dead()`` and ``stop()``
    blocked forever (in a kill storm, about one kill in 250)."""

    def __init__(self, context: Any) -> None:
        self._value = context.RawValue("b", 0)  # one byte in shared memory: read and written whole

    def set(self) -> None:
        self._value.value = 1

    def is_set(self) -> bool:
        return bool(self._value.value)


class Producer:
    """Producer processes started for one stream (``Producer.start``). Stop them with ``stop()`` or by leaving a
    ``with`` block; they also stop when the cache is removed. They never outlive this process: daemons stopped when
    it exits, and each watches it and exits when it is killed (``fill.parent``)."""

    def __init__(self, path: str, make_source: Callable[[], Any], workers: int, context: Any,
                 check_finite: bool = False) -> None:
        self.path, self._make_source, self._context, self._check_finite = path, make_source, context, check_finite
        self._stop = StopFlag(context)
        self.processes = [self._new(k) for k in range(workers)]

    def _new(self, k: int) -> Any:
        process = self._context.Process(target=_run, args=(self.path, self._make_source, self._stop, os.getpid(),
                                                           self._check_finite, draw_seed()),
                                        daemon=True, name=f"mmapcache-producer-{k}")
        process.start()
        return process

    @classmethod
    def start(cls, path: str, make_source: Callable[[], Any], workers: int = 1, context: Any = None,
              check_finite: bool = False) -> Producer:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        if context is None or isinstance(context, str):
            context = multiprocessing.get_context(context or "fork")
        return cls(path, make_source, workers, context, check_finite)

    @property
    def alive(self) -> int:
        """How many of the producer processes are running."""
        return sum(p.is_alive() for p in self.processes)

    def replace_dead(self) -> int:
        """Starts a new process for each one that died (killed: SIGKILL, the OOM killer), unless told to stop;
        returns how many it started. A supervisor (``mmapcache build --follow``) calls it now and then."""
        if self._stop.is_set():
            return 0
        started = 0
        for k, process in enumerate(self.processes):
            if not process.is_alive():
                process.join(0)
                self.processes[k] = self._new(k)
                started += 1
        return started

    def stop(self, timeout: float = 30.0) -> None:
        """Asks the producers to stop after the run each is computing (about ``_RUN_SECONDS``), and waits (then kills
        stragglers)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Producer({self.path!r}, {self.alive} of {len(self.processes)} running)"
