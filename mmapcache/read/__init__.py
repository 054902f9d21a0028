"""The warm path: from the shared maps to a training loop.

Owns: copying rows out under the seqlock, one sample or a batch (``reader``, ``ragged``, ``gather``), the collation
of a batch (``collate``; ``heap_batch`` and ``text_collate``: text batches straight from the heaps; ``nested``: a
cache's batch under the samples' nested keys; ``arena``: a worker's batch in one shared-memory storage; ``lending``:
a worker's storages reused once the main process drops them), ``ds.loader()`` and the order of its batches, split
across ranks and resumable (``loader``, ``order``, ``draws``, ``epoch_split``, ``loader_state``: a loader's state,
and ``resume``: what an epoch's order was drawn from), per-sample lengths (``lengths``), ``ds.sampler()`` over node
shares (``sampler``), mixtures (``mix_order``, ``mix_batches``, ``mix_loader``, ``mix_state``), and reading a stream
(``stream``; ``stream_loader``: its ``ds.loader()``; ``stream_place``: a reader's place in the job and its node).

Imports: ``mmapcache.store``, ``mmapcache.format``, ``mmapcache.errors``; torch.
"""
