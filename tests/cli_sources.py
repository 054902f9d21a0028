"""Factories used as ``tests/cli_sources.py:name`` dataset specs by the CLI and build tests."""

from __future__ import annotations

import os
import time
from typing import Any

from torch.utils.data import Dataset

from sources import Counting, ImageLabels


def images(n: int = 64, log: str | None = None, delay: float = 0.0, shape: list[int] | None = None) -> Dataset:
    """``ImageLabels(n)``; with ``log``, every source call appends its index to that file."""
    source = ImageLabels(n, tuple(shape or (3, 8, 8)), delay)
    return Counting(source, log) if log else source


class Failing(Dataset):
    """``ImageLabels`` whose samples in ``bad`` raise ``ValueError``."""

    def __init__(self, n: int = 32, bad: list[int] | None = None) -> None:
        self.inner, self.bad = ImageLabels(n), set(bad or [])

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        if index in self.bad:
            raise ValueError(f"corrupt image file for sample {index}")
        return self.inner[index]


class Drifting(Dataset):
    """Samples that change with a counter file: ``version`` is added to every label (to see refills)."""

    def __init__(self, n: int = 16, version_file: str = "") -> None:
        self.inner, self.version_file = ImageLabels(n), version_file

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        with open(self.version_file) as f:
            version = int(f.read() or 0)
        image, label = self.inner[index]
        return image, label + 100 * version


def not_a_dataset() -> int:
    return 42


def broken_factory() -> Dataset:
    raise RuntimeError("the data root /nonexistent does not exist")


def empty() -> list[Any]:
    return []


def slow(n: int = 64, log: str | None = None, delay: float = 0.02) -> Dataset:
    return images(n, log, delay)


_ = (os, time)
