"""The units of work that sides in several groups time: an epoch over a loader, and the raw gather (what a
cache's memory gives with no code of ours: the limit the loaders are held against)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from mmapcache import MmapCachedDataset


def epoch(loader: Iterable[Any]) -> Callable[[], None]:
    """One pass over ``loader`` (a warm epoch; the loader and its workers persist between passes)."""
    def run() -> None:
        for _ in loader:
            pass
    return run


def raw_gather(ds: MmapCachedDataset, n: int, batch: int, buffers: int = 1) -> Callable[[], None]:
    """An epoch of the raw limit: per batch, the sorted shuffled rows taken with ``np.take`` per field into
    preallocated buffers, straight from the cache's own ``.npy`` memmaps.

    With ``buffers=2`` the batches alternate between two sets of buffers, as any loader's must while the loop
    still holds the previous batch: a batch of several MB then no longer stays in the CPU's caches between uses.
    """
    arrays = [np.asarray(np.load(os.path.join(ds.path, spec["file"]), mmap_mode="r"))[:n]
              for spec in ds._store.meta["fields"]]
    sets = [[np.empty((batch, *a.shape[1:]), a.dtype) for a in arrays] for _ in range(buffers)]
    rng = np.random.default_rng(1)

    def run() -> None:
        perm = rng.permutation(n)
        for j, k in enumerate(range(0, n, batch)):
            rows = np.sort(perm[k:k + batch])
            for a, out in zip(arrays, sets[j % buffers]):
                np.take(a, rows, axis=0, out=out[:len(rows)], mode="clip")
    return run
