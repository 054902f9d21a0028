"""Test helpers: source datasets, process bodies and the process runner, importable by spawned processes.

The ``tests`` directory is on ``sys.path`` (pytest's rootdir import mode, and ``PYTHONPATH`` for the child
processes the tests start), so everything here is ``helpers.<module>``.
"""
