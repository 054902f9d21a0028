"""A worker's batch storages, lent to the main process and reused once it has dropped them.

A new shared-memory storage costs its size: torch reserves every page of it when it makes it (``fallocate``, about
0.5 ms a megabyte on 2 cores), and the kernel zeroes each page. A worker that made one per batch (``read.arena``)
spent most of a padded text batch's time there. Here each worker keeps a few storages and carves its batches from
one that the main process no longer maps:

* ``Lending`` is made in the main process by a loader, just before it starts its workers, and is sent to them with
  the reader (``lending.starting``). It holds a small shared table of flags, one row per worker, one column per
  storage of that worker's pool: 0 is free; any other value is the generation of the batch lent in it.
* In a worker, ``Lending.storage(nbytes)`` takes a free storage of at least ``nbytes`` (or makes one, a quarter
  larger, so that the next, slightly longer batch fits), marks its flag with a new generation and returns a
  ``Tag``. All its storages lent or being filled: a storage of its own, as without a pool (never a wait).
* The batch crosses as a ``Lent(batch, tags)``. Unpickled in the main process, it records a weak reference to each
  lent storage (``torch.multiprocessing``'s ``StorageWeakRef``) and keeps only the batch: ``received`` unwraps it.
* Each batch the loader hands on (``received``) sweeps the records first: a storage no tensor of the main process
  holds any more (the caller dropped its batch) gets its flag set back to 0, if it still holds that batch's
  generation, and its worker may fill it again. Until then the worker does not touch it, however long the caller
  keeps the batch.

A lent storage that another process may map is that batch's for good: one the main process sends on (a tensor of
the batch put on a multiprocessing queue; ``_escaping`` is wrapped around torch's reducer for storages), and every
one it holds when it forks (``_before_fork``: the child maps them too). This process's weak reference cannot see
those mappings, so its record is dropped and its flag set to ``_GONE``; its worker lets go of it and makes another.
A worker also leaves alone a storage that anything in it still holds (a transform that kept a tensor of a batch).

Memory: a worker holds at most ``_SLOTS`` storages, each at most a quarter more than the largest batch it read (what
it has in flight at its busiest), for as long as it lives; a caller that keeps more batches than that has them in
storages of their own.

Only the worker that set a flag and the main process write it, and only the main process clears one: a row is never
shared by two processes, because each set of workers gets a ``Lending`` of its own (``starting``). A batch that the
main process discards unread (an abandoned epoch's prefetch) is unpickled all the same, so its storages come back
too. A worker killed mid-batch loses only its pool.
"""

from __future__ import annotations

import gc
import itertools
import os
import random
import threading
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

_SLOTS = 6  # storages per worker: the batches DataLoader prefetches (2), the one being read, two the caller holds
_GONE = -1  # a flag's value once the main process sent its storage on (or forked while holding it)
_ROUND = 64 << 10  # a new storage's size is rounded up to this


class Tag(NamedTuple):
    """One lent storage: whose pool (``key``, ``worker``, ``slot``) and which batch (``generation``)."""

    key: str
    worker: int
    slot: int
    generation: int
    storage: torch.UntypedStorage


