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
from typing import Any

import numpy as np

from ..errors import CacheFormatError
from ..format import spec as fmt
from .admin import holders_of
from .files import open_file
from .lock import ChunkClaims
from .ring_claims import RingClaims
from .ring_words import (
    COMPUTED,
    HEADER,
    MAX_RANKS,
    NEXT,
    PRODUCED,
    READERS,
    RING_WORDS,
    SERVED,
    SKIPPED,
    TAKEN,
    WAITED_NS,
)
from .split import StreamSplit
from .state import map_exact

__all__ = ["Ring", "RING_WORDS", "MAX_RANKS", "epoch_order", "producers_of", "register_producer"]

_COUNTERS = {"produced": PRODUCED, "served": SERVED, "computed": COMPUTED, "waited_ns": WAITED_NS,
             "skipped": SKIPPED}
_PROGRESS_BITS = 32  # progress word: epoch << 32 | (k + 1); 0 = the rank never read


def epoch_order(seed: int, epoch: int, length: int) -> np.ndarray:
    """Epoch ``epoch``'s order: the permutation every process computes alike (see ``format.spec``)."""
    return np.random.default_rng([seed, epoch]).permutation(length).astype(np.int64)


class Ring(RingClaims):
    """One process's view of a stream cache's ring: the order, the cursors and counters; who computes each position
    is its mixin's (``store.ring_claims``).

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

    def readers(self) -> int:
        """How many ranks read this node's ring, as its readers recorded it when they started (0: none has). A ring
        made before 0.6 records no number: the highest rank that read it, plus one (at least that many did)."""
        if self.takes and int(self.words[READERS]):
            return int(self.words[READERS])
        read = np.flatnonzero(self.words[HEADER + 1:HEADER + 2 * MAX_RANKS:2])
        return int(read[-1]) + 1 if len(read) else 0

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
