"""Looking at caches from the outside: ``verify`` (damage, and stored samples against the source) and ``describe``
/ ``list_caches`` (what ``mmapcache inspect`` and ``ls`` show).

Imports: every layer below (``fill`` for dataset specs, ``read`` to read rows, ``store``, ``format``).
"""
