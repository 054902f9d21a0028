"""A DataLoader worker's batch in one shared-memory storage, so that its tensors cross to the main process as one.

A worker sends every storage of a batch's tensors through a file descriptor of its own (torch's
``file_descriptor`` sharing: a socket round trip each); tensors that are views of one storage cross with one.
Measured on 2 cores with two workers, a batch of three (64, 600) int64 tensors and a (64,) one: four storages
2.5-3.5 ms a batch, four views of one storage 1.3-1.9 ms. A padded text batch (ids, mask, labels, lengths) has four
or more, a padding-free one five. (Carved from a pool storage the main process has already mapped, a batch crosses
with no descriptor at all: ``read.lending``.)

Shared memory is not free room: torch reserves every page of a new storage when it makes it (``fallocate``, about
0.5 ms a megabyte here), so an arena is made to the size a batch asks for, never larger on a guess:

* In a worker, ``read(fn, ...)`` reads one batch with the arena open. A reader that knows how many bytes its big
  tensors take calls ``reserve(nbytes)`` first; ``tensor(shape, dtype)`` (which ``gather.alloc_shared`` and
  ``heap_batch.filled`` call there) then carves each from that one storage.
* A small tensor that finds no room (made before the reservation: a label column) is made in private memory; one
  that finds none and is not small gets a storage of its own (as without an arena).
* When the batch is read, every small tensor it holds outside the arena (those, and what the reader made
  elsewhere: lengths, ``cu_seqlens``) is copied into the room the reservation kept for them (the last batch's
  small bytes), or else, all together, into one more storage.

A worker started by a loader that lends its storages back (``read.lending``: ``ds.loader``, mixtures, streams)
carves its arenas from a pool of storages it reuses once the main process drops them, so their pages are reserved
once, not for every batch; ``from_workers`` is that loader's side.

On the main side, ``detach_small(batch)`` copies out each small view of a larger storage (labels, lengths): one
kept after its batch is dropped (labels gathered for an epoch's metrics) then holds a few bytes, not the batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import lending
from .lending import Lending, Lent, Tag

_ALIGN = 64  # every tensor starts on a cache line (and on a multiple of any element size)
_SMALL = 64 << 10  # at most this many bytes: made privately, then copied in (worker); copied out (main process)
_LEAVES = (str, bytes, int, float, bool, type(None))


def _aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // _ALIGN) * _ALIGN


class _Arena(threading.local):
    """This thread's open arena: the storage being carved, and the room the last batch needed beyond its
    reservation. (Per thread: batches read by two threads of a worker at once never carve the same bytes.)"""

    def __init__(self) -> None:
        self.depth = 0
        self.storage: torch.UntypedStorage | None = None
        self.used = self.reserved = 0  # bytes carved; the end of the last reservation
        self.slack = _ALIGN
        self.lending: Lending | None = None  # the worker's pool of storages, if its loader lends them
        self.tags: list[Tag] = []  # the pool's storages this batch was carved from

    def new(self, nbytes: int) -> torch.UntypedStorage:
        """A storage for this batch: a free one of the worker's pool, if it has one, else a new one."""
        if self.lending is None:
            return torch.UntypedStorage._new_shared(nbytes)
        storage, tag = self.lending.storage(nbytes)
        if tag is not None:
            self.tags.append(tag)
        return storage

    def reserve(self, nbytes: int) -> None:
        if self.storage is None or self.used + nbytes > self.storage.nbytes():
            self.storage, self.used = self.new(nbytes + self.slack), 0
        self.reserved = self.used + nbytes

    def take(self, nbytes: int) -> tuple[torch.UntypedStorage, int] | None:
        """A storage and the offset of ``nbytes`` free in it; None for a small tensor the arena has no room for."""
        size = _aligned(nbytes)
        if self.storage is not None and self.used + size <= self.storage.nbytes():
            at, self.used = self.used, self.used + size
            return self.storage, at
        return None if nbytes <= _SMALL else (self.new(size), 0)

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.storage is not None and tensor.untyped_storage().data_ptr() == self.storage.data_ptr()


_arena = _Arena()


def active() -> bool:
    """Whether a worker's batch is being read with the arena open (what a reader asks before it sums a
    reservation)."""
    return _arena.depth > 0


def reserve(nbytes: int, tensors: int) -> None:
    """In a worker's batch: makes the next ``tensors`` tensors of ``tensor``, of ``nbytes`` in all, and the small
    tensors' room, one storage."""
    if _arena.depth:
        _arena.reserve(_aligned(nbytes + tensors * _ALIGN))


def tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor, in shared memory (the open arena's, or a storage of its own) or, small and finding
    no room in the arena, in private memory until the batch is packed."""
    empty = torch.empty(0, dtype=dtype)
    size, count, strides = empty.element_size(), 1, []
    for n in reversed(shape):
        strides.append(count)
        count *= n
    if _arena.depth == 0:
        place: tuple[torch.UntypedStorage, int] | None = (torch.UntypedStorage._new_shared(max(1, count * size)), 0)
    else:
        place = _arena.take(count * size)
    if place is None:
        return torch.empty(shape, dtype=dtype)
    return empty.set_(place[0], place[1] // size, shape, strides[::-1])


def like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised tensor of ``t``'s shape and dtype (or ``dtype``): ``tensor``'s in a worker's batch, else
    private."""
    dtype = t.dtype if dtype is None else dtype
    return tensor(tuple(t.shape), dtype) if _arena.depth else torch.empty_like(t, dtype=dtype)


def read(pool: Lending | None, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: one batch, read in a DataLoader worker with the arena open and packed after (see
    the module's docstring); elsewhere as it is. With a ``pool`` (``read.lending``: the loader that started the
    worker lends its storages back), the arena is carved from the worker's pool and the batch returned as a
    ``Lent``, which the loader's ``lending.received`` unwraps."""
    if torch.utils.data.get_worker_info() is None:
        return fn(*args, **kwargs)
    outer = _arena.depth == 0
    if outer:
        _arena.lending, _arena.tags = pool, []
    _arena.depth += 1
    try:
        batch = fn(*args, **kwargs)
        if not outer:
            return batch
        batch = _packed(batch)
        return batch if pool is None else Lent(batch, _arena.tags, pool)
    except BaseException:
        if outer and pool is not None:
            pool.release(_arena.tags)  # (never sent: free again)
        raise
    finally:
        _arena.depth -= 1
        if outer:  # (the batch's tensors hold the storage)
            _arena.storage, _arena.used, _arena.reserved, _arena.lending, _arena.tags = None, 0, 0, None, []


def _packed(batch: Any) -> Any:
    """``batch`` with its small tensors outside the arena copied into the arena's room, or into one storage."""
    loose: dict[int, torch.Tensor] = {}  # (by identity: a tensor in two places stays one)

    def find(t: torch.Tensor) -> torch.Tensor:
        if type(t) is torch.Tensor and t.nbytes <= _SMALL and not t.requires_grad and not _arena.holds(t):
            loose[id(t)] = t
        return t
    _mapped(batch, find)
    if not loose:
        _arena.slack = max(_ALIGN, _arena.used - _arena.reserved)
        return batch
    total = sum(_aligned(t.nbytes) for t in loose.values())
    _arena.slack = total + max(0, _arena.used - _arena.reserved)  # the next batch's room for what no one reserved
    if _arena.storage is None or _arena.used + total > _arena.storage.nbytes():
        _arena.storage, _arena.used = _arena.new(total), 0
    copies = {key: tensor(tuple(t.shape), t.dtype).copy_(t) for key, t in loose.items()}
    return _mapped(batch, lambda t: copies.get(id(t), t))


def from_workers(loader: Any, start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """The batches ``start()`` (``loader``'s DataLoader iterator: it has workers) yields, as the main process hands
    them on: each worker's storages lent back (``read.lending``), small views copied out (``detach_small``)."""
    if loader.persistent_workers and getattr(loader, "_iterator", None) is not None:
        batches = start()  # (its workers, started before, keep their pools)
    else:
        with lending.starting(loader.dataset, loader.num_workers) as lent:
            batches = start()
        batches._mmapcache_lending = lent  # type: ignore[attr-defined]  # (while its workers send batches)
    return map(received, batches)


def received(batch: Any) -> Any:
    """A batch from a worker, in the main process: unwrapped (``lending.received``), small views copied out."""
    return detach_small(lending.received(batch))


def detach_small(batch: Any) -> Any:
    """``batch`` with each small tensor that is a view of a larger shared storage (a worker's arena) copied out."""
    copies: dict[int, torch.Tensor] = {}  # (by identity: a tensor in two places stays one)

    def detach(t: torch.Tensor) -> torch.Tensor:
        if type(t) is torch.Tensor and t.nbytes <= _SMALL and (
                t.untyped_storage().nbytes() > 2 * t.nbytes + _ALIGN):
            if id(t) not in copies:  # (a leaf that requires grad, as it arrived, stays one)
                copies[id(t)] = t.detach().clone().requires_grad_() if t.requires_grad and t.is_leaf else t.clone()
            return copies[id(t)]
        return t
    return _mapped(batch, detach)


def _mapped(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to each tensor in it, through dicts, lists, tuples and named tuples (what
    collates return); anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    kind = type(obj)
    if kind is dict:
        return {key: _mapped(value, fn) for key, value in obj.items()}
    if kind is list:
        return obj if all(type(x) in _LEAVES for x in obj) else [_mapped(x, fn) for x in obj]
    if kind is tuple:
        return tuple(_mapped(x, fn) for x in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        try:
            return kind(*[_mapped(x, fn) for x in obj])
        except TypeError:  # (a tuple type made otherwise, torch.return_types': left as it is, still right)
            return obj
    return obj
