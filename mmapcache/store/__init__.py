"""A cache's files and their shared state: everything that makes one directory on tmpfs a cache that many processes
read and write at once.

Owns: where caches live (``paths``), opening their files safely and ``meta.json``'s I/O (``files``), atomic
creation and space (``create``), the filled and stale bits, seqlocks, keys, the writer lock and claims (``state``),
ragged fields' heaps (``heap``), mapping a cache (``store``), the one writer of a row's bytes (``writer``), index ->
slot -> row (``rows``), where a process is in a job and node shares (``share``), a stream's ring (``ring``: its order,
cursors and counters; ``ring_claims``: who computes each position; ``ring_words``: its words) and which positions a
node's ring holds in a job of several nodes (``split``), and removal, users and leftovers (``admin``).

Imports: ``mmapcache.format``, ``mmapcache.errors``; numpy. Never torch, so ``mmapcache inspect`` starts fast.
"""
