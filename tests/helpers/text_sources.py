"""Text samples as Hugging Face gives them, for the text tests: ``{"input_ids", "attention_mask", "text", "label"}``,
token ids of a seeded length each (so a batch's values can be checked against the source's)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


class Tokenized(Dataset):
    """Sample ``i``: ``input_ids`` int64 of 1..``longest`` tokens (``i * 1000 + position``, so any token says where it
    came from), an all-ones ``attention_mask``, a ``text`` str of 4 characters a token and a ``label``."""

    def __init__(self, n: int, longest: int = 60, seed: int = 0, mask: bool = True) -> None:
        self.n, self.mask = n, mask
        self.lengths = np.random.default_rng(seed).integers(1, longest + 1, n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        length = int(self.lengths[i])
        sample: dict[str, Any] = {"input_ids": torch.arange(length, dtype=torch.int64) + i * 1000}
        if self.mask:
            sample["attention_mask"] = torch.ones(length, dtype=torch.int64)
        sample["text"] = "tok " * length
        sample["label"] = i % 7
        return sample


def expected_padded(samples: list[dict[str, Any]], pad: int = 0, labels: bool = False) -> dict[str, Any]:
    """What a padded batch of ``samples`` must be, written out plainly."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(samples), width), dtype=torch.int64)
    for k, s in enumerate(samples):
        ids[k, :len(s["input_ids"])] = s["input_ids"]
        mask[k, :len(s["input_ids"])] = 1
    # (the class label comes back as labels, as Hugging Face's collators return it, unless labels are made)
    out = {"input_ids": ids, "attention_mask": mask, "text": [s["text"] for s in samples],
           "label" if labels else "labels": torch.tensor([s["label"] for s in samples])}
    if labels:
        out["labels"] = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Exact equality of two batches: the same keys, tensors of the same dtype, shape and values."""
    if set(a) != set(b):
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(other, torch.Tensor) or value.dtype != other.dtype or not torch.equal(value, other):
                return False
        elif value != other:
            return False
    return True
