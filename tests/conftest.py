"""Shared fixtures: every test gets its own cache directory on the real /dev/shm, removed afterwards."""

from __future__ import annotations

import compileall
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

SHM = "/dev/shm"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config: pytest.Config) -> None:
    """Compiles the package, tests, examples and tools to bytecode once, where Python itself would not: under
    ``PYTHONDONTWRITEBYTECODE`` (set on CI images) each of the 250 or so interpreters the suite starts compiled
    them from source again, 0.22 CPU-seconds each on the suite's 2-core machine."""
    if sys.dont_write_bytecode and not hasattr(config, "workerinput"):  # once, in pytest's own process
        for folder in ("mmapcache", "tests", "examples", "tools"):
            compileall.compile_dir(os.path.join(ROOT, folder), quiet=2)


@pytest.fixture
def shm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh directory on /dev/shm (tmpfs, where users put caches), also set as ``MMAPCACHE_DIR``."""
    path = os.path.join(SHM, f"mmapcache-test-{uuid.uuid4().hex[:12]}")
    os.makedirs(path)
    monkeypatch.setenv("MMAPCACHE_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def cache_path(shm_dir: str) -> str:
    """A path for a new cache (not yet created) inside ``shm_dir``."""
    return os.path.join(shm_dir, "cache")


@pytest.fixture
def untouched(shm_dir: str) -> Iterator[Callable[..., None]]:
    """Runs a call that must raise, then checks the cache directory's parent gained no entry."""

    def check(exc: type[BaseException], match: str, make: Callable[[], Any]) -> None:
        before = sorted(os.listdir(shm_dir))
        with pytest.raises(exc, match=match):
            make()
        assert sorted(os.listdir(shm_dir)) == before, "a failed call left files behind"

    yield check
