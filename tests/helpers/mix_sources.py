"""Sources for the mixture tests: every sample says which source and index it is (``id = tag * 1000 + i``), in every
field, so a batch read from a mixture is checked against its sources value by value."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

STRIDE = 1000  # ids: tag * STRIDE + index


class Rows(Dataset):
    """``(4 floats, label)``, both the sample's id."""

    def __init__(self, n: int, tag: int, width: int = 4) -> None:
        self.n, self.tag, self.width = n, tag, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        ident = self.tag * STRIDE + i
        return torch.full((self.width,), float(ident)), ident


class Texts(Dataset):
    """``{"input_ids": int64 of 1 + (i * 7) % lengths tokens, "label": int}``, all the sample's id."""

    def __init__(self, n: int, tag: int, lengths: int = 13) -> None:
        self.n, self.tag, self.lengths = n, tag, lengths

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        ident = self.tag * STRIDE + i
        return {"input_ids": torch.full((1 + (i * 7) % self.lengths,), ident, dtype=torch.int64), "label": ident}


def ids_of(batch: Any) -> list[int]:
    """The ids of a batch of ``Rows`` (a tuple) or ``Texts`` (a dict)."""
    labels = batch["label"] if isinstance(batch, dict) else batch[1]
    return labels.tolist()


def rows_intact(batch: Any) -> bool:
    """Whether every field of a ``Rows`` batch holds its sample's id."""
    x, labels = batch
    return bool((x == labels[:, None].to(x.dtype)).all())
