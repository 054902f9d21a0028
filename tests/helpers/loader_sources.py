"""Sources for ``test_loader.py``: every kind of leaf and container, deterministic, importable by spawned workers."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from helpers.sources import image_of

Record = collections.namedtuple("Record", ["pixels", "score", "flag"])


class Mixed(Dataset):
    """Samples of one of several structures (``kind``), each with values that depend on the index."""

    def __init__(self, n: int = 40, kind: str = "pair", shape: tuple[int, ...] = (3, 8, 8)) -> None:
        self.n, self.kind, self.shape = n, kind, tuple(shape)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        image = image_of(index, self.shape)
        if self.kind == "pair":  # tuple -> collated as a list
            return image, index * 7 % 10
        if self.kind == "dict":
            return {"x": image.numpy(), "weight": index / 8.0, "odd": bool(index % 2),
                    "id": np.int32(index), "mean": np.float64(index) / 3}
        if self.kind == "nested":
            return [Record(image.float() / 255, np.float32(index) / 7, index % 3 == 0),
                    {"half": image.to(torch.bfloat16), "count": torch.tensor(index)}]
        raise ValueError(f"unknown kind {self.kind!r}")
