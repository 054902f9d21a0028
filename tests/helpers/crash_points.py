"""Kills aimed at a window between two stores: a writer process that SIGKILLs itself right after a chosen store to
its heaps' counters, for the crash-consistency tests (``tests/test_crash_windows.py``).

A heap's counters (``heaps.u64``, ``store.heap``) are changed by stores into the mapped words (through numpy,
``counters``, or a memoryview, ``words``); a change of several words (a free list's head and the free counter, a
sweep's lists and counters) can be cut between any two of them by a kill. ``KillAfter`` stands in for both views: it
forwards every read and store to the real words and, after the ``n``-th store to a word of the chosen kind through
either, kills its own process, so the kill lands in that window on purpose, not by the luck of a timer.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mmapcache import MmapCachedDataset
from mmapcache.store.heap import ABANDONED, CAPACITY, END, FREE, HEADS

# The kinds of counter word a kill may follow: which words a store to ``key`` touches.
WORDS = {"heads": range(HEADS, 1 << 20), "free": range(FREE, FREE + 1), "end": range(END, END + 1),
         "abandoned": range(ABANDONED, ABANDONED + 1), "capacity": range(CAPACITY, CAPACITY + 1)}


class Countdown:
    """The stores to words of ``kind`` left before this process kills itself (shared by a heap's two views of its
    counters: ``counters``, numpy, and ``words``, a memoryview of the same words)."""

    def __init__(self, kind: str, n: int) -> None:
        self.kind, self.left = WORDS[kind], n

    def stored(self, touched: Any) -> None:
        if any(word in self.kind for word in touched):
            self.left -= 1
            if not self.left:
                os.kill(os.getpid(), signal.SIGKILL)


class KillAfter:
    """A view of a heap's counters that kills this process right after the countdown's last store."""

    def __init__(self, words: Any, countdown: Countdown) -> None:
        self.words, self.countdown = words, countdown

    def __getitem__(self, key: Any) -> Any:
        return self.words[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.words[key] = value
        self.countdown.stored(range(len(self.words))[key] if isinstance(key, slice) else [int(key)])

    def __len__(self) -> int:
        return len(self.words)


class Resized(Dataset):
    """``n`` samples ``i`` of 4..300 int64s, all equal to ``i``, a new size drawn at every computation (a rewrite
    moves values between extents of every size)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.rng = n, np.random.default_rng(seed)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((int(self.rng.integers(4, 300)),), i, dtype=torch.int64)


def open_resized(path: str, n: int, seed: int) -> MmapCachedDataset:
    """The rewritten cache: a heap budget about 1.35x its live values, so that rewrites split extents and sweep."""
    return MmapCachedDataset(path, Resized(n, seed), deterministic=False, ragged=["<sample>"], max_bytes=330_000)


def rewrite_until_killed(path: str, n: int, seed: int, kind: str, stores: int, rounds: int) -> None:
    """Refreshes half of the cache's rows and fills them again, ``rounds`` times, its heaps' counters killing this
    process right after the ``stores``-th store to a word of ``kind``; exits 0 if no such store came."""
    import warnings

    from mmapcache import UncachedFieldWarning

    warnings.simplefilter("ignore", UncachedFieldWarning)
    ds = open_resized(path, n, seed)
    for heap in ds._store.heaps:
        if heap is not None:
            countdown = Countdown(kind, stores)
            heap.counters = KillAfter(heap.counters, countdown)  # type: ignore[assignment]
            heap.words = KillAfter(heap.words, countdown)  # type: ignore[assignment]
    for _ in range(rounds):
        ds.refresh(fraction=0.5)
        ds.fill()
    ds.close()
