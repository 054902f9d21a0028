"""Creating (atomically), opening and mapping a cache directory; space reservation; users and removal.

Creation builds the whole directory under a temporary name, reserves every byte with ``posix_fallocate`` (a
sparse file on a full tmpfs kills its writer with SIGBUS, which Python cannot catch), then renames it into
place. Creators of caches in one parent directory serialise on ``flock`` of that directory, so racing creators
never reserve the space twice and all end up on one cache.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import shutil
import stat
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import _format as fmt
from ._filled import SlotState, bitmap_bytes
from ._layout import Field, Layout
from ._sizes import format_size
from .errors import CacheFormatError, CacheNotFoundError, CacheReadOnlyError, InsufficientSpaceError, MmapCacheError

DEFAULT_DIR = "/dev/shm/mmapcache"
_TMP_MARK = ".tmp-"
_DELETING_MARK = ".deleting-"
# Created files and directories get these modes minus the umask: never writable by others, whatever the umask,
# because every process able to write a cache can make its readers serve wrong samples. Share a cache through a
# group instead (umask 002 and a setgid parent directory).
FILE_MODE = 0o664
_DIR_MODE = 0o775


def cache_root() -> str:
    """The directory that bare cache names resolve in: ``$MMAPCACHE_DIR``, default ``/dev/shm/mmapcache``."""
    return os.environ.get("MMAPCACHE_DIR") or DEFAULT_DIR


def resolve_path(path: str | os.PathLike[str]) -> str:
    """A path containing ``/`` is used as given; a bare name resolves under ``cache_root()``."""
    try:
        text = os.fspath(path)
    except TypeError:
        text = None
    if not isinstance(text, str) or not text:
        raise TypeError(f"cache path must be a non-empty str or os.PathLike, got {path!r}")
    if "/" not in text:
        if text in (".", ".."):
            raise ValueError(f"cache name {text!r} is not a name; pass a directory path or a plain name like 'imagenet-224'")
        text = os.path.join(cache_root(), text)
    return os.path.abspath(text)


def is_cache(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, fmt.META))


# --- opening ---------------------------------------------------------------------------------------------------


class Store:
    """One process's mapping of a cache directory.

    Attributes:
        path: the cache directory.
        meta: the parsed ``meta.json``.
        layout: the sample layout.
        data: per field, a numpy view ``(rows, *shape)`` of its ``.npy`` file.
        shapes: per field, the ``(rows, ndim)`` int64 view of its shape file, or None for fixed fields.
        state: the slot state (bitmaps, counters, lock).
        writable: whether this process may write.

    Mappings survive ``fork`` (they are MAP_SHARED); the lock reopens itself in the child.
    """

    def __init__(self, path: str, *, writable: bool | None = None) -> None:
        self.path = path
        try:
            st = os.stat(path)  # one stat: a cache removed between two checks must read as missing, not as a file
        except FileNotFoundError:
            raise CacheNotFoundError(
                f"no cache at {path}; create it by passing a source dataset (MmapCachedDataset(path, dataset)) or "
                "with `mmapcache build PATH --dataset SPEC`"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise CacheFormatError(f"{path} is a file, not a cache directory; pass a directory path or a bare name")
        # Which directory we map: attach() checks it is still the one at `path` (a delete_on_close cache can be
        # removed, and another created in its place, while this process opens it).
        self._dir_id = (st.st_dev, st.st_ino)
        try:
            self.meta = fmt.read_meta(path)
        except CacheFormatError:
            if self.moved():
                raise CacheNotFoundError(_removed_message(path)) from None
            raise
        if writable is None:
            writable = os.access(path, os.W_OK) and all(
                os.access(os.path.join(path, f["file"]), os.W_OK) for f in self.meta["fields"]
            ) and os.access(os.path.join(path, fmt.FILLED), os.W_OK)
        self.writable = writable
        self.layout = Layout.from_json(self.meta)
        self.length: int = self.meta["length"]
        self.slots: int = self.meta["slots"]
        self.variants: int = self.meta["variants"]
        self.rows: int = self.meta["rows"]
        self._maps: list[mmap.mmap] = []
        self._fds: list[int] = []
        self.data: list[np.ndarray] = []
        self.data_offsets: list[int] = []  # byte offset of row 0 in each field's file
        self.data_fds: list[int] = []  # per field, a descriptor for pwrite (writable stores), else -1
        self.shapes: list[np.ndarray | None] = []
        self._finalizer = weakref.finalize(self, _release, self._maps, self._fds)
        try:
            for field, spec in zip(self.layout.fields, self.meta["fields"]):
                self.data.append(self._map_npy(spec["file"], field.np_dtype, (self.rows, *field.shape), keep_fd=True))
                shape_file = spec["shape_file"]
                self.shapes.append(
                    self._map_npy(shape_file, np.dtype("<i8"), (self.rows, len(field.shape))) if shape_file else None
                )
            self.slot_index = self._read_slot_index()
            self.state = SlotState(path, self.rows, writable)
            self.state.check_consistency(path)
        except CacheFormatError:
            if self.moved():  # files vanished because the cache was removed meanwhile, not damaged
                self._finalizer()
                raise CacheNotFoundError(_removed_message(path)) from None
            raise
        except OSError as exc:
            if exc.errno in (errno.ENODEV, errno.EINVAL, errno.EOPNOTSUPP):
                raise MmapCacheError(
                    f"{path}: the file system does not support shared memory maps ({exc.strerror}); put the cache on "
                    f"tmpfs (/dev/shm) or a local disk: set MMAPCACHE_DIR or pass such a path"
                ) from None
            raise
        self._users_fd = -1
        self._users_pid = -1

    def _map_npy(self, name: str, dtype: np.dtype, shape: tuple[int, ...], keep_fd: bool = False) -> np.ndarray:
        path = os.path.join(self.path, name)
        writable = self.writable
        fix = f"the cache is damaged: remove it (`mmapcache rm --force {self.path}`) and build it again"
        try:
            fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CacheFormatError(f"{path} is missing; {fix}") from None
        except IsADirectoryError:
            raise CacheFormatError(f"{path} is a directory, expected a .npy file; {fix}") from None
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                try:
                    version = np.lib.format.read_magic(f)
                    read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                                   (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                    if read_header is None:
                        raise ValueError(f"unsupported .npy version {version}")
                    header = read_header(f)
                except (ValueError, SyntaxError) as exc:
                    raise CacheFormatError(f"{path} is not a valid .npy file ({exc}); {fix}") from None
                offset = f.tell()
            found_shape, fortran, found_dtype = header
            if tuple(found_shape) != shape or fortran or np.dtype(found_dtype) != dtype:
                raise CacheFormatError(
                    f"{path}: found array {found_dtype} {tuple(found_shape)}, expected {dtype.str} {shape} as "
                    f"{fmt.META} says; {fix}"
                )
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            size = os.fstat(fd).st_size
            if size < offset + nbytes:
                raise CacheFormatError(f"{path} has {size} bytes, expected {offset + nbytes}: it is truncated; {fix}")
            m = mmap.mmap(fd, offset + nbytes, mmap.MAP_SHARED,
                          access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        except BaseException:
            os.close(fd)
            raise
        if keep_fd:
            # Rows are written with pwrite: a first write through the map costs a page fault per page (~2x).
            self.data_fds.append(fd if writable else -1)
            self.data_offsets.append(offset)
            if writable:
                self._fds.append(fd)
            else:
                os.close(fd)
        else:
            os.close(fd)
        self._maps.append(m)
        return np.frombuffer(m, dtype, count=int(np.prod(shape, dtype=np.int64)), offset=offset).reshape(shape)

    def _read_slot_index(self) -> np.ndarray | None:
        if self.meta["slot_index"] is None:
            return None
        index = self._map_npy(self.meta["slot_index"], np.dtype("<i8"), (self.slots,))
        if len(index) and (index.min() < 0 or index.max() >= self.length):
            raise CacheFormatError(f"{self.path}/{fmt.SLOT_INDEX}: indices outside [0, {self.length}); the cache is "
                                   "damaged: remove it and build it again")
        return index

    def slot_lookup(self) -> np.ndarray | None:
        """An int64 array mapping each source index to its slot or -1, or None when slots are a prefix."""
        if self.slot_index is None:
            return None
        lookup = np.full(self.length, -1, dtype=np.int64)
        lookup[self.slot_index] = np.arange(self.slots, dtype=np.int64)
        return lookup

    # --- users (reference count through the kernel's locks) ----------------------------------------------------

    def moved(self) -> bool:
        """Whether the directory at ``path`` is no longer the one this store mapped (removed or replaced)."""
        try:
            return _dir_id(self.path) != self._dir_id
        except OSError:
            return True

    def attach(self) -> None:
        """Registers this process as a user: a shared ``flock`` on ``users`` held until ``detach`` or death.

        Safe across processes. A remover holds ``users`` exclusively until it has renamed the cache away, so once
        the shared lock is granted the cache is either still in place (and nobody can remove it until we detach)
        or gone, which this checks.

        Raises:
            CacheNotFoundError: the cache was removed (its last ``delete_on_close`` user closed it, a sweep, or
                ``mmapcache rm``) while this process was opening it.
        """
        if self._users_pid == os.getpid():
            return
        users = os.path.join(self.path, fmt.USERS)
        try:
            fd = os.open(users, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if self.moved():
                raise CacheNotFoundError(_removed_message(self.path)) from None
            raise CacheFormatError(f"{users} is missing; the cache is damaged: remove it (`mmapcache rm --force "
                                   f"{self.path}`) and build it again") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            held = os.fstat(fd)
            try:
                current = os.stat(users)
            except FileNotFoundError:
                current = None
            if self.moved() or current is None or (current.st_dev, current.st_ino) != (held.st_dev, held.st_ino):
                raise CacheNotFoundError(_removed_message(self.path))
        except BaseException:
            os.close(fd)
            raise
        self._users_fd, self._users_pid = fd, os.getpid()

    def detach(self, *, remove_if_last: bool = False) -> bool:
        """Unregisters this process. With ``remove_if_last`` (the caller holds ``parent_lock(path)``), the last
        user also removes the cache, while it holds ``users`` exclusively, so no process can attach in between
        (see ``attach``). Returns whether it removed the cache. Safe across processes.

        A process that inherited the store over ``fork`` is not a user of its own and never removes anything;
        forked children (DataLoader workers) live under their parent's registration and leave with it.
        """
        if self._users_pid != os.getpid():
            return False  # inherited over fork: the descriptor's lock belongs to the parent
        fd, self._users_fd, self._users_pid = self._users_fd, -1, -1
        try:
            # Unlock rather than convert to an exclusive lock: forked children share this open file description,
            # so a converted lock would outlive us in them and block every later attach until they exit.
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        if not remove_if_last or self.moved():
            return False
        try:
            probe = os.open(os.path.join(self.path, fmt.USERS), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # another user holds it
            if self.moved() or not is_cache(self.path):
                return False
            remove(self.path)
            return True
        finally:
            os.close(probe)

    def close(self) -> None:
        """Unmaps the cache in this process. Idempotent."""
        if not self._finalizer.alive:
            return
        self.state.close()
        self.data.clear()
        self.shapes.clear()
        self._finalizer()


def _dir_id(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _removed_message(path: str) -> str:
    return (
        f"the cache at {path} was removed while this process was opening it (its last delete_on_close user closed "
        "it, or `mmapcache rm`/`gc` removed it); open it again with a source dataset to re-create it, or rebuild it "
        "with `mmapcache build`"
    )


def _release(maps: list[mmap.mmap], fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
    for m in maps:
        with contextlib.suppress(BufferError, ValueError):
            m.close()
    maps.clear()


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


# --- creating --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def parent_lock(path: str) -> Iterator[None]:
    """Serialises creation and removal of caches in one parent directory (``flock`` on the directory)."""
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, mode=_DIR_MODE, exist_ok=True)
    except FileExistsError:
        raise MmapCacheError(f"{parent} is a file; the parent of a cache must be a directory") from None
    except OSError as exc:
        raise _cannot_create(parent, exc) from None
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def plan_bytes(layout: Layout, rows: int, slots: int) -> int:
    """Bytes a cache of this layout and size occupies (data, shapes, state and slot index; headers ignored)."""
    shape_bytes = sum(8 * len(f.shape) for f in layout.fields if f.variable)
    slot_index = 8 * slots
    return rows * (layout.row_bytes + shape_bytes + 4) + 2 * bitmap_bytes(rows) + slot_index


def free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def create(
    path: str,
    layout: Layout,
    *,
    length: int,
    slots: int,
    variants: int,
    slot_index: Sequence[int] | None,
    fingerprint: str | None,
    delete_on_close: bool,
    library_version: str,
    prepare: Callable[[str], None] | None = None,
) -> None:
    """Creates a cache at ``path`` atomically. The caller holds ``parent_lock(path)`` and checked it is absent.

    ``prepare(tmp)``, if given, runs on the complete cache under its temporary name just before the rename (the
    creator stores its first sample there, so no opener ever sees that sample missing and computes it again).

    Raises:
        InsufficientSpaceError: not enough room; nothing is left behind.
    """
    parent = os.path.dirname(path)
    rows = slots * variants
    needed = plan_bytes(layout, rows, slots if slot_index is not None else 0)
    # Every file takes whole blocks (tmpfs: pages) plus its .npy header: a layout of many small fields otherwise
    # passes the check, then fails on ENOSPC with a message claiming it needs less than is free.
    needed += (2 * len(layout.fields) + 7) * ((os.statvfs(parent).f_frsize or 4096) + 128)
    free = free_bytes(parent)
    # A file system reporting no size at all (tmpfs mounted with size=0 is unlimited; /proc and sysfs hold no
    # files) gets no up-front check: the reservation below still fails cleanly if the room is not there.
    if needed > free and os.statvfs(parent).f_blocks:
        raise InsufficientSpaceError(_space_message(path, needed, free, layout, variants, length))
    tmp = f"{parent}/.{os.path.basename(path)}{_TMP_MARK}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.mkdir(tmp, _DIR_MODE)
    except OSError as exc:
        raise _cannot_create(parent, exc) from None
    try:
        meta = fmt.make_meta(
            layout, length=length, slots=slots, variants=variants, has_slot_index=slot_index is not None,
            fingerprint=fingerprint, delete_on_close=delete_on_close, library_version=library_version,
        )
        for field, spec in zip(layout.fields, meta["fields"]):
            _write_npy(tmp, spec["file"], field.np_dtype, (rows, *field.shape))
            if spec["shape_file"]:
                _write_npy(tmp, spec["shape_file"], np.dtype("<i8"), (rows, len(field.shape)))
        if slot_index is not None:
            fd = _write_npy(tmp, fmt.SLOT_INDEX, np.dtype("<i8"), (slots,), keep_open=True)
            with os.fdopen(fd, "r+b") as f:
                f.seek(-8 * slots, os.SEEK_END)
                f.write(np.asarray(slot_index, dtype="<i8").tobytes())
        for name, size in ((fmt.FILLED, bitmap_bytes(rows)), (fmt.STALE, bitmap_bytes(rows)), (fmt.SEQ, 4 * rows),
                           (fmt.LOCK, 0), (fmt.USERS, 0)):
            _reserve(os.path.join(tmp, name), size)
        fmt.write_meta(tmp, meta)  # last: a directory with meta.json is a complete cache
        if prepare is not None:
            prepare(tmp)
        os.rename(tmp, path)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InsufficientSpaceError(_space_message(path, needed, free_bytes(parent), layout, variants, length)) from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _cannot_create(parent: str, exc: OSError) -> MmapCacheError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientSpaceError(
            f"cannot create a cache in {parent} ({exc.strerror}): the file system is full or out of inodes; free "
            "space (`mmapcache ls`, `mmapcache rm`) or put the cache elsewhere with MMAPCACHE_DIR"
        )
    if exc.errno in (errno.EACCES, errno.EROFS):
        return CacheReadOnlyError(
            f"cannot create a cache in {parent} ({exc.strerror}): no write permission or a read-only mount; pass a "
            "path in a directory you may write, or set MMAPCACHE_DIR (e.g. to a directory of your own in /dev/shm)"
        )
    return MmapCacheError(
        f"cannot create a cache in {parent} ({exc.strerror}): this file system cannot hold one; put the cache on "
        "tmpfs (/dev/shm, the default) or a local disk: pass such a path or set MMAPCACHE_DIR"
    )


def _write_npy(directory: str, name: str, dtype: np.dtype, shape: tuple[int, ...], keep_open: bool = False) -> int:
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    path = os.path.join(directory, name)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE), "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        offset = f.tell()
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return _reserve(path, offset + nbytes, keep_open=keep_open)


def _reserve(path: str, size: int, keep_open: bool = False) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)  # no fallocate (some network file systems): best effort
    except BaseException:
        os.close(fd)
        raise
    if keep_open:
        return fd
    os.close(fd)
    return -1


def _space_message(path: str, needed: int, free: int, layout: Layout, variants: int, length: int) -> str:
    per_sample = max(1, layout.row_bytes * variants)
    fit = max(0, int(free * 0.95) // per_sample)
    return (
        f"not enough space for the cache at {path}: it needs {needed} bytes ({format_size(needed)}), "
        f"{os.path.dirname(path)} has {free} bytes ({format_size(free)}) free. Fixes: cache part of the dataset with "
        f"max_bytes={int(free * 0.95)} (about {fit} of {length} samples fit; `mmapcache build --max-bytes`), "
        "put it on a larger file system with MMAPCACHE_DIR, free space (`mmapcache ls`, `mmapcache rm`), or, in "
        "Docker, give the container more shared memory (`docker run --shm-size=16g`)"
    )


# --- removing --------------------------------------------------------------------------------------------------


def remove(path: str) -> None:
    """Removes a cache directory: renamed away first (so it vanishes atomically), then deleted.

    Processes that still map its files keep their pages until they unmap them (tmpfs frees them then).
    """
    if not is_cache(path):
        raise CacheFormatError(f"{path} is not an mmapcache cache (no {fmt.META}); refusing to remove it")
    doomed = f"{os.path.dirname(path)}/.{os.path.basename(path)}{_DELETING_MARK}{os.getpid()}"
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
        for mark in (_TMP_MARK, _DELETING_MARK):
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


def field_by_name(layout: Layout, name: str) -> Field:
    for field in layout.fields:
        if field.name == name:
            return field
    raise KeyError(name)


def describe_meta(meta: dict[str, Any]) -> str:
    layout = Layout.from_json(meta)
    return ", ".join(f"{f.name}: {f.describe()}" for f in layout.fields)
