"""Shared by the fuzzer's reproductions (each script is otherwise standalone): tiny deterministic sources and a
scratch cache on /dev/shm. Run a reproduction with the checkout to test first on the path:
``PYTHONPATH=/path/to/checkout python3 tests/fuzz_repros/<script>.py``; it exits 1 while the bug is there."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


class Images(Dataset):
    """(uint8 image (3, 4, 4), int label)."""

    def __init__(self, n: int = 13) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.full((3, 4, 4), i, dtype=torch.uint8), i


class Texts(Dataset):
    """{"caption": str, "tokens": int64 tensor of varying length}; ``version`` changes every length."""

    def __init__(self, n: int = 12, version: int = 1) -> None:
        self.n, self.version = n, version

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        length = (7 * i + 13 * self.version) % 30 + 1
        return {"caption": f"#{i} " + "é" * length, "tokens": torch.arange(length, dtype=torch.int64) + i}


class Tokens(Dataset):
    """Stream samples: {"x": int64 tensor, "i": index}."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return {"x": torch.arange(6, dtype=torch.int64) * 1_000_003 + i, "i": i}


@contextlib.contextmanager
def scratch() -> Iterator[str]:
    """A path for a new cache in a fresh directory on /dev/shm, removed afterwards."""
    parent = tempfile.mkdtemp(dir="/dev/shm", prefix="fuzz-repro-")
    try:
        yield os.path.join(parent, "cache")
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def texts_cache(path: str) -> None:
    """A ragged cache whose heaps have free lists: filled with version 0, then every row rewritten as version 1."""
    from mmapcache import MmapCachedDataset

    with MmapCachedDataset(path, Texts(version=0), ragged=["tokens"], fingerprint="t") as ds:
        ds.fill(range(10))
    with MmapCachedDataset(path, Texts(version=1), ragged=["tokens"], fingerprint="t") as ds:
        ds.refresh(indices=range(10))
        ds.fill(range(10))


def words(path: str, dtype: str = "<i8") -> np.ndarray:
    """A writable view of a file's words (an .npy file's data, past its header)."""
    if path.endswith(".npy"):
        return np.load(path, mmap_mode="r+")
    return np.memmap(path, dtype, mode="r+")


def heap_block(path: str, field: int) -> np.ndarray:
    """The ``heaps.u64`` block (counters, then free-list heads) of ragged field number ``field``."""
    from mmapcache import _heap

    return words(os.path.join(path, "heaps.u64"), "<u8").reshape(-1, _heap.BLOCK)[field]


def verdict(bug: bool, message: str) -> int:
    print(("BUG: " if bug else "ok: ") + message)
    return 1 if bug else 0
