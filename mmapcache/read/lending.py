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
* The batch crosses as a ``Lent(batch, tags, lending)``, without a file descriptor once its storage is known.
  Torch sends each storage of a batch by passing its descriptor over a socket to a thread of the worker, which
  answers only when it gets the GIL from the worker reading its next batch: measured on 2 cores, a batch of one
  tensor from a storage sent before cost 0.6 ms more than one of none (DataLoader, two workers, 0.4 ms reads). So a
  pool storage is sent by descriptor once, with the first batch carved from it (``Tag.first``), and mapped by the
  main process for as long as its ``Lending`` lives (``Lending.mapped``); each tensor carved from it crosses as its
  place there (``read.carving``: offset, shape, strides, dtype, and a subclass's class, its attributes set after it as
  pickle sets an object's state, so that tensors that hold each other arrive as the same objects). Whatever
  else reaches a storage of the pool (an earlier batch's tensor sent again, a sparse tensor's values, a bare
  storage) crosses as a copy: mapped as the storage the main process knows, it would have no record of this batch,
  and its worker would fill it again.
* Unpickled in the main process (``_arrived``), each lent storage of the batch becomes a storage object of its own
  over the mapped bytes (``torch.frombuffer``), which only that batch's tensors hold, and records a weak reference
  to it (``torch.multiprocessing``'s ``StorageWeakRef``); ``received`` unwraps the batch.
* Each batch the loader hands on (``received``) sweeps the records first: a storage no tensor of the main process
  holds any more (the caller dropped its batch) gets its flag set back to 0, if it still holds that batch's
  generation, and its worker may fill it again. Until then the worker does not touch it, however long the caller
  keeps the batch.

A lent storage that another process may map is that batch's for good: one the main process sends on (a tensor of
the batch put on a multiprocessing queue; ``_escaping`` is wrapped around torch's reducer for storages, which copies
a batch's storage to new shared memory before it sends it), and every one it holds when it forks (``_before_fork``:
the child maps them too). This process's weak reference cannot see
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
import io
import itertools
import os
import random
import threading
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import carving

_SLOTS = 6  # storages per worker: the batches DataLoader prefetches (2), the one being read, two the caller holds
_GONE = -1  # a flag's value once the main process sent its storage on (or forked while holding it)
_ROUND = 64 << 10  # a new storage's size is rounded up to this


class Tag(NamedTuple):
    """One lent storage: whose pool (``key``, ``worker``, ``slot``), which batch (``generation``), which storage of
    that slot (``serial``: a slot gets another when it needs a larger one or its last was sent on), and whether
    this is the first batch sent from it (``first``: the main process has not mapped it yet)."""

    key: str
    worker: int
    slot: int
    generation: int
    serial: int
    first: bool
    storage: torch.UntypedStorage


class Lending:
    """The flags of one set of workers' pools (made in the main process), and, in a worker, its pool."""

    def __init__(self, workers: int, slots: int = _SLOTS) -> None:
        self.key = uuid.uuid4().hex
        self.flags = torch.zeros((workers, slots), dtype=torch.int64).share_memory_()
        self._pool: list[torch.UntypedStorage | None] | None = None  # (a worker's; made on first use)
        # (The main process's:) each pool storage it has mapped, by (worker, slot): its serial, its bytes.
        self.mapped: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        _lendings[self.key] = self

    def __getstate__(self) -> dict[str, Any]:
        return {"key": self.key, "flags": self.flags, "_pool": None, "mapped": {}}

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
                self._serials, self._shown = [0] * len(self._pool), [0] * len(self._pool)
                self._serial = itertools.count(1)
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
                    self._serials[slot] = next(self._serial)
                except RuntimeError:  # shared memory full (a small /dev/shm): give the free ones back, ask exactly
                    for j in free:
                        pool[j] = None
                    return torch.UntypedStorage._new_shared(nbytes), None
            generation, serial = next(self._generations), self._serials[slot]
            first = self._shown[slot] != serial
            row[slot], self._shown[slot] = generation, serial
            storage = pool[slot]
            assert storage is not None
            return storage, Tag(self.key, self._worker, slot, generation, serial, first, storage)

    def addresses(self) -> set[int]:
        """The address of each storage of this worker's pool."""
        with _worker_lock:
            return {storage.data_ptr() for storage in self._pool or () if storage is not None}

    def release(self, tags: list[Tag]) -> None:
        """Frees the storages of a batch that was never sent (its read raised)."""
        for tag in tags:
            if tag.first:  # (never sent: the main process has not mapped it)
                self._shown[tag.slot] = 0
            if self._row[tag.slot] == tag.generation:
                self._row[tag.slot] = 0


class Lent:
    """A worker's batch, the tags of the storages it was carved from, and the worker's ``Lending`` (see the module
    docstring)."""

    def __init__(self, batch: Any, tags: list[Tag], lending: Lending | None = None) -> None:
        self.batch, self.tags, self.lending = batch, tags, lending

    def __reduce__(self) -> tuple[Any, ...]:  # (in the worker: its queue's feeder thread)
        pool = self.lending.addresses() if self.lending is not None else set()
        if not pool:
            return Lent, (self.batch, [])
        buffer = io.BytesIO()
        carving.Carving(buffer, {tag.storage.data_ptr(): n for n, tag in enumerate(self.tags)}, pool).dump(self.batch)
        entries = [(t.key, t.worker, t.slot, t.generation, t.serial, t.storage if t.first else None)
                   for t in self.tags]
        return _arrived, (entries, buffer.getvalue())

    def pin_memory(self, device: Any = None) -> Lent:  # (DataLoader's pin_memory thread)
        from torch.utils.data._utils.pin_memory import pin_memory

        return Lent(pin_memory(self.batch, device), [])


def _arrived(entries: list[tuple[Any, ...]], payload: bytes) -> Lent:
    """A lent batch, unpickled in the main process: its tensors made in storages of their own that alias the
    worker's pool storages, each mapped here once (see the module docstring)."""
    storages = []
    with _locked():
        for key, worker, slot, generation, serial, storage in entries:
            lending = _lendings.get(key)
            mapped = lending.mapped if lending is not None else {}
            if storage is not None:  # (the first batch from this storage: mapped here from now on)
                mapped[(worker, slot)] = (serial, torch.empty(0, dtype=torch.uint8).set_(storage).numpy())
            known = mapped.get((worker, slot))
            if known is None or known[0] != serial:
                raise RuntimeError(f"mmapcache: a batch of DataLoader worker {worker} names a shared storage this "
                                   "process never received (its loader was dropped while its workers ran?)")
            batch_storage = torch.frombuffer(known[1], dtype=torch.uint8).untyped_storage()
            storages.append(batch_storage)
            if lending is not None:
                _settle(batch_storage.data_ptr())  # (the batch before it from this storage: dropped, or gone)
                _pending[batch_storage.data_ptr()] = (lending.flags.numpy()[worker], slot, generation,
                                                      StorageWeakRef(batch_storage))
    return Lent(carving.Uncarving(payload, storages).load(), [])


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
_gc_lock = threading.Lock()
_collectors, _collecting = 0, False  # (threads in ``_locked``; whether the collector was on when the first came)


@contextmanager
def _locked() -> Iterator[None]:
    """``_lock``, with the garbage collector off: a collection inside could finalise a DataLoader iterator whose
    shutdown waits for its pin_memory thread, itself waiting here for the lock. (Counted: a thread that finds it
    off because another thread turned it off must not hold the lock with it turned back on, nor turn it on.)"""
    global _collectors, _collecting
    with _gc_lock:  # (nothing allocated inside: no collection can start while it is held)
        if _collectors == 0:
            _collecting = gc.isenabled()
            gc.disable()
        _collectors += 1
    try:
        with _lock:
            yield
    finally:
        with _gc_lock:
            _collectors -= 1
            if _collectors == 0 and _collecting:
                gc.enable()


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
    global _lock, _worker_lock, _starting_lock, _gc_lock, _collectors
    _pending.clear()
    _lock, _worker_lock, _starting_lock, _gc_lock = (threading.Lock() for _ in range(4))
    if _collectors and _collecting:  # (forked while another thread of the parent held ``_lock``: not here)
        gc.enable()
    _collectors = 0


_watch_escapes()
os.register_at_fork(before=_before_fork, after_in_child=_after_fork)
