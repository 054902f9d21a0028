"""The benchmark's groups, one module each (``--only NAME``), registered in ``benchmark.run.GROUPS``.

``fixed`` (``images12k``, ``images150k``, ``tabular``, ``dict``), ``tokens``, ``captions``, ``text`` (its corpus in
``text_corpus``, what a side is in ``text_reader``, its sides in ``text_sides``),
``stream``, ``streamnodes``, ``nodeshare``, ``stocaching``, ``memory``, ``build``, ``waysin``, ``lock``,
``features``. Each module has a ``run_...(cfg, results)`` function that builds its data in its own ``workspace``
and records its rows and targets.
"""
