"""Administering caches from outside: who uses a cache, removing one, and sweeping what dead processes left.

Numpy-free and torch-free: ``mmapcache ls``, ``rm`` and ``gc`` start fast.
"""

from __future__ import annotations

import fcntl
import os
import shutil

from . import _format as fmt
from ._create import TMP_MARK
from .errors import CacheFormatError

DELETING_MARK = ".deleting-"


def users_of(path: str) -> list[int]:
    """Pids holding a lock on the cache's ``users`` file, read from ``/proc/locks`` (Linux)."""
    try:
        st = os.stat(os.path.join(path, fmt.USERS))
        with open("/proc/locks", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    pids = set()
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter, shown as "1: -> FLOCK ..."
            parts.remove("->")
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        dev_ino = parts[5].split(":")
        if len(dev_ino) == 3 and int(dev_ino[2]) == st.st_ino and int(dev_ino[1], 16) == os.minor(st.st_dev) \
                and int(dev_ino[0], 16) == os.major(st.st_dev):
            pids.add(int(parts[4]))
    return sorted(p for p in pids if _alive(p))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(path: str) -> None:
    """Removes a cache directory: renamed away first (so it vanishes atomically), then deleted.

    Processes that still map its files keep their pages until they unmap them (tmpfs frees them then).
    """
    if not fmt.is_cache(path):
        raise CacheFormatError(f"{path} is not an mmapcache cache (no {fmt.META}); refusing to remove it")
    doomed = f"{os.path.dirname(path)}/.{os.path.basename(path)}{DELETING_MARK}{os.getpid()}"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def sweep(parent: str) -> list[str]:
    """Removes what dead processes left in ``parent``: temporary directories of interrupted creations and
    removals, and ``delete_on_close`` caches that no process uses any more. Caller holds the parent lock."""
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        full = os.path.join(parent, name)
        for mark in (TMP_MARK, DELETING_MARK):
            if name.startswith(".") and mark in name:
                pid = name.rsplit(mark, 1)[1]
                if pid.isdigit() and not _alive(int(pid)):
                    shutil.rmtree(full, ignore_errors=True)
                    removed.append(full)
        if not name.startswith(".") and _remove_if_orphaned(full):
            removed.append(full)
    return removed


def _remove_if_orphaned(path: str) -> bool:
    """Removes a delete_on_close cache whose users file nobody holds (its last user died without cleaning up).

    The exclusive lock is held until the cache is renamed away, so a process attaching meanwhile either keeps it
    (the lock is refused) or finds it gone (``Store.attach``). Caller holds the parent lock.
    """
    try:
        meta = fmt.read_meta(path)
    except (CacheFormatError, OSError):
        return False
    if not meta.get("delete_on_close"):
        return False
    try:
        fd = os.open(os.path.join(path, fmt.USERS), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        remove(path)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
