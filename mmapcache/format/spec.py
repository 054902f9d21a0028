"""The on-disk format of a cache, as a document: every file, its bytes, and how writers and readers use them; the
file names, magic and version as constants (``format.meta`` builds and validates ``meta.json``).

Format version 3 (and 2)
========================

A cache is a directory. Every file in it is created before the directory is renamed into place, so a
reader never sees a partial cache: it is built as ``<parent>/.mmapcache-new-PID-HEX/cache`` (a scratch directory
whose first file is the marker ``MMAPCACHE-SCRATCH``), and removed by renaming it to
``<parent>/.mmapcache-old-PID-HEX/cache`` first; only such marked scratch directories of dead processes are ever
swept. Every file of a cache is a regular file with one link (opened with ``O_NOFOLLOW``; see ``store.files``).
Every file but the heaps has a fixed size from creation; heaps grow (see below); nothing is ever truncated.

Terms: ``N`` = ``length`` (samples in the source); ``S`` = ``slots`` (samples that can be cached, ``S <= N``);
``K`` = ``variants`` (stored versions of each sample); ``R = S * K`` rows. In mode ``"cache"``, sample ``i``
lives in slot ``s = i`` when ``slot_index`` is null and ``i < S`` (a cached prefix), else in slot ``s`` with
``slot_index.npy[s] == i``; its variant ``v`` is row ``r = s * K + v``. (Node shares that rotate and the stream
ring map samples to rows differently: see their sections.)

``meta.json`` (UTF-8 JSON, written once at creation, never modified)::

    {"magic": "mmapcache", "format_version": 2, "library_version": "0.4.0",
     "created": "2026-11-23T03:00:00Z",      # UTC, ISO 8601
     "mode": "cache" | "stream",             # see "Stream mode"
     "share": null | {...},                  # this node's share of the indices, see "Node shares"
     "stream": null | {"seed": s},           # mode "stream" only, see "Stream mode"
     "length": N, "slots": S, "variants": K, "rows": R,
     "slot_index": null | "slot_index.npy",  # which source index each slot holds, when not a prefix
     "fingerprint": null | "<str>",          # caller's identification of the source
     "deterministic": true | false,          # whether the source returns the same sample for the same index
                                             #   (absent in caches made before 0.3: true)
     "delete_on_close": false,               # remove the cache when its last user detaches
     "heap_budget": null | <int>,            # bytes all heaps together may reserve (from max_bytes)
     "structure": {...},                     # the container tree: {"tuple": [...]}, {"list": [...]},
                                             #   {"dict": [[key, node], ...]},
                                             #   {"namedtuple": [module, qualname, [names]], "items": [...]},
                                             #   {"leaf": field_number}
     "fields": [{"name": "0", "kind": "tensor", "dtype": "|u1", "torch_dtype": "uint8",
                 "shape": [3, 64, 64], "variable": false, "ragged": false, "class": null, "metadata": null,
                 "file": "0.npy", "shape_file": null, "heap": null, "index_file": null}, ...]}

``kind`` is one of tensor, ndarray, int, float, bool, numpy_scalar, str, bytes, numpy_str, numpy_bytes, pylist (a
Python list of numbers, nested or not, stored as one array and returned with ``tolist()``), json (a tensor
subclass's attributes). ``dtype`` is ``numpy.dtype.str``; torch dtypes without a numpy equivalent (bfloat16,
complex32, float8) are stored as the unsigned integer of the same width and ``torch_dtype`` names the real type.
The structure's leaves are the fields ``0 .. L-1``; metadata fields (kind json, named ``<path>#meta``) follow them.
At most 256 fields; arrays have at most 32 dimensions.

``class`` (tensor fields): null, or ``[module, qualname]`` of the ``torch.Tensor`` subclass a value is rebuilt as
(found among imported modules only; never imported because this file names it). ``metadata``: null, or the
number of the json field holding each sample's instance attributes as compact JSON, where a dict is
``{"dict": {...}}``, a tuple ``{"tuple": [...]}`` and an Enum member ``{"enum": [module, qualname, name]}``.

Fixed fields (``ragged`` false). ``<field>.npy``: a standard NumPy ``.npy`` file (format 1.0, C order) of shape
``(R, *shape)``, so ``numpy.load(path + "/image.npy", mmap_mode="r")`` reads it. Row ``r`` holds the sample stored
in row ``r`` if its filled bit is set; other rows are zero or stale. A *variable* field (``max_shapes``) holds the
value flattened (C order) in the row's first ``prod(actual_shape)`` elements; the actual shape is row ``r`` of
``<field>.shape.npy``, an int64 ``.npy`` of shape ``(R, ndim)``.

Ragged fields (``ragged`` true: ``str``, ``bytes``, json, 1-D lists of numbers, and arrays whose shape varies;
``shape`` holds ``-1`` in each dimension that varies, ``file`` is null):

- ``<field>.heap``: the values' bytes (C order; UTF-8 for ``str``). Its size is its *capacity*, reserved with
  ``posix_fallocate`` before any byte is written there, so a reader mapping it never faults past the end of the
  file. Each row owns an *extent* of the heap, at an offset that is a multiple of the dtype's item size.
- ``<field>.index.npy``: int64 ``.npy`` of shape ``(R, 2 + ndim)``: ``[offset, extent_bytes, *shape]`` of row
  ``r``: its extent and the value's shape; the value is the first ``prod(shape) * itemsize`` bytes of the extent.
- ``heaps.u64``: per ragged field, in field order, a block of ``8 + 320`` little-endian uint64: ``[end, capacity,
  abandoned, uncached, free, 0, 0, 0]`` then 320 free-list heads. ``end``: bytes of the heap handed out to extents
  so far; ``capacity``: the heap file's size; ``abandoned``: bytes of ``[0, end)`` no row uses and no list holds
  (scraps under 16 bytes, alignment); ``uncached``: samples passed through uncached because the heap had no room;
  ``free``: bytes on the free lists. Head ``c`` is 0 (empty) or 1 + the offset of the first free extent of size
  class ``c``: sizes in ``[(8 + c % 8) << (c // 8 + 1), (9 + c % 8) << (c // 8 + 1))`` (8 classes per power of
  two from 16 bytes). A free extent's first 16 bytes are two little-endian uint64: 1 + the offset of the next
  extent on its list (0: the last), and its own size. Changed only under the writer lock.

Narrowed fields (version 3; ``store_as``): a ragged tensor, array or list field's entry may say ``"stored":
"<i4"`` (a narrower ``numpy.dtype.str`` of its dtype's kind: an integer in a narrower integer, a float in a
narrower float; not for a ``torch_dtype`` numpy has no type for): its heap holds the values in that dtype, offsets
a multiple of its item size, and readers convert them back to ``dtype``. Or ``"ones": true``: every value is all
ones, nothing of it is in the heap; its index row is ``[0, 0, *shape]`` (a row of any other extent is damage), and
the heap file stays empty. Writers check every value before storing it: one that the narrower dtype does not
hold exactly (or a value of a ``ones`` field that is not all ones) is refused, never wrapped or rounded. A field's
entry without either key is stored as ``dtype``, as in version 2.

How writers use the heap (``store.heap`` has the details): a row's first value gets an extent of exactly its size at
``end``; a rewrite stays in place when it fits the row's extent and uses at least half of it, else moves to an
extent from the free lists or at ``end`` (sized to its class), and frees the old one. ``end`` grows the file
first by ``max(16 KiB, capacity / 16)`` (within ``heap_budget``, and past what the value needs by at most half
of what the budget has left, which the ragged fields share). With no room (the file system, or the budget),
the row is not stored and ``uncached`` counts it. A reader maps a heap at its size when it opens it, and maps it
again when a row's value ends past the mapped size.

``slot_index.npy`` (only when ``slot_index`` is not null): int64, shape ``(S,)``: the source index in each slot.

``keys.i64``: ``R`` little-endian int64: the key of the value row ``r`` holds, written with the row (inside its
seqlock window): the source index in mode "cache", the sequence number in mode "stream". A reader that maps rows
dynamically (a rotating share, the stream) accepts a row only if its key is the one it looks for.

``filled.bits``: ``ceil(R / 8)`` bytes; bit ``r`` (byte ``r // 8``, bit ``r % 8``, little-endian bit order as
``numpy.unpackbits(bits, bitorder="little")`` reads it) is 1 when row ``r`` holds a complete sample.

``stale.bits``: same size and order; bit ``r`` is 1 when row ``r`` was marked for recomputation (refresh).

``seq.u32``: ``R`` little-endian uint32 sequence counters. A writer makes ``seq[r]`` odd before touching row
``r``'s bytes (fixed rows, heap bytes, index row and key) and even (one higher) after. A reader copies a row only
if its filled bit is set and ``seq[r]`` is even, and keeps the copy only if ``seq[r]`` is unchanged after the copy
(a seqlock). A filled row's counter is at least 2. An odd counter seen by a writer holding the lock is a writer
that died mid-write: the row is treated as unfilled, and its old heap extents as lost (never reused or freed).

``changes.u64``: 2 little-endian uint64, ``[changes, complete]``: a seqlock over the whole cache and the number of
complete rows (filled bit set, counter even, not stale). A writer makes ``changes`` odd before it changes any row or
bit and even after, and keeps ``complete`` exact. A reader that finds ``changes`` even and ``complete == R`` before
copying rows, and ``changes`` unchanged after, needs no per-row check: no writer touched anything meanwhile. A writer
that finds ``changes`` odd (a writer died mid-change) counts ``complete`` again from the bits, and each heap's
``free`` from its free lists: every update of several words (a list's head and ``free``, a sweep) is made inside a
change, so a kill between two of its stores leaves ``changes`` odd, and the words are recounted, never believed.

``lock``: empty. ``flock(LOCK_EX)`` on it is the writer lock: bitmaps, counters, keys and heap counters change,
and rows are written, only under it. Exclusive byte-range locks (``fcntl``: open file description locks,
``F_OFD_SETLK``, which belong to the descriptor that took them; POSIX record locks where the kernel lacks those,
and the two kinds conflict with each other) on byte ``c`` of the same file are build workers' claims on chunk ``c``
in mode "cache", and a producer's claim on row ``c`` in mode "stream" (Linux keeps ``flock`` and byte-range locks
independent); the kernel drops them when a holder dies.

``users``: empty. Every process using the cache holds ``flock(LOCK_SH)`` on it; a process that can take
``LOCK_EX`` is the last user (used by ``delete_on_close`` and by ``rm`` to refuse caches in use).

Node shares
-----------

``share``: ``{"node": k, "nodes": n, "seed": s, "rotate_every": E | null}``: the cache holds only node ``k``'s part
of a partition of ``0 .. N-1`` into ``n`` near-equal parts, the same on every node. The partition of generation
``g`` is ``numpy.random.default_rng([s, g]).permutation(N)`` cut into ``n`` consecutive parts, part ``j`` holding
positions ``[j * N // n, (j + 1) * N // n)``; the share is part ``k``, sorted. Without rotation (``rotate_every``
null) the share is generation 0's, recorded as ``slot_index.npy``, and the cache is an ordinary one of those
slots. With rotation, epoch ``e`` is in generation ``g = e // E``, ``S = ceil(N / n)``, ``slot_index.npy`` holds
generation 0's share (padded with -1 past its end), and sample ``i`` of generation ``g`` lives in slot ``j``, its
position in generation ``g``'s sorted share; a row filled under another generation holds another index (its key
says which), reads as a miss and is overwritten.

Stream mode
-----------

``mode: "stream"``: ``K = 1``, no ``slot_index``, no ``share``, ``stream: {"seed": s}`` (one node) or ``{"seed":
s, "split": {"node": n, "nodes": D, "ranks": L}}`` (node ``n`` of a job of ``D >= 2`` nodes of ``L`` ranks each,
``W = D * L``). Epoch ``e``'s order is ``numpy.random.default_rng([s, e]).permutation(N)``. The ring holds the
node's *sequence* of it: one node, every position ``p`` in order (sequence position ``j = p``); with a split, the
positions job ranks ``n * L .. n * L + L - 1`` read, in order, ``p(j) = n * L + j % L + W * (j // L)`` for ``j <
M``, ``M`` the number of such ``p < N`` (``store.split``). Sequence position ``j`` of epoch ``e`` has the sequence
number ``q = e * M + j`` (``M = N`` for one node), kept in row ``q % S`` with key ``q``. The node's local rank ``r`` of
``L`` (one node: rank ``r`` of its ``W`` readers) reads sequence positions ``r + k * L``, ``k < ceil(N / W)``: job
rank ``n * L + r``'s part as ``DistributedSampler`` splits it; those past ``M`` (padding, ``p >= N``) are index
``order[p % N]``, never stored. Two more files:

- ``ring.u64``: ``8 + 3 * 256`` little-endian uint64: ``[next, produced, served, computed, waited_ns, skipped, L,
  0]``, then two words per consumer rank (up to 256), then a word per rank. ``next``: the next sequence number a
  producer claims; ``produced``: values published; ``served``: values served from the ring (each at most once);
  ``computed``: positions a consumer computed itself (the producer was behind, or padding); ``waited_ns``: time
  consumers spent waiting for a producer; ``skipped``: values produced but passed by their consumer before they were
  published. Rank ``r``'s words: its cursor, 0 (never read) or 1 + the next sequence number it will read from the
  ring; and its progress, 0 or ``epoch << 32 | (k + 1)``: it consumed its first ``k`` positions of ``epoch``. Counters
  change under the writer lock; a rank's words are written by that rank only: while a loader reads rank ``r``, its
  process holds a byte-range lock on byte ``2**40 + r`` of ``lock``, and a second reader of that rank is refused. Then
  (since 0.6) one word per rank, its *taken end*: its readers compute, themselves, every position of theirs below it
  that no producer claimed before (sequence position ``j`` is local rank ``j % L``'s, ``L`` the readers recorded in
  word 6 of the header; a reader starting sets its word to 0, and a new ``L`` clears them all). Written under the
  writer lock. A ring of ``8 + 2 * 256`` words (made before 0.6) has none: it is read as before.
- ``producers``: empty; every producer holds ``flock(LOCK_SH)`` on it while it runs.

A producer claims ``q >= max(next, low)`` (``low``: the smallest cursor in use) if ``q < low + S`` and ``q`` is at
or past its rank's taken end (then ``next = q + 1``), holds a byte-range lock on byte ``q % S`` of ``lock`` while it
computes, and publishes the row with key ``q`` unless its consumer has
passed it. A consumer reads row ``q % S`` only if its key is ``q`` (filled, seqlock as above), and moves its cursor
past ``q`` once the batch is handed to the training loop: no value is served twice, and a row is reused only once
every cursor has passed it. Under ``max_bytes`` the heaps, not only the slots, bound how far ahead producers are: a
producer whose value finds no heap room first frees the extents of rows every cursor has passed (emptying them), then
keeps its claim and publishes once cursors move on; it gives the position up (its consumer computes it) when a
consumer waits for it, which that consumer says by holding a byte-range lock on byte ``2**41 + q % S`` of ``lock``
while it waits.

Format history
--------------
1: first version. No heaps, keys or modes; str, bytes, lists and tensor subclasses refused.
2: ragged fields in heaps with free lists; str, bytes, pylist and json kinds; tensor subclasses (``class``,
   ``metadata``); ``keys.i64``, ``heaps.u64``, ``changes.u64``, ``heap_budget``; node shares (``share``); stream
   mode (``mode``, ``stream``, ``ring.u64``, ``producers``). A version-1 cache is refused with a message to
   rebuild it (a cache is derived data; reading both would double the read path).
   Since mmapcache 0.3, ``meta.json`` records ``deterministic`` (readers of 0.2 ignore it; a cache without it
   reads as ``true``): a compatible addition, not a new version. Since 0.5, a stream of a job of several nodes
   records ``stream.split``; a stream without it is read as before, and readers before 0.5 refuse one with it as
   damage (they would read the node's sequence as the whole order). Since 0.6, ``ring.u64`` has a third word per
   rank (its taken end) and the number of readers in header word 6; a ring without them is read as before (a
   position may be computed twice), and readers before 0.6 refuse the longer ring as damage.
3 (mmapcache 0.6): a ragged field may be stored narrowed (``store_as``): ``"stored"`` or ``"ones"`` in its entry
   (see "Narrowed fields"). Only a cache with such a field is written as version 3, so every other cache stays
   readable by readers of version 2; a reader of version 2 refuses a version-3 cache (it would read int32 ids as
   int64 ones), and this version refuses a version-2 cache whose fields say ``stored`` or ``ones`` as damage.
"""

from __future__ import annotations

MAGIC = "mmapcache"
FORMAT_VERSION = 3
FORMAT_VERSIONS_READ = (2, 3)
NARROWED_SINCE = 3  # a cache with a field stored narrowed (store_as) is written as format 3, any other as format 2
MODES = ("cache", "stream")

META = "meta.json"
FILLED = "filled.bits"
STALE = "stale.bits"
SEQ = "seq.u32"
LOCK = "lock"
USERS = "users"
SLOT_INDEX = "slot_index.npy"
KEYS = "keys.i64"
HEAPS = "heaps.u64"
CHANGES = "changes.u64"
CHANGES_WORDS = 2
RING = "ring.u64"
RING_WORDS = 8 + 3 * 256  # the counters, two words per consumer rank, then each rank's taken end (see "Stream mode")
RING_WORDS_BEFORE_0_6 = 8 + 2 * 256  # a ring made before 0.6: no taken ends (read as before)
PRODUCERS = "producers"
