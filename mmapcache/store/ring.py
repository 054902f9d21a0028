"""Stream mode: a ring of rows holding the next positions of each epoch's order, each value served at most once.

A stream cache (``mode: "stream"``, see ``format.spec``) keeps no sample for good. Epoch ``e``'s order is the seeded
permutation ``order(e)`` of the ``N`` indices, the same in every process. The ring holds the node's sequence of it
(``store.split``: every position on one node; in a job of several nodes, those its ranks read): sequence position
``j`` of epoch ``e`` has the sequence number ``q = e * M + j`` (``M`` positions a node holds per epoch, ``N`` on one
node), stored (when a producer has computed it) in row ``q % S`` with key ``q``. Local rank ``r`` of the node's
``L`` ranks reads sequence positions ``r, r + L, ...``: its job rank's part as ``DistributedSampler`` splits the
order, ``ceil(N / W)`` positions each, the last ones past the sequence padding (computed by the rank itself, from the
start of the order, never stored).

Consumers move their cursor (``ring.u64``: two words per rank, the next sequence number the rank will read, and
its progress ``(epoch, k)``) past a batch once it has been handed to the training loop. Producers claim sequence
numbers in order, ahead of the slowest consumer (``low``, the smallest cursor) by at most ``S``, so a row is only
rewritten once every consumer has passed its previous value: nothing is served twice, and nothing waiting to be
read is overwritten. While it computes, a producer holds a byte-range lock on byte ``row`` of the cache's ``lock``
file. Counters (``produced``, ``served``, ``computed``, ``waited_ns``, ``skipped``) change under the writer lock.

Each position is computed once on the node, by whoever gets there first. A reader that computes what it does not
find takes the positions of each batch before it reads them (its rank's *taken end*, a third word per rank, moves
past the batch: its workers read batches ahead of its cursor), and producers skip taken positions when they claim;
a position a producer claimed before is waited for, not computed again. So a producer behind its readers works
where its values will still be read, and none of its values goes unread but what it computed ahead of the readers.
A position a producer claimed and did not publish (it died, its source raised, it gave the value up for heap room)
is computed by its reader.

Numpy only: producers started by ``mmapcache build --follow`` and ``inspect`` never import torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time
from typing import Any

import numpy as np

from ..errors import CacheFormatError
from ..format import spec as fmt
from .admin import holders_of
from .files import open_file
from .lock import ChunkClaims
from .split import StreamSplit
from .state import map_exact

__all__ = ["Ring", "RING_WORDS", "MAX_RANKS", "epoch_order", "producers_of", "register_producer"]

NEXT, PRODUCED, SERVED, COMPUTED, WAITED_NS, SKIPPED, READERS = range(7)
HEADER = 8
MAX_RANKS = 256
RING_WORDS = fmt.RING_WORDS  # HEADER + 2 * MAX_RANKS, then MAX_RANKS taken ends
TAKEN = HEADER + 2 * MAX_RANKS  # rank r's taken end: TAKEN + r (rings made before 0.6 have none)
_COUNTERS = {"produced": PRODUCED, "served": SERVED, "computed": COMPUTED, "waited_ns": WAITED_NS,
             "skipped": SKIPPED}
_PROGRESS_BITS = 32  # progress word: epoch << 32 | (k + 1); 0 = the rank never read
READER_LOCKS = 1 << 40  # a reader of rank r holds a lock on byte READER_LOCKS + r of `lock` (format.spec)
WAIT_LOCKS = 1 << 41  # a reader waiting for row s's next value holds byte WAIT_LOCKS + s (format.spec)


def epoch_order(seed: int, epoch: int, length: int) -> np.ndarray:
    """Epoch ``epoch``'s order: the permutation every process computes alike (see ``format.spec``)."""
    return np.random.default_rng([seed, epoch]).permutation(length).astype(np.int64)


