"""Creating a cache atomically: space planning and reservation, the temporary directory, the rename.

Creation builds the whole directory under a temporary name, reserves every byte with ``posix_fallocate`` (a
sparse file on a full tmpfs kills its writer with SIGBUS, which Python cannot catch), then renames it into
place. Creators of caches in one parent directory serialise on ``flock`` of that directory, so racing creators
never reserve the space twice and all end up on one cache.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from typing import Callable, Iterator, Sequence

import numpy as np

from . import _format as fmt
from ._filled import bitmap_bytes
from ._layout import Layout
from ._sizes import format_size
from .errors import CacheReadOnlyError, InsufficientSpaceError, MmapCacheError, UnsupportedFileSystemError

TMP_MARK = ".tmp-"
# Created files and directories get these modes minus the umask: never writable by others, whatever the umask,
# because every process able to write a cache can make its readers serve wrong samples. Share a cache through a
# group instead (umask 002 and a setgid parent directory).
FILE_MODE = 0o664
_DIR_MODE = 0o775


@contextlib.contextmanager
def parent_lock(path: str) -> Iterator[None]:
    """Serialises creation and removal of caches in one parent directory (``flock`` on the directory)."""
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, mode=_DIR_MODE, exist_ok=True)
    except FileExistsError:
        raise UnsupportedFileSystemError(f"{parent} is a file; the parent of a cache must be a directory") from None
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
    slot_index: Sequence[int] | np.ndarray | None,
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
    tmp = f"{parent}/.{os.path.basename(path)}{TMP_MARK}{os.getpid()}"
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
    return UnsupportedFileSystemError(
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