class Lending:
    """The flags of one set of workers' pools (made in the main process), and, in a worker, its pool."""

    def __init__(self, workers: int, slots: int = _SLOTS) -> None:
        self.key = uuid.uuid4().hex
        self.flags = torch.zeros((workers, slots), dtype=torch.int64).share_memory_()
        self._pool: list[torch.UntypedStorage | None] | None = None  # (a worker's; made on first use)
        _lendings[self.key] = self

    def __getstate__(self) -> dict[str, Any]:
        return {"key": self.key, "flags": self.flags, "_pool": None}

    # --- in a worker ---------------------------------------------------------------------------------------------

    def storage(self, nbytes: int) -> tuple[torch.UntypedStorage, Tag | None]:
        """A storage of at least ``nbytes`` for a batch this worker is reading: a free one of its pool (with the
        tag that lends it), or, none free, one of its own (no tag)."""
        with _worker_lock:
            if self._pool is None:
                self._pool = [None] * self.flags.shape[1]
                self._worker = torch.utils.data.get_worker_info().id  # type: ignore[union-attr]
                self._row = self.flags.numpy()[self._worker]
                self._generations = itertools.count(random.getrandbits(40) + 1)
            pool, row = self._pool, self._row
            for j in range(len(pool)):
                if row[j] == _GONE:  # sent on from the main process: that batch's for good; this slot gets another
                    pool[j], row[j] = None, 0
            # Free: the main process holds none of it, and nothing in this worker does either (a transform that kept
            # a tensor of an earlier batch, or the queue still sending it: only the pool's own reference is left).
            free = [j for j in range(len(pool)) if row[j] == 0 and (
                pool[j] is None or torch._C._storage_Use_Count(pool[j]._cdata) == 1)]  # type: ignore[union-attr]
            if not free:
                return torch.UntypedStorage._new_shared(nbytes), None
            sizes = [0 if storage is None else storage.nbytes() for storage in pool]
            fits = [j for j in free if sizes[j] >= nbytes]
            if fits:
                slot = min(fits, key=sizes.__getitem__)
            else:  # the free storage least worth keeping (none, or the smallest) makes way for a larger one
                slot = min(free, key=sizes.__getitem__)
                pool[slot] = None
                try:
                    pool[slot] = torch.UntypedStorage._new_shared(-(-(nbytes + nbytes // 4) // _ROUND) * _ROUND)
                except RuntimeError:  # shared memory full (a small /dev/shm): give the free ones back, ask exactly
                    for j in free:
                        pool[j] = None
                    return torch.UntypedStorage._new_shared(nbytes), None
            generation = next(self._generations)
            row[slot] = generation
            storage = pool[slot]
            assert storage is not None
            return storage, Tag(self.key, self._worker, slot, generation, storage)

    def release(self, tags: list[Tag]) -> None:
        """Frees the storages of a batch that was never sent (its read raised)."""
        for tag in tags:
            if self._row[tag.slot] == tag.generation:
                self._row[tag.slot] = 0


class Lent:
    """A worker's batch and the tags of the storages it was carved from (see the module docstring)."""

    def __init__(self, batch: Any, tags: list[Tag]) -> None:
        self.batch, self.tags = batch, tags

    def __setstate__(self, state: dict[str, Any]) -> None:  # (in the main process)
        self.batch, self.tags = state["batch"], []
        _record(state["tags"])

    def pin_memory(self, device: Any = None) -> Lent:  # (DataLoader's pin_memory thread)
        from torch.utils.data._utils.pin_memory import pin_memory

        return Lent(pin_memory(self.batch, device), [])


def received(obj: Any) -> Any:
    """The batch a worker sent (unwrapped if lent), after freeing the storages of batches the caller dropped."""
    _sweep()
    return obj.batch if type(obj) is Lent else obj


@contextmanager
def starting(reader: Any, workers: int) -> Iterator[Lending]:
    """Lends the storages of the workers that a DataLoader starts in this block to the main process: ``reader``,
    what it sends them, carries a ``Lending`` of their own while they start. Outside the block the reader carries
    none, so workers that some other DataLoader starts from it return plain batches. The caller keeps the
    ``Lending`` it yields for as long as those workers may send batches (its flags are their pools'). (One block
    at a time: workers started from one reader by two threads at once would otherwise share a ``Lending``.)"""
    with _starting_lock:
        reader.lending = lending = Lending(workers)
        try:
            yield lending
        finally:
            reader.lending = None


# --- the main process's records ------------------------------------------------------------------------------------

_lendings: weakref.WeakValueDictionary[str, Lending] = weakref.WeakValueDictionary()
# Each lent storage the main process maps, by its address there: its worker's row of flags, its slot, its generation.
_pending: dict[int, tuple[np.ndarray, int, int, StorageWeakRef]] = {}
_lock = threading.Lock()  # (batches arrive in the pin_memory thread too)
_worker_lock = threading.Lock()
_starting_lock = threading.Lock()


@contextmanager
def _locked() -> Iterator[None]:
    """``_lock``, with the garbage collector off: a collection inside could finalise a DataLoader iterator whose
    shutdown waits for its pin_memory thread, itself waiting here for the lock."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with _lock:
            yield
    finally:
        if collecting:
            gc.enable()


def _record(tags: list[Tag]) -> None:
    with _locked():
        for tag in tags:
            lending = _lendings.get(tag.key)
            if lending is not None:  # (else its loader is gone: so are its workers, after this batch)
                _settle(tag.storage.data_ptr())  # (a dropped storage mapped at the same address before)
                _pending[tag.storage.data_ptr()] = (lending.flags.numpy()[tag.worker], tag.slot, tag.generation,
                                                    StorageWeakRef(tag.storage))


def _sweep() -> None:
    if not _pending:
        return
    with _locked():
        for address in list(_pending):
            _settle(address)


def _settle(address: int, gone: bool = False) -> None:
    """Frees the storage recorded at ``address`` if no tensor of this process holds it any more, or, ``gone``
    (another process may map it), gives it up for good. Under ``_lock``."""
    entry = _pending.get(address)
    if entry is None:
        return
    row, slot, generation, ref = entry
    expired = ref.expired()  # (once: a storage unmapped here is in no process forked from now on)
    if expired or gone:
        del _pending[address]
        if row[slot] == generation:
            row[slot] = 0 if expired else _GONE


def _watch_escapes() -> None:
    """Wraps torch's reducer for storages (registered with multiprocessing's pickler) in ``_escaping``."""
    from multiprocessing.reduction import ForkingPickler

    reduce = ForkingPickler._extra_reducers.get(torch.UntypedStorage)  # type: ignore[attr-defined]
    if reduce is not None:

        def escaping(storage: torch.UntypedStorage) -> Any:
            _escaping(storage)
            return reduce(storage)

        ForkingPickler.register(torch.UntypedStorage, escaping)


def _escaping(storage: torch.UntypedStorage) -> None:
    """A storage about to be sent to another process: if it is lent, it is that batch's for good."""
    if _pending:
        with _locked():
            _settle(storage.data_ptr(), gone=True)


def _before_fork() -> None:
    """A process forked now maps every storage this one does: those lent are their batches' for good."""
    if _pending:
        with _locked():
            for address in list(_pending):
                _settle(address, gone=True)


def _after_fork() -> None:  # (in the child) none of the parent's records; its locks anew
    global _lock, _worker_lock, _starting_lock
    _pending.clear()
    _lock, _worker_lock, _starting_lock = threading.Lock(), threading.Lock(), threading.Lock()


_watch_escapes()
os.register_at_fork(before=_before_fork, after_in_child=_after_fork)
