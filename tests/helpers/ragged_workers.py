"""Processes for the ragged rewrite race test: writers rewrite values of changing lengths, readers check them."""

from __future__ import annotations

import random
import time
from typing import Any

import torch
from torch.utils.data import Dataset

from mmapcache import MmapCachedDataset


class RaggedVersioned(Dataset):
    """Sample ``i`` at version ``v``: ``(i * 1_000_000 + v)`` repeated ``1 + v % 37`` times, plus a str of the same
    tag, so a value torn between two versions (bytes or length) fails ``check``."""

    def __init__(self, n: int, base: int = 0) -> None:
        self.n, self.base, self.calls = n, base, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        self.calls += 1
        version = self.base + self.calls
        tag = i * 1_000_000 + version % 1_000_000
        return {"values": torch.full((1 + version % 37,), tag, dtype=torch.int64), "tag": f"{tag}:" * (version % 5)}


def check(sample: Any, index: int) -> bool:
    values, text = sample["values"], sample["tag"]
    tag = int(values[0])
    version = tag % 1_000_000
    return (tag // 1_000_000 == index and len(values) == 1 + version % 37 and bool((values == tag).all())
            and text == f"{tag}:" * (version % 5))


def ragged_rewrite_loop(path: str, n: int, worker: int, seconds: float, result: Any) -> None:
    ds = MmapCachedDataset(path, RaggedVersioned(n, base=100_000 * (worker + 1)), stale="serve", deterministic=False,
                           ragged=["values"])
    rng = random.Random(worker)
    stored, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        indices = rng.sample(range(n), 2)
        ds.refresh(indices=indices)
        stored += ds.fill(indices)
    ds.close()
    result.put(("writer", stored, 0))


def ragged_check_loop(path: str, n: int, worker: int, seconds: float, result: Any) -> None:
    ds = MmapCachedDataset(path, RaggedVersioned(n, base=500_000 + 100_000 * worker), stale="serve",
                           deterministic=False)
    rng = random.Random(100 + worker)
    checks = torn = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if rng.random() < 0.5:
            i = rng.randrange(n)
            pairs = [(i, ds[i])]
        else:
            batch = [rng.randrange(n) for _ in range(8)]
            pairs = list(zip(batch, ds.__getitems__(batch)))
        for i, sample in pairs:
            checks += 1
            torn += not check(sample, i)
    ds.close()
    result.put(("reader", checks, torn))
