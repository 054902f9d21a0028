"""The words of a stream's ``ring.u64`` and the bytes of its ``lock`` file that stream readers lock (``format.spec``,
"Stream mode"): shared by the ring's bookkeeping (``store.ring``) and its claims (``store.ring_claims``)."""

from __future__ import annotations

from ..format import spec as fmt

__all__ = ["NEXT", "PRODUCED", "SERVED", "COMPUTED", "WAITED_NS", "SKIPPED", "READERS", "HEADER", "MAX_RANKS",
           "RING_WORDS", "TAKEN", "READER_LOCKS", "WAIT_LOCKS"]

# The header's words; READERS: the number of readers whose taken ends the words after the ranks' pairs hold.
NEXT, PRODUCED, SERVED, COMPUTED, WAITED_NS, SKIPPED, READERS = range(7)
HEADER = 8
MAX_RANKS = 256
RING_WORDS = fmt.RING_WORDS  # HEADER + 2 * MAX_RANKS, then MAX_RANKS taken ends
TAKEN = HEADER + 2 * MAX_RANKS  # rank r's taken end: TAKEN + r (rings made before 0.6 have none)
READER_LOCKS = 1 << 40  # a reader of rank r holds a lock on byte READER_LOCKS + r of `lock` (format.spec)
WAIT_LOCKS = 1 << 41  # a reader waiting for row s's next value holds byte WAIT_LOCKS + s (format.spec)
