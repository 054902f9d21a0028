"""Work done once per test run and shared by pytest-xdist's workers (a module- or session-scoped fixture runs once
per worker, and worksteal may hand the tests of one module to both)."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def once_per_run(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The directory ``name`` of this test run, where ``make(directory)`` ran once: the first worker to ask runs it
    (the others wait on a lock); a ``make`` that raised is run again, in an empty directory, by the next to ask."""
    base = factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's, shared by its workers
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a make that raised left
            folder.mkdir()
            make(folder)
            done.touch()
    return folder
