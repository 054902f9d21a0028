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
import math
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import CacheReadOnlyError, InsufficientSpaceError, MmapCacheError, UnsupportedFileSystemError
from ..format import spec as fmt
from ..format.layout import Layout
from ..format.meta import make_meta
from ..format.sizes import format_size
from .files import write_meta
from .heap import BLOCK as HEAP_BLOCK
from .state import bitmap_bytes

# Scratch directories: where a cache is built before its rename into place, and where one is moved to be
# deleted. Their names match SCRATCH (no other tool's pattern), and the first thing written into one is the
# marker file: only a directory carrying both, made by a process that is gone, is ever removed by a sweep. The
# cache itself lives in a subdirectory, so the marker never ends up inside a cache.
SCRATCH = re.compile(r"\.mmapcache-(new|old)-([0-9]+)-[0-9a-f]{8}")
SCRATCH_MARKER = "MMAPCACHE-SCRATCH"
_SCRATCH_CACHE = "cache"
# Created files and directories get these modes minus the umask: never writable by others, whatever the umask,
# because every process able to write a cache can make its readers serve wrong samples. Share a cache through a
# group instead (umask 002 and a setgid parent directory).
FILE_MODE = 0o664
_DIR_MODE = 0o775


@contextlib.contextmanager
def parent_lock(path: str) -> Iterator[None]:
    """Serialises creation and removal of caches in one parent directory (``flock`` on the directory)."""
    with directory_lock(os.path.dirname(path)):
        yield


@contextlib.contextmanager
def directory_lock(parent: str) -> Iterator[None]:
    """``flock`` on the directory ``parent`` (made if missing): the lock of creating, removing and sweeping the
    caches in it."""
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


def plan_bytes(layout: Layout, rows: int, slots: int, ragged_bytes: int = 0) -> int:
    """Bytes a cache of this layout and size occupies (data, shapes, heap indices, keys, state and slot index;
    headers ignored), with ``ragged_bytes`` per row expected in the heaps."""
    shape_bytes = sum(8 * len(f.shape) for f in layout.fields if f.variable)
    index_bytes = sum(8 * (2 + len(f.shape)) for f in layout.fields if f.ragged)
    slot_index = 8 * slots
    per_row = layout.row_bytes + shape_bytes + index_bytes + ragged_bytes + 4 + 8
    return rows * per_row + 2 * bitmap_bytes(rows) + slot_index


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
    heap_budget: int | None = None,
    ragged_bytes: int = 0,
    share: dict[str, Any] | None = None,
    stream: dict[str, Any] | None = None,
    deterministic: bool = True,
) -> None:
    """Creates a cache at ``path`` atomically. The caller holds ``parent_lock(path)`` and checked it is absent.

    ``prepare(tmp)``, if given, runs on the complete cache under its temporary name just before the rename (the
    creator stores its first sample there, so no opener ever sees that sample missing and computes it again).
    Heaps start empty and grow as samples are stored (within ``heap_budget``); ``ragged_bytes`` (the expected heap
    bytes per row) only enters the up-front space check.

    Raises:
        InsufficientSpaceError: not enough room; nothing is left behind.
    """
    parent = os.path.dirname(path)
    rows = slots * variants
    needed = plan_bytes(layout, rows, slots if slot_index is not None else 0, ragged_bytes)
    # Every file takes whole blocks (tmpfs: pages) plus its .npy header: a layout of many small fields otherwise
    # passes the check, then fails on ENOSPC with a message claiming it needs less than is free.
    needed += (2 * len(layout.fields) + 7) * ((os.statvfs(parent).f_frsize or 4096) + 128)
    free = free_bytes(parent)
    # A file system reporting no size at all (tmpfs mounted with size=0 is unlimited; /proc and sysfs hold no
    # files) gets no up-front check: the reservation below still fails cleanly if the room is not there.
    if needed > free and os.statvfs(parent).f_blocks:
        raise InsufficientSpaceError(_space_message(path, needed, free, length))
    try:
        scratch = make_scratch(parent, "new")
    except OSError as exc:
        raise _cannot_create(parent, exc) from None
    tmp = os.path.join(scratch, _SCRATCH_CACHE)
    try:
        os.mkdir(tmp, _DIR_MODE)
        meta = make_meta(
            layout, length=length, slots=slots, variants=variants, has_slot_index=slot_index is not None,
            fingerprint=fingerprint, delete_on_close=delete_on_close, library_version=library_version,
            heap_budget=heap_budget, share=share, stream=stream, deterministic=deterministic,
        )
        for field, spec in zip(layout.fields, meta["fields"]):
            if field.ragged:
                _reserve(os.path.join(tmp, spec["heap"]), 0)
                _write_npy(tmp, spec["index_file"], np.dtype("<i8"), (rows, 2 + len(field.shape)))
                continue
            _write_npy(tmp, spec["file"], field.np_dtype, (rows, *field.shape))
            if spec["shape_file"]:
                _write_npy(tmp, spec["shape_file"], np.dtype("<i8"), (rows, len(field.shape)))
        if slot_index is not None:
            fd = _write_npy(tmp, fmt.SLOT_INDEX, np.dtype("<i8"), (slots,), keep_open=True)
            with os.fdopen(fd, "r+b") as f:
                f.seek(-8 * slots, os.SEEK_END)
                f.write(np.asarray(slot_index, dtype="<i8").tobytes())
        state_files = [(fmt.FILLED, bitmap_bytes(rows)), (fmt.STALE, bitmap_bytes(rows)), (fmt.SEQ, 4 * rows),
                       (fmt.KEYS, 8 * rows), (fmt.HEAPS, 8 * HEAP_BLOCK * len(layout.ragged)), (fmt.LOCK, 0),
                       (fmt.USERS, 0), (fmt.CHANGES, 8 * fmt.CHANGES_WORDS)]
        if stream is not None:
            state_files += [(fmt.RING, 8 * fmt.RING_WORDS), (fmt.PRODUCERS, 0)]
        for name, size in state_files:
            _reserve(os.path.join(tmp, name), size)
        write_meta(tmp, meta)  # last: a directory with meta.json is a complete cache
        if prepare is not None:
            prepare(tmp)
        os.rename(tmp, path)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE):
            remove_scratch(scratch)
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                exc.add_note(f"mmapcache: a cache keeps one or two open files per field ({len(layout.fields)} fields "
                             "here); raise the open-file limit (`ulimit -n`), or return fewer, larger fields (stack "
                             "values into tensors)")
                raise
            raise InsufficientSpaceError(_space_message(path, needed, free_bytes(parent), length)) from None
        remove_scratch(scratch)
        raise
    except BaseException:
        remove_scratch(scratch)
        raise
    remove_scratch(scratch)


