"""The warm path: from the shared maps to a training loop.

Owns: copying rows out under the seqlock, one sample or a batch (``reader``, ``ragged``, ``gather``), the
collation of a batch (``collate``), ``ds.loader()`` and the order of its batches, split across ranks and resumable
(``loader``, ``order``, ``loader_state``: a loader's state, and ``resume``: what an epoch's order was drawn
from), ``ds.sampler()`` over node shares (``sampler``), and reading a stream (``stream``; ``stream_loader``: its
``ds.loader()``; ``stream_place``: a reader's place in the job and its node).

Imports: ``mmapcache.store``, ``mmapcache.format``, ``mmapcache.errors``; torch.
"""
