"""Source datasets for the tests: deterministic, picklable, importable by spawned processes."""

from __future__ import annotations

import collections
import os
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

Pair = collections.namedtuple("Pair", ["image", "label"])


def image_of(index: int, shape: tuple[int, ...] = (3, 8, 8)) -> torch.Tensor:
    """A deterministic uint8 image whose every byte depends on the index (so torn rows are detectable)."""
    g = torch.Generator().manual_seed(index)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


class ImageLabels(Dataset):
    """``(uint8 image, int label)`` pairs; ``delay`` seconds of sleep per sample imitate slow decoding."""

    def __init__(self, n: int = 64, shape: tuple[int, ...] = (3, 8, 8), delay: float = 0.0) -> None:
        self.n, self.shape, self.delay = n, tuple(shape), delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if self.delay:
            time.sleep(self.delay)
        return image_of(index, self.shape), index * 7 % 10


class Counting(Dataset):
    """Wraps a dataset and appends each computed index to a file (counts source calls across processes)."""

    def __init__(self, inner: Dataset, log: str) -> None:
        self.inner, self.log = inner, log

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        with open(self.log, "a") as f:
            f.write(f"{index}\n")
        return self.inner[index]

    def calls(self) -> list[int]:
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return [int(line) for line in f]


def sample_equal(a: Any, b: Any) -> bool:
    """Exact equality of two samples: same structure, same types, same dtypes, same bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(
            (a.contiguous().view(torch.uint8) == b.contiguous().view(torch.uint8)).all()
        ) if a.numel() else a.dtype == b.dtype and a.shape == b.shape
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(sample_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(sample_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    return a == b


class Scaled(Dataset):
    """``(float image * scale, label)``: the same indices and layout for every ``scale``, other values (a source
    whose preprocessing changed)."""

    def __init__(self, n: int = 16, scale: float = 1.0, log: str | None = None) -> None:
        self.n, self.scale, self.log = n, scale, log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{index}\n")
        return image_of(index).float() * self.scale, index % 10


class Numbered(Dataset):
    """Sample ``i``: 4 floats from ``i`` and the label ``i`` (so a batch says which samples it holds)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((4,), float(i)) / self.n, i
