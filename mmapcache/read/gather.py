"""Copying many rows at once: recycled batch buffers and a gather split over threads.

Two costs dominate a warm batch besides the copy itself, and this module removes both:

* Fresh memory. A new multi-megabyte array is page-faulted (and zeroed by the kernel) on first touch, which makes
  the copy into it ~1.3x slower than into a buffer used before. ``BufferPool`` hands out a previous batch's array
  again once nothing references it any more (its reference count says so: every numpy view and every tensor made
  by ``torch.from_numpy``, including views of that tensor, holds a reference to it). A batch the caller still
  holds is never reused.
* One thread (opt-in, ``MMAPCACHE_GATHER_THREADS=N``). ``numpy.take`` releases the GIL while it copies, so a
  large gather split into row ranges can run on several cores at once (``take``).
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

# Below this many bytes per thread, handing work to another thread costs more than it saves.
_MIN_BYTES_PER_THREAD = 1 << 20
_MAX_THREADS = 4
# Buffers kept per (shape, dtype), and shapes remembered (the last batch of an epoch is usually shorter).
# Two per shape: a loop still holds the previous batch while the next one is gathered.
_BUFFERS_PER_KEY = 2
_MAX_KEYS = 8
# Buffers of any size kept (``BufferPool.bytes``): a batch's padded fields and masks (PadCollate(mask=True) of two
# fields makes four), for the batch the loop holds, the next, and one more.
_FLAT_BUFFERS = 12


def _free_count() -> int:
    """What ``sys.getrefcount`` reports, in ``BufferPool.empty``'s loop, for an array only a list refers to.

    Measured rather than assumed: interpreters differ in whether the call's own argument counts (3.14 skips some
    reference count updates), and a wrong constant would hand out a batch someone still holds.
    """
    buffers = [np.empty(1)]
    k = 0
    return sys.getrefcount(buffers[k])  # the same expression as in the loop


_FREE = _free_count()
# Free-threaded builds count references per thread, so the count seen here may not be the whole truth: no reuse.
_RECYCLE = getattr(sys, "_is_gil_enabled", lambda: True)()


class BufferPool:
    """Uninitialised arrays, like ``numpy.empty``, recycled once no one else references them. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[tuple[Any, ...], list[np.ndarray]] = {}
        self._flat: list[np.ndarray] = []  # buffers of any size, for arrays whose shapes vary (see ``bytes``)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if not _RECYCLE:
            return np.empty(shape, dtype)
        key = (shape, dtype)
        with self._lock:
            buffers = self._buffers.get(key)
            if buffers is None:
                if len(self._buffers) >= _MAX_KEYS:
                    self._buffers.pop(next(iter(self._buffers)))
                buffers = self._buffers[key] = []
            for k in range(len(buffers)):
                # Only the list's reference left (as counted the same way, see _FREE): no user of the old batch.
                if sys.getrefcount(buffers[k]) == _FREE:
                    return buffers[k]
            out = np.empty(shape, dtype)
            if len(buffers) < _BUFFERS_PER_KEY:
                buffers.append(out)
            return out

    def bytes(self, nbytes: int) -> np.ndarray:
        """``nbytes`` uninitialised bytes (uint8), for an array whose shape changes from batch to batch (a padded
        batch: its width is its longest value's): the front of an earlier buffer at least that large that no one
        references any more, else a new one (kept, up to ``_FLAT_BUFFERS``, or in place of a smaller free one).
        Refilling one costs a ``fill``; a fresh one, a page fault per page (the kernel zeroes it), which in a cold
        epoch of padded token ids cost more than the padding itself."""
        if not _RECYCLE:
            return np.empty(nbytes, np.uint8)
        with self._lock:
            flat = self._flat
            smaller = -1
            for k in range(len(flat)):
                if sys.getrefcount(flat[k]) == _FREE:  # (as in ``empty``: only the list refers to it)
                    if len(flat[k]) >= nbytes:
                        return flat[k][:nbytes]
                    smaller = k
            out = np.empty(nbytes, np.uint8)
            if len(flat) < _FLAT_BUFFERS:
                flat.append(out)
            elif smaller >= 0:
                flat[smaller] = out
            return out[:nbytes]



_executor: ThreadPoolExecutor | None = None
_executor_pid = -1
_executor_lock = threading.Lock()


# One pool per process, shared by every cache it reads (a batch's buffers are the same whichever cache fills them).
buffers = BufferPool()


def _forget_executor() -> None:
    """In a forked child: the parent's threads do not exist here, and its locks may have been held at fork time."""
    global _executor, _executor_pid, _executor_lock
    _executor, _executor_pid, _executor_lock = None, -1, threading.Lock()
    buffers._lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_executor)


def configured_threads() -> int:
    """Threads per large gather: ``$MMAPCACHE_GATHER_THREADS``, default 1 (no splitting).

    Opt-in because it did not pay on the machine we measure on (2 vCPUs): a single ``numpy.take`` of a shuffled
    batch is limited by per-row work, not by copy bandwidth, and a second thread on the sibling vCPU slowed
    ``ds.loader()`` by ~10% (``tools/bench.py``). On machines with many physical cores, try 2-4.
    """
    setting = os.environ.get("MMAPCACHE_GATHER_THREADS", "")
    if not setting:
        return 1
    try:
        threads = int(setting)
    except ValueError:
        raise ValueError(f"MMAPCACHE_GATHER_THREADS must be a positive integer, got {setting!r}") from None
    return max(1, min(_MAX_THREADS, threads))


def _pool() -> ThreadPoolExecutor:
    """This process's helper threads (a forked child has none of its parent's threads, so it makes its own)."""
    global _executor, _executor_pid
    with _executor_lock:
        if _executor is None or _executor_pid != os.getpid():  # pid: also covers a fork that skipped the hook
            _executor = ThreadPoolExecutor(max_workers=max(1, configured_threads() - 1),
                                           thread_name_prefix="mmapcache-gather")
            _executor_pid = os.getpid()
        return _executor


def in_dataloader_worker() -> bool:
    """Whether this process is a DataLoader worker (whose siblings already keep the other cores busy)."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


def take(data: np.ndarray, rows: np.ndarray, out: np.ndarray, threads: int | None = None) -> None:
    """``numpy.take(data, rows, axis=0, out=out, mode="clip")``, split over threads when it is large.

    The rows are cut into a few chunks per thread which the calling thread and the helpers take in turn, so a
    helper that the OS does not schedule soon (a busy machine) costs nothing: the caller copies its chunks too.

    Args:
        data: the source rows (a memory map).
        rows: row numbers, any order.
        out: the destination, ``(len(rows), *data.shape[1:])``.
        threads: at most this many threads (default: ``$MMAPCACHE_GATHER_THREADS`` or 1; 1 in DataLoader workers).
    """
    n = len(rows)
    if threads is None:
        threads = 1 if in_dataloader_worker() else configured_threads()
    threads = min(threads, out.nbytes // _MIN_BYTES_PER_THREAD, n)
    if threads <= 1:
        np.take(data, rows, axis=0, out=out, mode="clip")
        return
    job = _Chunks(data, rows, out, min(n, threads * _CHUNKS_PER_THREAD))
    pool = _pool()
    for _ in range(threads - 1):
        pool.submit(job.run)
    job.run()
    job.finished.wait()
    if job.error is not None:
        raise job.error


_CHUNKS_PER_THREAD = 4


class _Chunks:
    """One split gather: chunks handed out by an atomic counter, completion signalled by an event."""

    def __init__(self, data: np.ndarray, rows: np.ndarray, out: np.ndarray, chunks: int) -> None:
        self.data, self.rows, self.out, self.chunks = data, rows, out, chunks
        self.bounds = [len(rows) * k // chunks for k in range(chunks + 1)]
        self.next = itertools.count()  # next() on a count is atomic under the GIL
        self.lock = threading.Lock()
        self.done = 0
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        while True:
            k = next(self.next)
            if k >= self.chunks:
                return
            a, b = self.bounds[k], self.bounds[k + 1]
            try:
                np.take(self.data, self.rows[a:b], axis=0, out=self.out[a:b], mode="clip")
            except BaseException as exc:
                self.error = exc
            with self.lock:
                self.done += 1
                if self.done == self.chunks:
                    self.finished.set()


def alloc_shared(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A numpy array over a shared-memory tensor (the open batch arena's, ``read.arena``): a worker's batch then
    crosses to the main process without the copy that sending an ordinary tensor costs (torch's default collate
    makes its batches in shared memory too)."""
    from . import arena

    if not math.prod(shape):
        return np.empty(shape, dtype)
    target = _torch_dtypes.get(dtype)
    if target is None:
        import torch

        target = _torch_dtypes[dtype] = torch.from_numpy(np.empty(0, dtype)).dtype
    return arena.tensor(shape, target).numpy()


_torch_dtypes: dict[np.dtype, Any] = {}


def reserve_rows(fields: Any, n: int) -> None:
    """In a worker's batch (``read.arena``): one storage for the columns of ``n`` rows of the fixed fields."""
    from . import arena

    if arena.active():
        fixed = [f for f in fields if not f.ragged]
        arena.reserve(n * sum(math.prod(f.shape) * f.np_dtype.itemsize for f in fixed), len(fixed))


def column_alloc(fields: Any, n: int) -> Any:
    """What allocates a batch's fixed columns of ``n`` rows: ``np.empty``; in a DataLoader worker ``alloc_shared``,
    the columns reserved as one storage (``reserve_rows``)."""
    if not in_dataloader_worker():
        return np.empty
    reserve_rows(fields, n)
    return alloc_shared
