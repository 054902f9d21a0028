"""Administering caches from outside: who uses a cache, removing one, and sweeping what dead processes left.

Numpy-free and torch-free: ``mmapcache ls``, ``rm`` and ``gc`` start fast.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

from ..errors import CacheFormatError, CacheInUseError, CacheNotFoundError
from ..format import spec as fmt
from .create import directory_lock, is_scratch, move_to_scratch, parent_lock, remove_scratch
from .files import is_cache, open_file, read_meta
from .paths import cache_root, resolve_path


def users_of(path: str) -> list[int]:
    """Pids holding a lock on the cache's ``users`` file, read from ``/proc/locks`` (Linux)."""
    return holders_of(path, fmt.USERS)


def holders_of(path: str, name: str, posix_at: int | None = None) -> list[int]:
    """Pids holding an ``flock`` on the cache file ``name`` (``users``, ``producers``), or with ``posix_at`` a
    byte-range lock on that byte of it (a stream's reader of a rank: an open file description lock, or a POSIX one
    where the kernel lacks those), from ``/proc/locks`` (Linux). An open file description lock shows no pid there:
    its holders are found among the processes' open descriptors of the file (``/proc/PID/fdinfo``)."""
    try:
        st = os.stat(os.path.join(path, name))
        with open("/proc/locks", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    pids, unnamed = set(), False
    for kind, pid, start, end in _locks_on(lines, st):
        if posix_at is None:
            if kind == "FLOCK":
                pids.add(pid)
        elif kind in ("POSIX", "OFDLCK") and start <= posix_at <= end:
            if pid > 0:
                pids.add(pid)
            else:
                unnamed = True
    if unnamed:
        pids |= _description_holders(st, posix_at)  # type: ignore[arg-type]  # (posix_at is set here)
    return sorted(p for p in pids if _alive(p))


def _locks_on(lines: list[str], st: os.stat_result) -> list[tuple[str, int, int, int]]:
    """``(kind, pid, first byte, last byte)`` of the lock lines (``/proc/locks``' format) on the file of ``st``."""
    found = []
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter, shown as "1: -> FLOCK ..."
            parts.remove("->")
        if len(parts) < 8:
            continue
        dev_ino = parts[5].split(":")
        if len(dev_ino) != 3 or int(dev_ino[2]) != st.st_ino or int(dev_ino[1], 16) != os.minor(st.st_dev) \
                or int(dev_ino[0], 16) != os.major(st.st_dev):
            continue
        last = (1 << 63) - 1 if parts[7] == "EOF" else int(parts[7])
        found.append((parts[1], int(parts[4]), int(parts[6]), last))
    return found


def _description_holders(st: os.stat_result, at: int) -> set[int]:
    """Pids with a descriptor of the file of ``st`` whose open file description holds a lock on byte ``at``."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            descriptors = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in descriptors:
            try:
                target = os.stat(f"/proc/{entry}/fd/{fd}")
                if (target.st_dev, target.st_ino) != (st.st_dev, st.st_ino):
                    continue
                with open(f"/proc/{entry}/fdinfo/{fd}", encoding="ascii") as f:
                    locks = [line.split(":", 1)[1] for line in f.read().splitlines() if line.startswith("lock:")]
            except OSError:
                continue
            if any(kind == "OFDLCK" and start <= at <= end for kind, _, start, end in _locks_on(locks, st)):
                pids.add(int(entry))
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(*paths: str | os.PathLike[str], force: bool = False) -> list[str]:
    """Removes the caches at ``paths`` (bare names resolve under ``$MMAPCACHE_DIR``); returns their real paths.
    Every path is checked before any is removed. Safe across processes.

    Refuses, with an error naming the fix: a symbolic link (it would resolve to its target), anything that is not
    a cache, a damaged cache (unless ``force``), and a cache in use (``CacheInUseError`` naming the pids, unless
    ``force``; its users keep reading the pages they mapped). Each removal holds the parent directory's lock, so a
    process registering as a user meanwhile either keeps the cache or finds it gone.

    Raises:
        CacheNotFoundError: nothing at a path. CacheFormatError: not a cache, a link, or damaged without ``force``.
        CacheInUseError: processes use it and ``force`` is off.
    """
    if not isinstance(force, bool):
        raise TypeError(f"force must be True or False, got {type(force).__name__}")
    if not paths:
        raise TypeError("remove() takes the path of at least one cache")
    resolved = [_check_removable(_real(p), force) for p in paths]  # refuse everything before removing anything
    for path in resolved:
        with parent_lock(path):
            _check_removable(path, force)  # again under the lock: a user may have registered meanwhile
            delete(path)
    return resolved


def _real(given: str | os.PathLike[str]) -> str:
    """The cache a path names, refusing a link (whose resolved target is not what the user named)."""
    text = os.fspath(given)
    unresolved = os.path.abspath(text if "/" in text else os.path.join(cache_root(), text))
    if os.path.islink(unresolved):
        raise CacheFormatError(f"{unresolved} is a symbolic link, not a cache; refusing to remove it (remove the "
                               "link with rm, or name the cache it points to)")
    return resolve_path(text)


def _check_removable(path: str, force: bool) -> str:
    if not os.path.exists(path):
        raise CacheNotFoundError(f"no cache at {path}; `mmapcache ls` lists the caches")
    if not os.path.isdir(path) or fmt.META not in os.listdir(path):
        raise CacheFormatError(f"{path} is not an mmapcache cache (no {fmt.META}); refusing to remove it")
    try:
        read_meta(path)
    except CacheFormatError as exc:
        if not force or not {fmt.LOCK, fmt.USERS, fmt.FILLED} <= set(os.listdir(path)):
            raise CacheFormatError(f"{path} does not look like a valid cache ({exc}); refusing to remove it"
                                   + ("" if force else "; if it is a damaged cache, force it (`mmapcache rm "
                                      "--force`)")) from None
    users = users_of(path)
    if users and not force:
        mine = " (this process among them: close what it opened first, e.g. ds.close())" \
            if os.getpid() in users else ""
        raise CacheInUseError(f"{path} is in use by process(es) {', '.join(map(str, users))}{mine}; stop them, or "
                              "force the removal (`mmapcache rm --force`, remove(..., force=True)): they keep "
                              "reading the pages they mapped", users=tuple(users))
    return path


def gc(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """Removes what dead processes left in ``directory`` (default ``$MMAPCACHE_DIR``): scratch directories of
    interrupted creations and removals, and ``delete_on_close`` caches nobody uses any more. Nothing else is
    touched. Returns the paths removed. Safe across processes (it holds the directory's lock)."""
    directory = os.path.realpath(os.fspath(directory) if directory is not None else cache_root())
    if not os.path.isdir(directory):
        return []
    with directory_lock(directory):
        return sweep(directory)


def delete(path: str) -> None:
    """Removes a cache directory: renamed away first (so it vanishes atomically), then deleted.

    Processes that still map its files keep their pages until they unmap them (tmpfs frees them then).
    """
    if not is_cache(path):
        raise CacheFormatError(f"{path} is not an mmapcache cache (no {fmt.META}); refusing to remove it")
    remove_scratch(move_to_scratch(path))


def sweep(parent: str) -> list[str]:
    """Removes what dead processes left in ``parent``: scratch directories of interrupted creations and removals
    (only those proven ours: see ``store.create.SCRATCH``), and ``delete_on_close`` caches that no process uses any
    more. Nothing else is ever touched. Caller holds the parent lock."""
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        full = os.path.join(parent, name)
        pid = is_scratch(full)
        if pid is not None and not _alive(pid):
            remove_scratch(full)
            removed.append(full)
        elif not name.startswith(".") and not os.path.islink(full) and _remove_if_orphaned(full):
            removed.append(full)
    return removed


def _remove_if_orphaned(path: str) -> bool:
    """Removes a delete_on_close cache whose users file nobody holds (its last user died without cleaning up).

    The exclusive lock is held until the cache is renamed away, so a process attaching meanwhile either keeps it
    (the lock is refused) or finds it gone (``Store.attach``). Caller holds the parent lock.
    """
    try:
        meta = read_meta(path)
    except (CacheFormatError, OSError):
        return False
    if not meta.get("delete_on_close"):
        return False
    try:
        fd = open_file(path, fmt.USERS, os.O_RDONLY)
    except (OSError, CacheFormatError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        delete(path)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def close_store(store: Any, delete_on_close: bool, ring: Any = None) -> None:
    """Detaches this process from the cache and unmaps it; with ``delete_on_close`` the last user removes it.

    Runs from ``close()``, garbage collection, or interpreter exit (``weakref.finalize``); a process killed
    outright detaches through the kernel (its locks vanish) and a later ``sweep`` removes what it left.
    """
    if ring is not None:
        ring.close()
    store.close()
    if delete_on_close and os.path.isdir(os.path.dirname(store.path)):
        # The parent lock orders this removal with creators and sweeps in the same directory.
        with parent_lock(store.path):
            store.detach(remove_if_last=True)
    else:
        store.detach()