def make_scratch(parent: str, kind: str) -> str:
    """Makes a scratch directory in ``parent`` (``kind`` "new" or "old") carrying the marker; returns its path."""
    while True:
        scratch = os.path.join(parent, f".mmapcache-{kind}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(scratch, 0o700)  # ours alone while it exists
            break
        except FileExistsError:
            continue
    try:
        os.close(os.open(os.path.join(scratch, SCRATCH_MARKER),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except BaseException:
        os.rmdir(scratch)
        raise
    return scratch


def is_scratch(path: str) -> int | None:
    """The pid that made the scratch directory at ``path``, if it is one (name pattern, a real directory, and
    the marker inside, all checked without following links); else None."""
    match = SCRATCH.fullmatch(os.path.basename(path))
    if match is None:
        return None
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode) or not stat.S_ISREG(
                os.lstat(os.path.join(path, SCRATCH_MARKER)).st_mode):
            return None
    except OSError:
        return None
    return int(match.group(2))


def remove_scratch(scratch: str) -> None:
    """Deletes a scratch directory and what it holds, if it carries the marker (never through a link)."""
    if is_scratch(scratch) is not None:
        shutil.rmtree(scratch, ignore_errors=True)  # fd-based on Linux: never follows a symlink out


def move_to_scratch(path: str) -> str:
    """Moves the directory ``path`` into a new "old" scratch directory beside it (atomically: it vanishes from
    ``path`` at once); returns the scratch directory, which ``remove_scratch`` then deletes."""
    scratch = make_scratch(os.path.dirname(path), "old")
    try:
        os.rename(path, os.path.join(scratch, _SCRATCH_CACHE))
    except BaseException:
        remove_scratch(scratch)
        raise
    return scratch


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
    nbytes = math.prod(shape) * dtype.itemsize
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


def _space_message(path: str, needed: int, free: int, length: int) -> str:
    # (what fits, at the bytes a sample needs in all: its rows and its ragged values' estimate, not only its rows)
    fit = min(length, int(free * 0.95) * length // max(needed, 1))
    return (
        f"not enough space for the cache at {path}: it needs {needed} bytes ({format_size(needed)}), "
        f"{os.path.dirname(path)} has {free} bytes ({format_size(free)}) free. Fixes: cache part of the dataset with "
        f"max_bytes={int(free * 0.95)} (about {fit} of {length} samples fit; `mmapcache build --max-bytes`), "
        "put it on a larger file system with MMAPCACHE_DIR, free space (`mmapcache ls`, `mmapcache rm`), or, in "
        "Docker, give the container more shared memory (`docker run --shm-size=16g`)"
    )
