"""The cache's locks: the writer lock (the kernel's blocking ``flock`` on ``<cache>/lock``, with a thread lock for the
threads of one process) and the byte-range claims on the same file (a build's chunks, a stream producer's rows, a
stream reader's rank and waits). Only ``store.state`` takes the writer lock; the claims are taken by build workers,
producers and stream readers. Both check that ``lock`` is still the file of the cache this process mapped.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import threading
import weakref

from ..errors import CacheFormatError
from ..format.spec import LOCK
from .files import open_file

__all__ = ["ChunkClaims", "WriterLock", "lock_identity", "open_lock"]


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

    The descriptor is opened by path on first use (and again in a forked child), so the lock file's identity is
    taken when the cache is mapped (``identity``) and every opening compares it: a cache removed and created anew
    at the same path has another lock file, and a process that mapped the old one (a forked DataLoader worker, a
    reader that had not written yet) must not take the new cache's lock and store into the old, deleted maps.
    """

    def __init__(self, directory: str) -> None:
        self._directory = directory
        self._pid = -1
        self._fd = -1
        self._thread_lock = threading.Lock()
        self.identity = lock_identity(directory)
        _LOCKS.add(self)

    def _after_fork_in_child(self) -> None:
        self._thread_lock = threading.Lock()
        self._fd, self._pid = -1, -1  # the inherited descriptor stays open: it is the parent's description

    def _open_locked(self) -> None:
        """Opens this process's descriptor. Caller holds the thread lock."""
        self._fd = open_lock(self._directory, self.identity, os.O_RDONLY)
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
_CLAIMS: weakref.WeakSet[ChunkClaims] = weakref.WeakSet()


def _reset_locks_in_child() -> None:
    for lock in list(_LOCKS):
        lock._after_fork_in_child()
    for claims in list(_CLAIMS):
        claims._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_locks_in_child)


def lock_identity(directory: str) -> tuple[int, int] | None:
    """``(device, inode)`` of the cache's lock file now, or None if it is missing (an opening then fails)."""
    try:
        st = os.stat(os.path.join(directory, LOCK))
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def open_lock(directory: str, identity: tuple[int, int] | None, flags: int) -> int:
    """A new descriptor of the cache's lock file, which must be the one of ``identity`` (see ``WriterLock``).

    Raises:
        CacheFormatError: the lock file is missing, or another file than the one the cache was mapped with.
    """
    path = os.path.join(directory, LOCK)
    try:
        fd = open_file(directory, LOCK, flags)
    except FileNotFoundError:
        raise CacheFormatError(_lock_missing(path)) from None
    st = os.fstat(fd)
    if identity is not None and (st.st_dev, st.st_ino) != identity:
        os.close(fd)
        raise CacheFormatError(_lock_missing(path))
    return fd


def _lock_missing(path: str) -> str:
    return (
        f"{path} was removed or replaced while the cache is in use, so writers no longer exclude each other; "
        "stop the processes using this cache, then remove it (`mmapcache rm --force`) and build it again"
    )


# struct flock (fcntl(2)) on Linux's 64-bit ABIs: l_type, l_whence, l_start, l_len, l_pid, padded to 32 bytes.
_FLOCK = struct.Struct("hhqqi4x")
_OFD = hasattr(fcntl, "F_OFD_SETLK")  # open file description locks: Linux 3.15 and later


class ChunkClaims:
    """Byte-range claims on ``<cache>/lock``: a build worker's chunk ``c`` (byte ``c``), a stream producer's rows, a
    stream reader's rank and the row it waits for (``store.ring``). Each is an exclusive lock on its bytes, held
    until released, until this object closes its descriptor, or until the process dies (the kernel drops it), so
    concurrent builds skip each other's chunks instead of computing the same samples.

    They are open file description locks (Linux ``F_OFD_SETLK``), which belong to this object's descriptor. A
    POSIX record lock (``lockf``) belongs to the process instead, and the kernel drops every one the process holds
    on a file when *any* descriptor of that file is closed: a ``verify`` or a second dataset of the same path,
    opened and closed in a stream reader's process, dropped its rank's lock, and a second reader of the rank was
    admitted. Locks of two descriptors conflict, even within one process. A forked child closes its copy of the
    descriptor (``os.register_at_fork``: the claims stay the parent's, and the child's own calls open its own
    descriptor). Where the kernel lacks them, POSIX locks are used, with the old pitfall.

    Args:
        directory: the cache directory.
        identity: its lock file's ``(device, inode)`` when the cache was mapped (``WriterLock.identity``): a lock
            file replaced since (the cache removed and created anew) is refused with ``CacheFormatError``.
    """

    def __init__(self, directory: str, identity: tuple[int, int] | None = None) -> None:
        self._directory = directory
        self._identity = identity
        self._fd = -1
        _CLAIMS.add(self)

    def _after_fork_in_child(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # this process's reference to the parent's description: its claims stay held
        self._fd = -1

    def try_claim(self, chunk: int, count: int = 1) -> bool:
        """Claims bytes ``chunk`` to ``chunk + count - 1`` at once (all or none); False if any is held elsewhere.

        Raises:
            CacheFormatError: the cache's lock file is missing or was replaced (see ``identity``).
        """
        if self._fd < 0:
            self._fd = open_lock(self._directory, self._identity, os.O_RDWR)
        try:
            if _OFD:
                fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, chunk, count, 0))
            else:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, count, chunk)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False
            raise
        return True

    def release(self, chunk: int, count: int = 1) -> None:
        if self._fd < 0:
            return  # never claimed in this process (a forked child's copy of the parent's claims)
        if _OFD:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, chunk, count, 0))
        else:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, count, chunk)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
