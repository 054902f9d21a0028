"""Who computes each position of a stream's ring: its readers take theirs (those a reader that computes what it does
not find will compute), producers claim the others and publish them, readers wait for what producers hold, and a
rank's one reader holds its rank. A mixin of ``store.ring.Ring`` (see its module docstring for the protocol).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..format import spec as fmt
from .admin import holders_of
from .lock import ChunkClaims
from .ring_words import MAX_RANKS, NEXT, PRODUCED, READER_LOCKS, READERS, TAKEN, WAIT_LOCKS

__all__ = ["RingClaims"]


class RingClaims:
    """The claims of ``store.ring.Ring``: producers' claims and publications, readers' takes, waits and holds."""

    store: Any
    state: Any
    words: np.ndarray
    claims: ChunkClaims
    slots: int
    length: int
    takes: bool
    _pace: tuple[float, np.ndarray, np.ndarray]

    low: Callable[[], int]  # Ring's: the smallest cursor
    count: Callable[..., None]  # Ring's: adds to the counters
    _add: Callable[[int, int], None]

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

