"""The cache's locks: the writer lock (the kernel's blocking ``flock`` on ``<cache>/lock``, with a thread lock for the
threads of one process) and the byte-range claims on the same file (a build's chunks, a stream producer's rows).
Only ``store.state`` takes the writer lock; the claims are taken by build workers and producers.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import weakref

from ..errors import CacheFormatError
from ..format.spec import LOCK
from .files import open_file

__all__ = ["ChunkClaims", "WriterLock"]


class WriterLock:
    """The cache's writer lock: a thread lock plus the kernel's blocking ``flock`` on ``<cache>/lock``.

    Blocking ``flock`` hands the lock over as soon as it is released (filelock's ``FileLock`` polls with
    ``LOCK_NB`` every 50 ms by default, which serialises contended writers badly: see ``tools/bench.py``).
    ``flock`` belongs to an open file description, which all threads of a process share, so the thread lock is
    what serialises the threads of one process; it is taken first, and the descriptor is opened under it (threads
    missing at once on a freshly opened cache must not each open, and then unlock, another's descriptor).
    A forked child gets a fresh thread lock and its own descriptor (``os.register_at_fork``): a lock held by a
    parent's thread at fork time would stay held forever, and sharing the parent's open file description would
    make the two processes hold "one" lock together. Safe across processes and threads.
    """

    def __init__(self, directory: str) -> None:
        self._directory = directory
        self._pid = -1
        self._fd = -1
        self._thread_lock = threading.Lock()
        _LOCKS.add(self)

    def _after_fork_in_child(self) -> None:
        self._thread_lock = threading.Lock()
        self._fd, self._pid = -1, -1  # the inherited descriptor stays open: it is the parent's description

    def _open_locked(self) -> None:
        """Opens this process's descriptor. Caller holds the thread lock."""
        try:
            self._fd = open_file(self._directory, LOCK, os.O_RDONLY)
        except FileNotFoundError:
            raise CacheFormatError(_lock_missing(os.path.join(self._directory, LOCK))) from None
        self._pid = os.getpid()

    def __enter__(self) -> WriterLock:
        self._thread_lock.acquire()
        try:
            if self._pid != os.getpid():
                self._open_locked()
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            if os.fstat(self._fd).st_nlink == 0:
                # Someone removed or replaced the lock file: processes locking a new file would not exclude us.
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                raise CacheFormatError(_lock_missing(os.path.join(self._directory, LOCK)))
        except BaseException:
            self._thread_lock.release()
            raise
        return self

    def __exit__(self, kind: object, exc: object, traceback: object) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def close(self) -> None:
        with self._thread_lock:
            if self._pid == os.getpid() and self._fd >= 0:
                os.close(self._fd)  # only our own descriptor: an inherited one belongs to the parent
            self._fd, self._pid = -1, -1


_LOCKS: weakref.WeakSet[WriterLock] = weakref.WeakSet()


def _reset_locks_in_child() -> None:
    for lock in list(_LOCKS):
        lock._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_locks_in_child)


def _lock_missing(path: str) -> str:
    return (
        f"{path} was removed or replaced while the cache is in use, so writers no longer exclude each other; "
        "stop the processes using this cache, then remove it (`mmapcache rm --force`) and build it again"
    )


class ChunkClaims:
    """Build workers' claims on chunks of rows: POSIX byte-range locks on byte ``c`` of ``<cache>/lock``.

    A claim is held by this process until released or until it dies (the kernel drops it), so concurrent builds
    skip each other's chunks instead of computing the same samples. POSIX locks belong to the process: closing
    *any* descriptor of the lock file drops them all, so this class keeps its own descriptor open until ``close``.
    """

    def __init__(self, directory: str) -> None:
        self._directory = directory
        self._fd = -1

    def try_claim(self, chunk: int, count: int = 1) -> bool:
        """Claims bytes ``chunk`` to ``chunk + count - 1`` at once (all or none); False if any is held elsewhere."""
        if self._fd < 0:
            self._fd = open_file(self._directory, LOCK, os.O_RDWR)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, count, chunk)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False
            raise
        return True

    def release(self, chunk: int, count: int = 1) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, count, chunk)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
