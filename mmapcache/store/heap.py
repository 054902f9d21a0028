"""Heaps: where ragged fields' values live, packed back to back, and how a writer finds room for one.

One heap per ragged field (``<field>.heap``), its per-row ``[offset, capacity, *shape]`` in ``<field>.index.npy``
and a block of ``BLOCK`` counters in ``heaps.u64`` (see ``format.spec``). Readers map a heap at its size and map it
again when they meet a value past their mapping; a heap never shrinks, so an old mapping stays valid for
everything it covers.

Writers allocate under the cache's writer lock (``store.state``), inside the row's seqlock window, so a reader of a
row being rewritten retries whatever the allocator does with the bytes it was copying:

- Each row owns an extent of ``capacity`` bytes (the second word of its index row), at least its value's
  ``prod(shape) * itemsize``. A row's first value gets an extent of exactly its size, at the end of the heap: a
  heap filled once is packed back to back.
- A rewrite whose value fits the row's extent and uses at least half of it is written in place. A value that
  does not fit moves to a new extent, and so does one using under half of its extent if a free extent fits it
  (so large extents return to the free lists for the rows whose values grow). The old extent is freed once the
  new value and its index row are written.
- Free extents sit on segregated lists, 8 size classes per power of two from 16 bytes (each class 12.5% larger
  than the one below); an extent is pushed on the list of the largest class whose lower bound is ``<= size``.
  A moving value of ``n`` bytes pops from the list of the smallest class whose lower bound is ``>= n``, or one of
  the next 4 (extents up to ~1.8x the value); with none, it is appended at the end in an extent of that lower
  bound, so it can serve another value of its class once freed. The end grows the file with
  ``posix_fallocate`` first (never a sparse page a reader could fault on: SIGBUS on a full tmpfs), and never
  writes past the capacity so reserved: a writer checks the counters, and the extent a row's index records, before
  it writes (damage there is a ``CacheFormatError``, never a write).
- Each free extent holds, in its first 16 bytes, the offset + 1 of the next one in its list and its own size.
  Freed extents under 16 bytes (a row's first, exact value), and alignment padding, are *abandoned*.

So the space rewrites give up is reused by later values, and fragmentation is bounded: the heap holds the live
values, the rows' slack (under 2x each), the free lists (counted in ``free``) and the abandoned scraps (counted in
``abandoned``), which ``mmapcache inspect`` shows. Measured (``tests/test_sample_types.py``): 200 rows refreshed
half at a time with values of 32..2400 bytes level off at 1.5x the live values (flat from round 10 to 80). A writer
killed mid-write leaks at most the extents it was moving (counted nowhere; the row itself reads as unfilled), never
hands one extent to two rows: the next writer of a row whose counter is odd ignores that row's old extent (see
``RowWriter.write``).

When the heap cannot grow (the file system, or the cache's heap budget, has no room), ``allocate`` cuts the value's
room from the front of a larger free extent than it would take whole (``_split``). With none, a writer may rebuild
the free lists from the extents rows own (``sweep``): every other byte is free, and adjacent free bytes become one
extent (the lists never join neighbours otherwise). Under a budget, values of new sizes left extents of every size,
none large enough for a value that grew. When there is still no room, ``allocate`` returns None and the sample is
served uncached (``uncached`` counts it).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
import threading
from collections.abc import Callable

import numpy as np

from ..errors import CacheFormatError
from .files import open_file

# The counters of one heap (a row of heaps.u64), then the free-list heads.
END, CAPACITY, ABANDONED, UNCACHED, FREE = range(5)
HEADS = 8  # the first head's word; words 5..7 are reserved (zero)
_CLASSES_PER_DOUBLING = 8
_MIN_EXTENT_LOG2 = 4  # 16 bytes: room for a free extent's two words
CLASSES = 40 * _CLASSES_PER_DOUBLING  # up to 2**44 bytes (16 TiB) per extent
BLOCK = HEADS + CLASSES  # uint64 words per ragged field in heaps.u64
MIN_EXTENT = 1 << _MIN_EXTENT_LOG2
# Growth step: at least this (without a heap budget; see Heap.reserve), else a sixteenth of the capacity
# (reserved-but-unused space stays under ~6%).
_MIN_GROWTH = 1 << 14
_PAGE = 4096
# How many classes above the one that fits a value ``reuse`` looks in (each is 12.5% larger than the one below).
_SEARCH = 5
# A free extent's record, its first 16 bytes: the next extent's offset + 1 on its list (0: the last), and its size.
_RECORD = struct.Struct("<QQ")
# Buffers per pwritev call: the kernel's limit (UIO_MAXIOV, 1024 on Linux).
_IOV_MAX = 1024


def size_class(nbytes: int) -> int:
    """The class of an extent of ``nbytes >= MIN_EXTENT``: the largest class whose lower bound is ``<= nbytes``."""
    k = nbytes.bit_length() - 1
    return (k - _MIN_EXTENT_LOG2) * _CLASSES_PER_DOUBLING + ((nbytes >> (k - 3)) & 7)


def _size_classes(sizes: np.ndarray) -> np.ndarray:
    """``size_class`` of each of ``sizes`` (int64, each ``>= MIN_EXTENT``)."""
    k = np.frexp(sizes.astype(np.float64))[1].astype(np.int64) - 1  # floor(log2): exact below 2**53
    return (k - _MIN_EXTENT_LOG2) * _CLASSES_PER_DOUBLING + ((sizes >> (k - 3)) & 7)


def class_floor(cls: int) -> int:
    """The smallest extent size in class ``cls``."""
    k, sub = divmod(cls, _CLASSES_PER_DOUBLING)
    return (8 + sub) << (k + _MIN_EXTENT_LOG2 - 3)


def class_size(nbytes: int) -> int:
    """The smallest class floor ``>= nbytes`` (at least ``MIN_EXTENT``): the size of an extent allocated for a
    value of ``nbytes`` that may move (at most 12.5% more than the value)."""
    if nbytes <= MIN_EXTENT:
        return MIN_EXTENT
    floor = size_class(nbytes)
    return nbytes if class_floor(floor) == nbytes else class_floor(floor + 1)


class Heap:
    """One ragged field's heap file, mapped for reading (and open for ``pwrite`` in a writable store).

    Thread-safe for readers: ``covering`` may remap concurrently; every mapping made is kept until ``close``
    (values copied out of an older one are still valid: the heap only grows). Writing methods need the cache's
    writer lock.
    """

    def __init__(self, directory: str, name: str, counters: np.ndarray, writable: bool) -> None:
        self.path = os.path.join(directory, name)
        self.counters = counters  # this heap's BLOCK uint64 words (a view of heaps.u64)
        # The same words as Python ints (a memoryview: ~5x numpy's scalar access, on every miss's path).
        self.words = memoryview(counters).cast("B").cast("Q")  # type: ignore[arg-type]  # (an array is a buffer)
        self.writable = writable
        try:
            self.fd = open_file(directory, name, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            raise CacheFormatError(f"{self.path} is missing; the cache is damaged: remove it (`mmapcache rm "
                                   f"--force {directory}`) and build it again") from None
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.buf = np.empty(0, np.uint8)
        self._elements: tuple[np.ndarray, np.dtype, np.ndarray] | None = None  # (see ``elements``)
        self.size = 0
        # The file's size as this process last saw it (fstat, or its own posix_fallocate): a file never shrinks
        # (see check_counters).
        self._seen = 0
        # The loose bytes after this process's last sweep, and the bytes it freed since (worth_sweeping).
        self._swept, self._freed = -1 << 62, 0
        self.remap()  # (the opener checks the counters next: check_opened)

    def _damaged(self, problem: str) -> CacheFormatError:
        directory = os.path.dirname(self.path)
        return CacheFormatError(f"{self.path}: {problem}; the cache is damaged: remove it (`mmapcache rm --force "
                                f"{directory}`) and build it again (`mmapcache verify {directory}` lists the damage)")

    def check_counters(self) -> None:
        """Raises ``CacheFormatError`` unless this heap's counters describe its file: ``end <= capacity <= size``
        (the file's size) and ``free + abandoned <= end``. Checked by a writer before it changes anything (holding
        the writer lock), so that no write lands past what ``posix_fallocate`` reserved; an opener calls
        ``check_opened``. The size is asked of the file only when the capacity is past the size this process last
        saw: nothing makes a heap smaller (a process truncating a cache file kills its readers with SIGBUS anyway,
        see docs/guarantees.md), and this is every miss's path."""
        w = self.words
        free, abandoned, uncached, end, capacity = w[FREE], w[ABANDONED], w[UNCACHED], w[END], w[CAPACITY]
        if end <= capacity <= self._seen and free + abandoned <= end and uncached < 1 << 63:
            return
        problem = self._counters_problem()
        if problem is not None:
            raise self._damaged(problem)

    def check_opened(self, still: Callable[[Callable[[], None]], None]) -> None:
        """``check_counters`` for an opener, which takes no lock: each bound is read after what it bounds (``free``
        and ``abandoned``, then ``end``, ``capacity`` and the file's size, which only grow, and in that order: a
        writer grows the file before it raises ``capacity``, and ``capacity`` before ``end``). The size read
        first, while another process grew the heap, had a sound cache reported damaged, with the advice to remove
        it. ``free`` and ``abandoned`` both move, both ways, when a writer sweeps, and read apart may add up past
        ``end``: a failed check is repeated under the writer lock (``still``: ``SlotState.still``), where no
        writer moves them, before it is believed."""
        if self._counters_problem() is not None:
            still(self.check_counters)

    def _counters_problem(self) -> str | None:
        """What is wrong with the counters (None: nothing), read in ``check_opened``'s order."""
        c = self.counters
        free, abandoned, uncached = int(c[FREE]), int(c[ABANDONED]), int(c[UNCACHED])
        end = int(c[END])
        capacity = int(c[CAPACITY])
        size = os.fstat(self.fd).st_size
        self._seen = max(self._seen, size)
        if not 0 <= end <= capacity <= size:
            return (f"its counters in heaps.u64 say {end} bytes are in use of {capacity} reserved, but the file has "
                    f"{size} bytes (need used <= reserved <= file size): the file or heaps.u64 is truncated or "
                    "overwritten")
        if free + abandoned > end or uncached >= 1 << 63:
            return (f"its counters in heaps.u64 say {free} bytes are free and {abandoned} abandoned of {end} in use, "
                    f"and {uncached} samples were not stored")
        return None

    def check_extent(self, offset: int, capacity: int, align: int, row: int) -> None:
        """Raises ``CacheFormatError`` unless ``[offset, offset + capacity)``, row ``row``'s extent as its index
        row records it, lies in the heap's used part at a multiple of ``align``. A writer checks a row's extent
        before it writes into or frees it (holding the writer lock)."""
        end = int(self.counters[END])
        if capacity < 0 or offset < 0 or offset + capacity > end or (capacity and offset % align):
            raise self._damaged(f"row {row}'s index records the extent [offset {offset}, {capacity} bytes], not a "
                                f"part of the heap's {end} used bytes at a multiple of {align}")

    def remap(self) -> None:
        """Maps the heap at its current size, if it grew since the last mapping."""
        with self._lock:
            size = os.fstat(self.fd).st_size
            if size <= self.size:
                return
            m = mmap.mmap(self.fd, size, mmap.MAP_SHARED,
                          access=mmap.ACCESS_WRITE if self.writable else mmap.ACCESS_READ)
            self._maps.append(m)
            self.buf = np.frombuffer(m, np.uint8)
            self.size = size

    def elements(self, dtype: np.dtype) -> np.ndarray:
        """The mapped bytes as elements of ``dtype`` (the whole ones), kept until the next remap."""
        kept = self._elements
        if kept is None or kept[0] is not self.buf or kept[1] != dtype:
            buf = self.buf
            kept = self._elements = (buf, dtype, buf[:len(buf) - len(buf) % dtype.itemsize].view(dtype))
        return kept[2]

    def covering(self, end: int) -> np.ndarray:
        """The mapped bytes, remapped if ``end`` lies past them (a value written after this process mapped)."""
        if end > self.size:
            self.remap()
        return self.buf

    # --- writing (caller holds the writer lock) ----------------------------------------------------------------

    def allocate(self, nbytes: int, align: int, budget_left: int | None, *,
                 exact: bool = False) -> tuple[int, int] | None:
        """Room for ``nbytes``: ``(offset, capacity)``, the offset a multiple of ``align`` and ``capacity >= nbytes``
        the extent's size, which the row keeps. From the free lists, else at the end of the heap (growing the file),
        sized to the value's class (``class_size``) so that it can serve other values when freed, or to the value
        exactly with ``exact`` (a row's first value: a heap filled once is as compact as it can be). None when there
        is no room (the caller counts ``uncached``). Caller holds the writer lock."""
        if nbytes == 0:
            return 0, 0
        w = self.words
        if w[FREE]:
            room = self.reuse(nbytes, align)
            if room is not None:
                return room
        size = nbytes if exact else class_size(nbytes)
        end = w[END]
        offset = -(-end // align) * align
        if offset + size > w[CAPACITY] and not self.reserve(offset + size, budget_left):
            return self._split(nbytes, align)
        w[END] = offset + size
        w[ABANDONED] += offset - end  # alignment padding
        return offset, size

    def reserve(self, need: int, budget_left: int | None) -> bool:
        """Grows the file, if it must, so that its first ``need`` bytes are reserved (``CAPACITY``); False when the
        file system or the heaps' budget has no room. Caller holds the writer lock."""
        c = self.counters
        capacity = int(c[CAPACITY])
        if need <= capacity:
            return True
        # The step: a sixteenth of the capacity, and at least 16 KiB where no budget is shared.
        grown = max(need, capacity + max(_MIN_GROWTH if budget_left is None else 0, capacity // 16))
        grown = -(-grown // _PAGE) * _PAGE
        if budget_left is not None:
            # Under a budget that the ragged fields share, grow past what the value needs by at most half of
            # what is left: a step of one field must not take the room of the others' next values (with the
            # 16 KiB minimum step, a field of small values took the room a field of large ones needed, and a
            # stream's producers dropped its values).
            grown = min(grown, max(need, capacity + budget_left // 2))
            if grown - capacity > budget_left:
                return False
        if not self._reserve(capacity, grown):
            return False
        self._seen = max(self._seen, grown)
        c[CAPACITY] = grown
        return True

    def reuse(self, nbytes: int, align: int) -> tuple[int, int] | None:
        """Room for ``nbytes`` from the free lists only (never growing the heap): ``(offset, capacity)``, or None.
        Looks in the class that fits and a few above it (extents up to ~1.8x the value). Caller holds the lock."""
        w = self.words  # (Python ints: a rewrite of every stream row comes here)
        if not w[FREE]:
            return None
        need = nbytes + align - 1  # room for the value wherever the extent starts
        first = size_class(class_size(need))
        for cls in range(first, min(CLASSES, first + _SEARCH)):
            if w[HEADS + cls]:
                break
        else:
            return None
        offset, size = self._pop(cls, need)
        start = -(-offset // align) * align
        w[ABANDONED] += start - offset
        return start, offset + size - start

    def _pop(self, cls: int, need: int) -> tuple[int, int]:
        """Takes the first extent off the (non-empty) free list of class ``cls``, checked to hold ``need`` bytes:
        its ``(offset, size)``."""
        w = self.words
        offset, end = w[HEADS + cls] - 1, w[END]
        if not 0 <= offset <= end - MIN_EXTENT:
            raise self._damaged(f"the free list of size class {cls} starts at offset {offset}, outside the heap's "
                                f"{end} used bytes")
        following, size = _RECORD.unpack_from(self.covering(end).data, offset)
        # A record is written before the head (or the record) that points to it: anything else is damage, never a
        # writer's interrupted step. Handing it out could give away bytes that some row uses.
        if (size < max(need, MIN_EXTENT) or size_class(size) != cls or offset + size > end
                or following > end - MIN_EXTENT + 1 or size > w[FREE]):
            raise self._damaged(f"the free extent at offset {offset} (on the list of size class {cls}) records "
                                f"{size} bytes and the next at {following - 1}: not an extent of that class inside "
                                f"the heap's {end} used bytes")
        w[HEADS + cls] = following
        w[FREE] -= size
        return offset, size

    def _split(self, nbytes: int, align: int) -> tuple[int, int] | None:
        """Room for ``nbytes`` cut from the front of the smallest free extent too large for ``reuse`` to take whole
        (the heap cannot grow): the value's class size, the rest back on the free lists. None if there is none."""
        c = self.counters
        first = size_class(class_size(nbytes + align - 1)) + _SEARCH
        if first >= CLASSES or not int(c[FREE]):
            return None
        nonempty = np.flatnonzero(c[HEADS + first:HEADS + CLASSES])
        if not len(nonempty):
            return None
        offset, size = self._pop(first + int(nonempty[0]), nbytes + align - 1)
        start = -(-offset // align) * align
        taken = min(offset + size, start + class_size(nbytes)) - start
        c[ABANDONED] += start - offset
        self.free(start + taken, offset + size - start - taken)
        return start, taken

    def sweep(self, owned: np.ndarray) -> None:
        """Rebuilds the free lists from what rows own: ``owned`` is every ``(offset, capacity)`` that a row's index
        records and the row may still read or reuse (see ``RowWriter``); every other byte below ``END`` (free
        extents, abandoned scraps, the extents of writers that died) is free, and adjacent ones become one extent.
        Moved values leave extents of every size, none large enough for a value that grows: this joins them.
        Bytes that an ``owned`` extent covers are never freed, even where extents overlap (damage). A writer killed
        during a sweep leaves the free space on no list (counted nowhere), never a listed extent that a row owns.
        Caller holds the writer lock."""
        c = self.counters
        end = int(c[END])
        owned = owned[owned[:, 1] > 0]
        owned = owned[np.argsort(owned[:, 0], kind="stable")]
        gap_starts = np.concatenate(([0], np.maximum.accumulate(owned[:, 0] + owned[:, 1])))
        gap_ends = np.minimum(np.concatenate((owned[:, 0], [end])), end)
        sizes = gap_ends - gap_starts
        listed = sizes >= MIN_EXTENT
        scraps = int(sizes[(sizes > 0) & ~listed].sum())
        # Each class's extents in offset order, each record holding the next one's offset + 1 (0: the last).
        sizes, starts = sizes[listed], gap_starts[listed]
        classes = _size_classes(sizes)
        order = np.argsort(classes, kind="stable")
        classes, starts, sizes = classes[order], starts[order], sizes[order]
        first = np.concatenate(([True], classes[1:] != classes[:-1]))
        following = np.zeros(len(starts), np.int64)
        following[:-1] = np.where(first[1:], 0, starts[1:] + 1)
        heads = np.zeros(CLASSES, np.uint64)
        heads[classes[first]] = starts[first] + 1
        # The lists emptied first, then the records written, then the new heads: a writer killed while the records
        # are written (into bytes an old list may run through) leaves empty lists, counted as such.
        c[HEADS:HEADS + CLASSES] = 0
        c[FREE] = 0
        c[ABANDONED] = 0
        records = np.stack((following, sizes), axis=1).astype("<u8").view(np.uint8)
        self.covering(end)[starts[:, None] + np.arange(MIN_EXTENT)] = records
        c[HEADS:HEADS + CLASSES] = heads
        c[FREE] = int(sizes.sum())
        c[ABANDONED] = scraps
        self._swept, self._freed = int(sizes.sum()) + scraps, 0

    def worth_sweeping(self, nbytes: int) -> bool:
        """Whether a ``sweep`` might find room for ``nbytes`` that ``allocate`` did not: the bytes on no row's
        extent (free or abandoned) could hold it, and enough were freed since this process last swept (a heap whose
        budget is spent is not swept again on every miss, only once this process, or the loose bytes, have
        gained a step: at least the value, and 1/64 of the heap)."""
        c = self.counters
        loose, step = int(c[FREE]) + int(c[ABANDONED]), max(nbytes, int(c[END]) // 64)
        return loose >= nbytes and (self._freed >= step or loose >= self._swept + step)

    def free(self, offset: int, nbytes: int) -> None:
        """Gives back an extent no row uses any more (onto the list of its class). Caller holds the writer lock."""
        if nbytes <= 0:
            return
        w = self.words
        cls = size_class(nbytes) if nbytes >= MIN_EXTENT else CLASSES
        if cls >= CLASSES:
            w[ABANDONED] += nbytes  # under 16 bytes (a row's first, exact value): no room for the list's record
            return
        head = HEADS + cls
        self._pwrite_view(offset, memoryview(_RECORD.pack(w[head], nbytes)))  # the record first, then the head
        w[head] = offset + 1
        w[FREE] += nbytes
        self._freed += nbytes

    def recount_locked(self) -> None:
        """Sets the free counter to what the free lists hold. A writer killed between a list's head and the counter
        (``free``, ``_pop``, ``sweep``) left them apart, and the lists are what writers use: the next writer, which
        finds the cache-wide change counter odd (``SlotState``), recounts before it changes anything. Lists that
        are damaged are left as they are (``verify`` reports them). Caller holds the writer lock."""
        free, problem = self.free_extents()
        if problem is None:
            self.counters[FREE] = sum(size for _, size in free)

    def free_extents(self) -> tuple[list[tuple[int, int]], str | None]:
        """The ``(offset, size)`` of every extent on the free lists, and the first problem found walking them (an
        entry outside the heap's used bytes, an extent of another size class, a list that loops), or None. For
        ``verify``: reads only."""
        c = self.counters
        end = int(c[END])
        buf = self.covering(end)
        free: list[tuple[int, int]] = []
        for cls in range(CLASSES):
            at, hops = int(c[HEADS + cls]), 0
            while at:
                offset = at - 1
                if not 0 <= offset <= end - MIN_EXTENT:
                    return free, (f"a free list of size class {cls} points at offset {offset}, outside the heap's "
                                  f"{end} used bytes")
                following, size = (int(x) for x in buf[offset:offset + MIN_EXTENT].view("<u8"))
                if size < MIN_EXTENT or size_class(size) != cls or offset + size > end:
                    return free, (f"the free extent at offset {offset} (size class {cls}) records {size} bytes: not "
                                  f"an extent of that class inside the heap's {end} used bytes")
                free.append((offset, size))
                at, hops = following, hops + 1
                if hops > end // MIN_EXTENT:
                    return free, f"the free list of size class {cls} is longer than the heap can hold: it loops"
        return free, None

    def _reserve(self, reserved: int, size: int) -> bool:
        """Allocates the file's bytes ``[reserved, size)``: those below ``reserved`` are allocated already (the
        capacity, grown only by this method), and ``posix_fallocate`` walks every page of its range: growing from 0
        each time walked the whole heap at every step (300 MB written 152 KB at a time: 0.62 s against 0.19 s)."""
        try:
            os.posix_fallocate(self.fd, reserved, size - reserved)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                return False
            raise
        return True

    def write(self, offset: int, value: np.ndarray) -> None:
        """Copies a value's bytes to ``offset`` with ``pwrite`` (the kernel copies into the shared pages)."""
        nbytes = value.nbytes
        if nbytes:
            value = np.ascontiguousarray(value)
            written = os.pwrite(self.fd, value, offset)  # type: ignore[arg-type]  # (an array is a buffer)
            if written < nbytes:
                self._pwrite_view(offset + written, value.reshape(-1).view(np.uint8).data[written:])

    def write_packed(self, offset: int, values: list[np.ndarray]) -> None:
        """Copies C-contiguous values' bytes back to back from ``offset``: one ``pwritev`` for up to ``IOV_MAX`` of
        them (a short write is finished one value at a time)."""
        values = [v for v in values if v.nbytes]
        for first in range(0, len(values), _IOV_MAX):
            group = values[first:first + _IOV_MAX]
            written = os.pwritev(self.fd, group, offset)  # type: ignore[arg-type]  # (arrays are buffers)
            for value in group:
                if written < value.nbytes:  # a short write: the rest of this value, then the others whole
                    self._pwrite_view(offset + written, value.reshape(-1).view(np.uint8).data[written:])
                written = max(0, written - value.nbytes)
                offset += value.nbytes

    def _pwrite(self, offset: int, value: np.ndarray) -> None:
        self._pwrite_view(offset, value.reshape(-1).view(np.uint8).data)

    def _pwrite_view(self, offset: int, view: memoryview) -> None:
        while view:
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.buf, self._elements = np.empty(0, np.uint8), None
        # No view of heaps.u64 kept: its map can then be closed (a mapped file keeps its file system busy).
        detached = np.zeros_like(self.counters)
        self.counters, self.words = detached, memoryview(detached).cast("B").cast("Q")  # type: ignore[arg-type]
        for m in self._maps:
            with contextlib.suppress(BufferError, ValueError):
                m.close()
        self._maps.clear()


def budget_left(counters: np.ndarray, budget: int | None) -> int | None:
    """Bytes the heaps may still reserve together (``heap_budget`` minus every heap's capacity), or None."""
    if budget is None:
        return None
    return max(0, budget - int(counters[:, CAPACITY].sum()))
