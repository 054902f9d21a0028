"""Computing what a cache lacks and storing it: misses, creation, builds, prefill and stream producers.

Owns: a cache's misses, one sample or a batch (``misses``), the open-or-create protocol and the identity check
(``open``), creating a cache with its first sample and layout probes (``create``), validated creation options
(``options``), the dataset's cache-content methods (``contents``: ``fill``, ``refresh``, ``missing_indices``...)
and ``prefill`` (``prefill``), ``build`` with its driver and worker processes (``build``, ``driver``,
``workers``), dataset specs (``specs``), a stream's producers and controls (``producer``, ``stream``), and child
processes that die with their parent (``parent``).

Imports: ``mmapcache.read``, ``mmapcache.store``, ``mmapcache.format``, ``mmapcache.errors``.
"""
