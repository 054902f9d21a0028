"""Opening and mapping a cache directory, and registering this process as one of its users.

A ``Store`` is one process's view of a cache: ``meta.json`` parsed and checked, every data file mapped (and its
``.npy`` header checked against ``meta.json``), the slot state mapped. Creating a cache is ``store.create``; removing
one, listing its users and sweeping leftovers is ``store.admin``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import math
import mmap
import os
import stat
import weakref

import numpy as np

from ..errors import CacheFormatError, CacheNotFoundError, UnsupportedFileSystemError
from ..format import spec as fmt
from ..format.layout import Layout
from .admin import delete
from .files import is_cache, open_file, read_meta
from .heap import BLOCK as HEAP_BLOCK
from .heap import Heap
from .state import SlotState, map_exact

# --- opening ---------------------------------------------------------------------------------------------------


class Store:
    """One process's mapping of a cache directory.

    Attributes:
        path: the cache directory.
        meta: the parsed ``meta.json``.
        layout: the sample layout.
        data: per field, a numpy view ``(rows, *shape)`` of its ``.npy`` file.
        shapes: per field, the ``(rows, ndim)`` int64 view of its shape file (``max_shapes`` fields), else None.
        index: per field, the ``(rows, 2 + ndim)`` int64 view of a ragged field's index, else None.
        heaps: per field, a ragged field's ``Heap``, else None.
        heap_counters: ``(ragged fields, _heap.BLOCK)`` uint64 view of ``heaps.u64``.
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
            self.meta = read_meta(path)
        except CacheFormatError:
            if self.moved():
                raise CacheNotFoundError(_removed_message(path)) from None
            raise
        if writable is None:
            writable = os.access(path, os.W_OK) and all(
                os.access(os.path.join(path, f["file"] or f["heap"]), os.W_OK) for f in self.meta["fields"]
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
        self.index: list[np.ndarray | None] = []
        self.heaps: list[Heap | None] = []
        self.heap_budget: int | None = self.meta["heap_budget"]
        self._finalizer = weakref.finalize(self, _release, self._maps, self._fds, self.heaps)
        try:
            ragged = len(self.layout.ragged)
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            self._maps.append(map_exact(path, fmt.HEAPS, 8 * HEAP_BLOCK * ragged, access, writable))
            self.heap_counters = np.frombuffer(self._maps[-1], "<u8", count=HEAP_BLOCK * ragged).reshape(
                ragged, HEAP_BLOCK)
            for field, spec in zip(self.layout.fields, self.meta["fields"]):
                if field.ragged:
                    self.data.append(None)  # type: ignore[arg-type]
                    self.data_fds.append(-1)
                    self.data_offsets.append(0)
                    self.shapes.append(None)
                    self.index.append(self._map_npy(spec["index_file"], np.dtype("<i8"),
                                                    (self.rows, 2 + len(field.shape))))
                    self.heaps.append(Heap(path, spec["heap"], self.heap_counters[sum(h is not None for h in
                                                                                      self.heaps)], writable))
                    continue
                self.index.append(None)
                self.heaps.append(None)
                self.data.append(self._map_npy(spec["file"], field.np_dtype, (self.rows, *field.shape), keep_fd=True))
                shape_file = spec["shape_file"]
                self.shapes.append(
                    self._map_npy(shape_file, np.dtype("<i8"), (self.rows, len(field.shape))) if shape_file else None
                )
            self.slot_index = self._read_slot_index()
            self.state = SlotState(path, self.rows, writable)
            self.state.recounts += [heap.recount_locked for heap in self.heaps if heap is not None]
            self.state.check_consistency(path)
            for heap in self.heaps:
                if heap is not None:
                    heap.check_opened(self.state.still)
        except CacheFormatError:
            self._finalizer()
            if self.moved():  # files vanished because the cache was removed meanwhile, not damaged
                raise CacheNotFoundError(_removed_message(path)) from None
            raise
        except OSError as exc:
            self._finalizer()  # every descriptor opened so far: a process out of them (EMFILE) must get them back
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                exc.add_note(f"mmapcache: a cache keeps one or two open files per field ({len(self.layout.fields)} "
                             "fields here); raise the open-file limit (`ulimit -n`), or return fewer, larger fields")
            if exc.errno in (errno.ENODEV, errno.EINVAL, errno.EOPNOTSUPP):
                raise UnsupportedFileSystemError(
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
            fd = open_file(self.path, name, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            raise CacheFormatError(f"{path} is missing; {fix}") from None
        try:
            expected = _npy_header(dtype, shape)
            with os.fdopen(os.dup(fd), "rb") as f:
                if f.read(len(expected)) == expected:
                    # The header we write, byte for byte: no need to parse it. (numpy parses headers with
                    # ast.literal_eval, and CPython 3.11's AST conversion can fail spuriously with "recursion depth
                    # mismatch" in a process that forks; this keeps ast out of every normal open.)
                    header, offset = (shape, False, dtype), len(expected)
                else:
                    f.seek(0)
                    try:
                        version = np.lib.format.read_magic(f)
                        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                                       (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                        if read_header is None:
                            raise ValueError(f"unsupported .npy version {version}")
                        header = read_header(f)
                    except Exception as exc:  # numpy's literal parser raises what the tokenizer met (TokenError...)
                        raise CacheFormatError(f"{path} is not a valid .npy file ({exc}); {fix}") from None
                    offset = f.tell()
            found_shape, fortran, found_dtype = header
            if tuple(found_shape) != shape or fortran or np.dtype(found_dtype) != dtype:
                raise CacheFormatError(
                    f"{path}: found array {found_dtype} {tuple(found_shape)}, expected {dtype.str} {shape} as "
                    f"{fmt.META} says; {fix}"
                )
            nbytes = math.prod(shape) * dtype.itemsize
            size = os.fstat(fd).st_size
            if size != offset + nbytes:
                what = "truncated" if size < offset + nbytes else "resized (it never grows)"
                raise CacheFormatError(f"{path} has {size} bytes, expected {offset + nbytes}: it is {what}; {fix}")
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
        return np.frombuffer(m, dtype, count=math.prod(shape), offset=offset).reshape(shape)

    def _read_slot_index(self) -> np.ndarray | None:
        if self.meta["slot_index"] is None:
            return None
        index = self._map_npy(self.meta["slot_index"], np.dtype("<i8"), (self.slots,))
        if len(index) and (index.min() < 0 or index.max() >= self.length or len(np.unique(index)) != len(index)):
            raise CacheFormatError(f"{self.path}/{fmt.SLOT_INDEX}: indices outside [0, {self.length}), or one index "
                                   "in two slots; the cache is damaged: remove it and build it again")
        return index

    def layout_contradiction(self) -> str | None:
        """What of the layout ``meta.json`` records this cache's own rows contradict (a ragged field's fixed
        dimension that a complete row's recorded shape lacks), or None. For error paths: it reads the index entry
        of every complete row."""
        rows = np.flatnonzero(self.state.filled_rows(np.arange(self.rows, dtype=np.int64)))
        for field, index in zip(self.layout.fields, self.index):
            if index is None or not len(rows):
                continue
            shapes = index[rows, 2:]
            kept = field.keeps_fixed(shapes)
            if not kept.all():
                k = int(np.argmin(kept))
                shown = tuple("*" if d < 0 else d for d in field.shape)
                return (f"{self.path}/{fmt.META} records field {field.name!r} with the shape {shown} (* varies), "
                        f"but row {int(rows[k])} stores a value of shape {tuple(int(d) for d in shapes[k])}")
        return None

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
            fd = open_file(self.path, fmt.USERS, os.O_RDONLY)
        except FileNotFoundError:
            if self.moved():
                raise CacheNotFoundError(_removed_message(self.path)) from None
            raise CacheFormatError(f"{users} is missing; the cache is damaged: remove it (`mmapcache rm --force "
                                   f"{self.path}`) and build it again") from None
        except CacheFormatError:
            # Opened just before a remover renamed the cache away and unlinked its files: ``users`` then has no
            # link left, which on a cache in place would be damage.
            if self.moved():
                raise CacheNotFoundError(_removed_message(self.path)) from None
            raise
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
            probe = open_file(self.path, fmt.USERS, os.O_RDONLY)
        except (FileNotFoundError, CacheFormatError):
            return False
        try:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # another user holds it
            if self.moved() or not is_cache(self.path):
                return False
            delete(self.path)
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
        self.index.clear()
        # (a view of heaps.u64's map: while it lives the map cannot be closed, and the file system stays busy)
        self.heap_counters = np.zeros((0, HEAP_BLOCK), "<u8")
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


def _release(maps: list[mmap.mmap], fds: list[int], heaps: list[Heap | None]) -> None:
    for heap in heaps:
        if heap is not None:
            heap.close()
    heaps.clear()
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
    for m in maps:
        with contextlib.suppress(BufferError, ValueError):
            m.close()
    maps.clear()


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` (format 1.0) header numpy writes for a C-order array of ``dtype`` and ``shape``, magic included:
    what ``store.create`` wrote, so an intact file's header compares equal byte for byte."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        out, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
    return out.getvalue()
