"""The mmapcache benchmark, run by ``tools/bench.py``: shared infrastructure here, one module per group in ``groups``.

Modules (``tools/README.md`` says the same with what each group measures):

- ``run``: the command line, the registry of groups (``GROUPS``, ``ON_REQUEST``) and one run of them.
- ``core``: interleaved timing (``interleave``, ``Side``, ``Timed``), ``Config`` and ``Results`` (rows, targets).
- ``targets``: the project's targets, by key; ``report``: summaries over runs, ``results.{json,md,png}``.
- ``workloads``: what each workload's samples are and their data on ``/dev/shm``; ``sources``: the source
  datasets and process bodies (importable by workers and by ``mmapcache build --dataset FILE:NAME``).
- ``epochs``: the units of work several groups time (an epoch over a loader, the raw gather).
- ``paths``: where the package, the repository and the scripts are.
- ``groups``: a module per group; ``scripts``: programs other interpreters start by path.

Importing this package imports nothing: a script started by path (``scripts/``) pays only for what it uses.
"""
