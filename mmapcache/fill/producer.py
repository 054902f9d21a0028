"""Producers of a stream: processes that compute the next positions of the order into the ring, ahead of readers.

Each producer process opens the stream, registers itself (a shared ``flock`` on ``producers``, which the kernel
drops when it dies), makes its own copy of the source, and loops: claim the next sequence number (``Ring.claim``:
at most ``S`` ahead of the slowest reader; a position a dead producer claimed is claimed again), compute that
position's sample, publish it (``Ring.publish``: skipped if its reader has already passed it). When the ring is
full it polls, backing off to ``_IDLE_POLL``. It stops when told (``Producer.stop``, SIGINT/SIGTERM for the
command line), or when the cache is removed.

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

from ..errors import CacheFormatError, CacheNotFoundError
from ..read.reader import RowReader
from ..store.ring import Ring, register_producer
from ..store.state import NoRoom
from ..store.store import Store
from ..store.writer import RowWriter
from .parent import die_with_parent

__all__ = ["Producer", "SourceFactory", "produce"]

_IDLE_POLL = (0.0005, 0.02)  # seconds between claims while the ring is full: from, and at most


class SourceFactory:
    """A picklable ``() -> dataset`` over a dataset object (a spec string's ``DatasetSpec`` is one already)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self) -> Any:
        return self.dataset


def produce(path: str, make_source: Callable[[], Any], stop: Any = None) -> dict[str, int]:
    """Runs one producer in this process until ``stop`` (an Event) is set, the cache is removed, or
    KeyboardInterrupt. Returns what it did: ``{"produced", "skipped", "failed"}``."""
    store = Store(path)
    store.attach()  # a user of the cache while it runs (`mmapcache rm` refuses, `ls` counts it)
    reader, writer = RowReader(store, recompute_stale=True), RowWriter(store)
    ring = Ring(store)
    registration = register_producer(path)
    source = make_source()
    done = {"produced": 0, "skipped": 0, "failed": 0}
    poll = _IDLE_POLL[0]
    try:
        while stop is None or not stop.is_set():
            q = ring.claim()
            if q is None:
                if store.moved():
                    break
                time.sleep(poll)
                poll = min(2 * poll, _IDLE_POLL[1])
                continue
            poll = _IDLE_POLL[0]
            index = ring.index_of(q)
            try:
                values = reader.check(source[index], index)
            except Exception:
                # The reader computes this position itself, and sees the source's exception there, in context.
                ring.release(q)
                done["failed"] += 1
                continue
            try:
                stored = ring.publish(q, functools.partial(writer.write, q % ring.slots, values))
            except NoRoom:
                # A full heap (max_bytes): the position is abandoned, and its reader computes it (Ring.abandoned).
                # Until readers pass it, it is the one position to claim again: back off instead of spinning on it.
                stored = False
                time.sleep(poll)
                poll = min(2 * poll, _IDLE_POLL[1])
            done["produced" if stored else "skipped"] += 1
    except (CacheNotFoundError, CacheFormatError):
        if not store.moved():
            raise
    finally:
        os.close(registration)
        ring.close()
        store.close()
        store.detach()
    return done


def _run(path: str, make_source: Callable[[], Any], stop: Any, parent: int) -> None:
    die_with_parent(parent)  # a producer whose starter was killed must not produce for nobody, forever
    with contextlib.suppress(KeyboardInterrupt):
        produce(path, make_source, stop)


class Producer:
    """Producer processes started for one stream (``Producer.start``). Stop them with ``stop()`` or by leaving a
    ``with`` block; they also stop when the cache is removed. They never outlive this process: daemons stopped when
    it exits, and each watches it and exits when it is killed (``fill.parent``)."""

    def __init__(self, path: str, make_source: Callable[[], Any], workers: int, context: Any) -> None:
        self.path, self._make_source, self._context = path, make_source, context
        self._stop = context.Event()
        self.processes = [self._new(k) for k in range(workers)]

    def _new(self, k: int) -> Any:
        process = self._context.Process(target=_run, args=(self.path, self._make_source, self._stop, os.getpid()),
                                        daemon=True, name=f"mmapcache-producer-{k}")
        process.start()
        return process

    @classmethod
    def start(cls, path: str, make_source: Callable[[], Any], workers: int = 1, context: Any = None) -> Producer:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        if context is None or isinstance(context, str):
            context = multiprocessing.get_context(context or "fork")
        return cls(path, make_source, workers, context)

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
        """Asks the producers to stop after the sample each is computing, and waits (then kills stragglers)."""
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
