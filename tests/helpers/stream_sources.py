"""Sources for stream tests: every computation of a sample is unique and self-checking.

``Fresh(n)[i]`` returns ``{"x": int64 tensor of 16 copies of a token, "i": i, "token": token}`` where the token is
random per call: a value served twice, or torn between two computations, shows (its tokens repeat, or ``x`` and
``token`` disagree). ``delay`` seconds of busy work per sample imitate an augmentation.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch.utils.data import Dataset


class Fresh(Dataset):
    def __init__(self, n: int = 200, delay: float = 0.0, width: int = 16) -> None:
        self.n, self.delay, self.width = n, delay, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if self.delay:
            end = time.perf_counter() + self.delay
            while time.perf_counter() < end:
                pass
        token = int.from_bytes(os.urandom(7), "little")
        return {"x": torch.full((self.width,), token, dtype=torch.int64), "i": index, "token": token}


class Growing(Fresh):
    """``Fresh`` whose ``x`` grows with the index (``base + 37 * i`` elements): a ragged field whose values outgrow
    the extents of the rows they are written into."""

    def __init__(self, n: int = 32, base: int = 20_000) -> None:
        super().__init__(n)
        self.base = base

    def __getitem__(self, index: int) -> Any:
        token = int.from_bytes(os.urandom(7), "little")
        return {"x": torch.full((self.base + 37 * index,), token, dtype=torch.int64), "i": index, "token": token}


def fresh(n: int = 200, delay: float = 0.0) -> Dataset:
    return Fresh(n, delay)


def intact(batch: dict[str, Any]) -> bool:
    """Every sample of a collated batch is one computation (``x`` holds its token)."""
    return bool((batch["x"] == batch["token"][:, None]).all())