class Ring:
    """One process's view of a stream cache's ring: the order, the cursors and counters, producer claims.

    Args:
        store: the open stream cache (``store.store.Store`` of mode ``"stream"``).
    """

    def __init__(self, store: Any) -> None:
        self.store, self.state = store, store.state
        self.size: int = store.length  # N: the dataset, the order's length
        self.split = StreamSplit.from_json(store.meta["stream"].get("split"))
        self.length: int = self.split.positions(self.size)  # M: the sequence positions of an epoch on this node
        self.slots: int = store.slots
        self.seed: int = store.meta["stream"]["seed"]
        access = mmap.ACCESS_WRITE if store.writable else mmap.ACCESS_READ
        try:
            self._map = map_exact(store.path, fmt.RING, 8 * RING_WORDS, access, store.writable)
        except CacheFormatError:
            # A ring made before 0.6 has no taken ends: readers and producers work as they did then.
            if os.path.getsize(os.path.join(store.path, fmt.RING)) != 8 * fmt.RING_WORDS_BEFORE_0_6:
                raise
            self._map = map_exact(store.path, fmt.RING, 8 * fmt.RING_WORDS_BEFORE_0_6, access, store.writable)
        self.words = np.frombuffer(self._map, "<u8")
        self.takes = len(self.words) == RING_WORDS  # whether readers record the positions they take
        # (when, each rank's taken end then, their pace in positions a second): a producer's measure (_reach).
        self._pace: tuple[float, np.ndarray, np.ndarray] = (0.0, np.empty(0, np.int64), np.empty(0))
        self._order: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))
        self.claims = ChunkClaims(store.path, store.state.lock.identity)

    # --- the order --------------------------------------------------------------------------------------------

    def order(self, epoch: int) -> np.ndarray:
        cached = self._order
        if cached[0] != epoch:
            cached = self._order = (epoch, epoch_order(self.seed, epoch, self.size))
        return cached[1]

    def indices_of(self, qs: list[int]) -> list[int]:
        """The source indices at sequence numbers ``qs`` (of any epochs)."""
        epochs, js = np.divmod(np.asarray(qs, np.int64), self.length)
        indices = np.empty(len(js), np.int64)
        for epoch in range(int(epochs.min()), int(epochs.max()) + 1):  # (np.unique's first call imports numpy.ma)
            at = epochs == epoch
            indices[at] = self.order(epoch)[self.split.position(js[at])]
        return indices.tolist()

    def sequence(self, epoch: int, js: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The source indices of sequence positions ``js`` (int64) of ``epoch``, and their sequence numbers (-1 for
        padding, past the node's ``M`` positions: ``DistributedSampler`` takes those from the order's start)."""
        positions = self.split.position(js)
        indices = self.order(epoch)[positions % self.size]
        return indices, np.where(js < self.length, epoch * self.length + js, -1)

    # --- consumers --------------------------------------------------------------------------------------------

    def per_rank(self, ranks: int) -> int:
        """Positions each of the node's ``ranks`` consumers reads per epoch: ``ceil(N / W)``, as
        ``DistributedSampler`` (``W``: the job's ranks, ``ranks`` times the nodes)."""
        return -(-self.size // (ranks * self.split.nodes))

    def progress(self, rank: int) -> tuple[int, int] | None:
        """``(epoch, k)``: rank ``rank`` has consumed its first ``k`` positions of ``epoch``; None if it never read.

        Raises:
            CacheFormatError: the word describes no place in the stream (damage).
        """
        word = int(self.words[HEADER + 2 * rank + 1])
        if word == 0:
            return None
        epoch, k = word >> _PROGRESS_BITS, (word & ((1 << _PROGRESS_BITS) - 1)) - 1
        if not self._is_place(epoch, k):
            raise self._damaged(f"rank {rank}'s progress (epoch {epoch}, position {k}) describes no place in the "
                                f"stream of {self.size} samples")
        return epoch, k

    def _damaged(self, problem: str) -> CacheFormatError:
        directory = self.store.path
        return CacheFormatError(f"{os.path.join(directory, fmt.RING)}: {problem}; the cache is damaged: remove it "
                                f"(`mmapcache rm --force {directory}`) and build it again (`mmapcache verify "
                                f"{directory}` lists the damage)")

    def last_epoch(self) -> int:
        """The last epoch whose sequence numbers (and the next epoch's, where a finished rank's cursor points) fit
        the ring's words and a progress word's epoch bits."""
        return min((1 << _PROGRESS_BITS) - 2, (1 << 63) // max(self.length, 1) - 2)

    def _is_place(self, epoch: int, k: int) -> bool:
        return 0 <= epoch <= self.last_epoch() and 0 <= k <= self.size

    def set_progress(self, rank: int, ranks: int, epoch: int, k: int) -> None:
        """Records that rank ``rank`` of ``ranks`` consumed its first ``k`` positions of ``epoch``; its cursor
        becomes the next sequence number it will read from the ring. Written by that rank alone (aligned 8-byte
        stores: other processes see the old or the new value, never a mix).

        Raises:
            ValueError: ``epoch`` is past ``last_epoch()``, or ``k`` outside the epoch.
        """
        if not self._is_place(epoch, k):
            raise ValueError(f"epoch {epoch}, position {k} is no place in this stream of {self.size} samples "
                             f"(epochs 0 to {self.last_epoch()}, positions 0 to {self.size})")
        position = rank + k * ranks
        cursor = epoch * self.length + position if position < self.length else (epoch + 1) * self.length + rank
        self.words[HEADER + 2 * rank] = cursor + 1
        self.words[HEADER + 2 * rank + 1] = (epoch << _PROGRESS_BITS) | (k + 1)

    def problems(self) -> list[str]:
        """What in the ring's words no reader or producer could have written (for ``verify``): a counter of 2**63
        or more, a rank's cursor without progress, or one that is not a sequence number of the epoch its progress
        names, or the next."""
        found = [f"the counter '{name}' holds {int(self.words[word])}, more than any run could count"
                 for name, word in _COUNTERS.items() if int(self.words[word]) >= 2**63]
        if self.takes:
            if int(self.words[READERS]) > MAX_RANKS:
                found.append(f"it records {int(self.words[READERS])} readers, more than the {MAX_RANKS} it has words "
                             "for")
            ends = self.words[TAKEN:TAKEN + MAX_RANKS]
            if (ends >= 2**63).any():
                rank = int(np.argmax(ends >= 2**63))
                found.append(f"rank {rank}'s taken end is {int(ends[rank])}, past any sequence number")
        n = self.length
        for rank in range(MAX_RANKS):
            cursor, word = int(self.words[HEADER + 2 * rank]), int(self.words[HEADER + 2 * rank + 1])
            if word == 0:
                if cursor:
                    found.append(f"rank {rank} has a cursor ({cursor - 1}) but never read")
                continue
            epoch, k = word >> _PROGRESS_BITS, (word & ((1 << _PROGRESS_BITS) - 1)) - 1
            if not self._is_place(epoch, k) or not epoch * n <= cursor - 1 < (epoch + 2) * n:
                found.append(f"rank {rank}'s cursor {cursor - 1} and progress (epoch {epoch}, position {k}) do not "
                             f"describe a place in the stream of {n} samples")
        return found

    def low(self) -> int:
        """The smallest sequence number a consumer may still read (0 before any consumer started)."""
        cursors = self.words[HEADER:HEADER + 2 * MAX_RANKS:2]
        active = cursors[cursors > 0]
        if not len(active):
            return 0
        low = int(active.min()) - 1
        if low > (self.last_epoch() + 2) * self.length:  # past any sequence number a rank can have read to
            raise self._damaged(f"a reader's cursor ({low}) is past the last epoch's sequence numbers")
        return low

    def count(self, **deltas: int) -> None:
        """Adds to the counters (``served=``, ``computed=``, ``waited_ns=``, ``skipped=``) under the lock."""
        def add() -> None:
            for name, delta in deltas.items():
                if delta:
                    self._add(_COUNTERS[name], delta)
        self.state.under_lock(add)

    def _add(self, word: int, delta: int) -> None:
        """A counter is statistics: one damaged to a value no run could reach (``problems`` reports it) wraps as
        an unsigned word does, instead of raising numpy's overflow warning at a reader."""
        self.words[word] = (int(self.words[word]) + delta) % 2**64

    def stats(self) -> dict[str, int]:
        words = self.words
        low = self.low()
        return {"produced": int(words[PRODUCED]), "served": int(words[SERVED]), "computed": int(words[COMPUTED]),
                "waited_ns": int(words[WAITED_NS]), "skipped": int(words[SKIPPED]), "next": int(words[NEXT]),
                "low": low, "ahead": self.ready_ahead(low), "slots": self.slots}

    def ready_ahead(self, low: int | None = None) -> int:
        """How many positions from ``low`` on are produced and waiting in the ring."""
        low = self.low() if low is None else low
        qs = np.arange(low, low + self.slots, dtype=np.int64)
        return int(self.state.filled_rows(qs % self.slots, qs).sum())

    # --- who computes a position: readers take theirs, producers claim the others --------------------------------

    def start_taking(self, rank: int, ranks: int) -> None:
        """Rank ``rank`` of the node's ``ranks`` readers starts (or starts again, from its cursor): it has taken
        nothing yet. A number of readers other than the one recorded (``READERS``: whose position is which rank's)
        clears every rank's taken end. Safe across processes."""
        if not self.takes:
            return

        def start() -> None:
            if int(self.words[READERS]) != ranks:
                self.words[READERS] = ranks
                self.words[TAKEN:TAKEN + MAX_RANKS] = 0
            self.words[TAKEN + rank] = 0
        self.state.under_lock(start)

    def take(self, rank: int, end: int) -> None:
        """Rank ``rank``'s readers take every position of theirs before sequence number ``end`` that no producer has
        claimed yet: they compute those themselves as they reach them, and no producer claims them (``claim``). A
        reader that computes what it does not find calls it for each batch before reading it (its workers read
        batches ahead of its cursor), under the writer lock, as producers claim: each position is computed by
        whoever comes first, once. Safe across processes."""
        if not self.takes:
            return
        word = TAKEN + rank

        def advance() -> None:
            if end > int(self.words[word]):
                self.words[word] = end
        self.state.under_lock(advance)

    def taken(self, qs: np.ndarray, horizon: float = 0.0) -> np.ndarray:
        """Which of sequence numbers ``qs`` (int64) their rank's readers have taken (``take``), or, with ``horizon``
        seconds, will have reached by then at the pace their taken ends moved lately (``_reach``)."""
        readers = int(self.words[READERS]) if self.takes else 0
        if not 0 < readers <= MAX_RANKS or not len(qs):  # (more is damage, which verify reports)
            return np.zeros(len(qs), bool)
        ends = self._reach(readers, horizon)
        return qs < ends[(qs % self.length) % readers]

    def _reach(self, readers: int, horizon: float) -> np.ndarray:
        """Each rank's taken end, moved on by the positions its readers take in ``horizon`` seconds: the pace of each
        end, measured in this process between its calls (a moving average, so that one batch's step is not
        taken for a speed; 0 until measured, and for readers that wait for producers, which take nothing)."""
        ends = self.words[TAKEN:TAKEN + readers].astype(np.int64)
        now = time.monotonic()
        last, seen, pace = self._pace
        if seen.shape == ends.shape and now > last:
            moved = np.maximum(ends - seen, 0) / (now - last)
            pace = moved if pace.shape != ends.shape else pace + 0.3 * (moved - pace)
        elif pace.shape != ends.shape:
            pace = np.zeros(len(ends))
        self._pace = (now, ends, pace)
        return ends + (pace * horizon).astype(np.int64)

    def claim(self, limit: int = 1, horizon: float = 0.0) -> list[int]:
        """The next sequence numbers to produce, at most ``limit``, each claimed (its row's byte locked) under one
        acquisition of the writer lock: from ``next`` on, at most ``S`` ahead of the slowest consumer, skipping the
        positions their readers have taken (``take``), and those they will have reached in ``horizon`` seconds, the
        caller's time to compute and publish the run: a producer behind its readers works where its values will
        still be read, and its readers do not wait for it. Empty when the ring is full. A position a producer
        claimed and did not publish (it died, its source raised, its value found no heap room) is computed by its
        reader."""
        return self.state.under_lock(lambda: self._claim_locked(limit, horizon))

    def _claim_locked(self, limit: int, horizon: float) -> list[int]:
        if not self.length:  # a node of a job with more ranks than samples: it holds nothing
            return []
        low = self.low()
        first, end = max(int(self.words[NEXT]), low), low + self.slots
        if first >= end:
            return []
        qs = np.arange(first, end, dtype=np.int64)
        free = qs[~self.taken(qs, horizon)]
        claimed: list[int] = []
        if len(free):
            chosen = free[:limit]
            # Runs of consecutive positions whose rows do not wrap: one lock each (a rank's taken positions are
            # every L-th: the others are claimed one at a time).
            cut = np.flatnonzero((np.diff(chosen) != 1) | (chosen[1:] % self.slots == 0)) + 1
            for run in np.split(chosen, cut):
                q, count = int(run[0]), len(run)
                if count > 1 and self.claims.try_claim(q % self.slots, count):
                    claimed += run.tolist()
                    continue
                held = next((k for k in range(count) if not self.claims.try_claim((q + k) % self.slots)), count)
                claimed += run[:held].tolist()
                if held < count:  # a reader testing that row for an instant: claim it next time
                    break
        # Below next now: the claimed positions, and the taken ones before them (their readers' to compute).
        self.words[NEXT] = claimed[-1] + 1 if claimed else (end if not len(free) else int(free[0]))
        return claimed

    def producer_holds(self, q: int) -> bool:
        """Whether a producer holds position ``q``'s claim now (it is computing it, or holding its value for heap
        room): a reader that computes what it does not find waits for it instead of computing it too."""
        if q >= self.low() + self.slots:
            return False  # no producer may claim it yet
        row = q % self.slots
        if not self.claims.try_claim(row):
            return True
        self.claims.release(row)
        return False

    def abandoned(self, q: int) -> bool:
        """Whether position ``q`` was claimed and given up: claimed before (below the next position), not in its
        row, and no producer holds its claim now (one died, or found no heap room for the value). A reader waiting
        for it computes it instead: a producer may never store it. The claim is tested under the writer lock, as
        producers claim (a reader's claims and a producer's are locks of different descriptors, which conflict)."""
        row = q % self.slots

        def check() -> bool:
            if q >= int(self.words[NEXT]) or self.state.filled_rows(np.array([row]), np.array([q]))[0]:
                return False
            if not self.claims.try_claim(row):
                return False
            self.claims.release(row)
            return True
        return bool(self.state.under_lock(check))

    def publish(self, items: list[tuple[int, Any]]) -> tuple[int, list[tuple[int, Any]]]:
        """Stores the values of claimed positions ``items`` (``(q, write)``: ``write(owned)`` writes ``q``'s row)
        under one acquisition of the writer lock, skipping those every consumer has passed, and releases their
        claims. Returns how many it stored, and the items it left for want of heap room (``NoRoom``), still
        claimed: the caller publishes them again once readers have passed more positions (``room_may_come``), or
        gives them up (``release``)."""
        slots = self.slots
        no_room: list[int] = []
        left: list[tuple[int, Any]] = []
        try:
            stored = self.state.publish_many([(q % slots, q, write) for q, write in items], no_room,
                                             wanted=self._unpassed)
            rows = set(no_room)
            left = [(q, write) for q, write in items if q % slots in rows]
            self.count(produced=stored, skipped=len(items) - stored - len(left))
            return stored, left
        finally:
            held = {q for q, _ in left}
            self._release_run([q for q, _ in items if q not in held])

    def passed_rows(self) -> np.ndarray:
        """The rows whose values no reader will read again: written whole (owned), holding positions every
        consumer has passed (below ``low``). A producer that finds no heap room gives their extents back first
        (``RowWriter.passed``): a ring planned from probes smaller than the values that come would otherwise drop
        values while dead ones hold the room. Caller holds the writer lock."""
        low = self.low()
        if not low:
            return np.empty(0, np.int64)
        state = self.state
        return np.flatnonzero(state.owned_mask() & (state.keys_np < low) & state.filled_mask())

    def room_may_come(self, qs: list[int]) -> bool:
        """Whether positions ``qs``, left for want of heap room, may find it later: values of positions before
        them, which readers have not passed, still hold heap room (once every reader has passed the first of them,
        everything before it is given back: a value that still finds no room is larger than what the ring can hold
        next to those after it)."""
        return self.low() < min(qs)

    def wait_for(self, q: int) -> bool:
        """Says, for a reader about to wait for position ``q``, that it waits: producers holding values for want of
        heap room then give that one up (``waited_for``), or all of theirs if no producer has claimed ``q``
        (``waited_past_claims``), as the reader's cursor stays at its batch's start while it
        reads the batch, and the room of the positions it already copied comes back only after it. Returns whether
        to call ``done_waiting(q)`` after; False if another process holds the lock (another reader, or a producer
        testing it for an instant: call again while waiting)."""
        return self.claims.try_claim(WAIT_LOCKS + q % self.slots)

    def done_waiting(self, q: int) -> None:
        self.claims.release(WAIT_LOCKS + q % self.slots)

    def waited_for(self, q: int) -> bool:
        """Whether a reader (another process) waits for position ``q`` (``wait_for``)."""
        return self._waited(q % self.slots, 1)

    def waited_past_claims(self) -> bool:
        """Whether a reader waits for a position no producer has claimed yet (from ``next`` up to ``low + S``): a
        producer holding values for heap room claims no more, and that reader's cursor, and so ``low``, cannot move
        until the position is served."""
        low = self.low()
        first, end = int(self.words[NEXT]), low + self.slots
        if first >= end:
            return False
        row, count = first % self.slots, min(end - first, self.slots)
        head = min(count, self.slots - row)
        return self._waited(row, head) or (count > head and self._waited(0, count - head))

    def _waited(self, row: int, count: int) -> bool:
        """Whether another process holds the wait lock of any of rows ``row .. row + count - 1``."""
        if not self.claims.try_claim(WAIT_LOCKS + row, count):
            return True
        self.claims.release(WAIT_LOCKS + row, count)
        return False

    def publish_rows(self, qs: np.ndarray, write: Any) -> int:
        """``publish`` for a claimed run whose values are a batch's columns (fixed-size fields): ``write(positions)``
        writes the rows of ``qs[positions]``, all in one vectorised publication (``SlotState.publish_rows``).
        Returns how many it stored."""
        try:
            stored = self.state.publish_rows(qs % self.slots, qs, write, wanted=self._unpassed)
            self.count(produced=stored, skipped=len(qs) - stored)
            return stored
        finally:
            self._release_run(qs.tolist())

    def _unpassed(self, qs: np.ndarray) -> np.ndarray:
        """Which of positions ``qs`` a consumer may still read (asked under the writer lock, as they publish)."""
        return qs >= self.low()

    def _release_run(self, qs: list[int]) -> None:
        """Releases the claims of positions ``qs`` (ascending), each stretch of consecutive rows in one call."""
        slots, k = self.slots, 0
        while k < len(qs):
            start = k
            while k + 1 < len(qs) and qs[k + 1] == qs[k] + 1 and (qs[k] + 1) % slots:
                k += 1
            self.claims.release(qs[start] % slots, k - start + 1)
            k += 1

    def publish_created(self, q: int, write: Any) -> None:
        """Stores position ``q < S`` of epoch 0 in row ``q``: the samples the stream's creator computed to learn the
        layout (positions 0, 1, ...). Producers then start after it; a position skipped below (a probe that could
        not be stored) is claimed again as a lost one."""
        self.state.publish(q, q, write)

        def account() -> None:
            self.words[NEXT] = max(int(self.words[NEXT]), q + 1)
            self._add(PRODUCED, 1)
        self.state.under_lock(account)

    def release(self, q: int) -> None:
        """Gives up a claim without publishing (the source raised): a consumer will compute the position."""
        self.claims.release(q % self.slots)

    # --- readers (one process per rank) ---------------------------------------------------------------------------

    def hold_reader(self, rank: int) -> tuple[ChunkClaims | None, int]:
        """Takes rank ``rank``'s reader lock on a descriptor of its own, held until that descriptor is closed
        (``ChunkClaims.close``) or the process ends, whatever other descriptors of the lock file this process opens
        and closes (a ``verify``, another dataset of the path): ``(the claims holding it, 0)``, or ``(None, the pid
        of the process reading that rank)`` (-1 if it cannot be told). Two readers of one rank would each be served
        positions the other was served (each moves the rank's one cursor)."""
        claims = ChunkClaims(self.store.path, self.state.lock.identity)
        if claims.try_claim(READER_LOCKS + rank):
            return claims, 0
        claims.close()
        holders = holders_of(self.store.path, fmt.LOCK, posix_at=READER_LOCKS + rank)
        return None, holders[0] if holders else -1

    def close(self) -> None:
        self.claims.close()
        del self.words
        # Views of the words may still be alive (an exception's traceback holds the frames that took them): the map
        # is then unmapped when the last of them goes, and a close must not replace that exception.
        with contextlib.suppress(BufferError):
            self._map.close()


def producers_of(path: str) -> list[int]:
    """Pids of the producers running for the stream cache at ``path`` (holders of ``producers``)."""
    return holders_of(path, fmt.PRODUCERS)


def register_producer(path: str) -> int:
    """Holds a shared ``flock`` on ``producers`` for this process's life (returns the descriptor to close)."""
    fd = open_file(path, fmt.PRODUCERS, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd
