"""A max_shapes field's stored shape beyond its maximum (shape file row (3, 2) -> (3, 4), max (5, 2)): verify()
records the problem, then crashes reading the row (raw ValueError: cannot reshape) instead of returning it."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
from _common import scratch, verdict, words
from torch.utils.data import Dataset

import mmapcache
from mmapcache import CacheFormatError, MmapCachedDataset


class Points(Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        return np.ones((i % 5, 2), np.float32) * i, i


def main() -> int:
    with scratch() as path:
        with MmapCachedDataset(path, Points(), max_shapes={"0": (5, 2)}) as ds:
            ds.fill()
        shapes = words(os.path.join(path, "0.shape.npy"))
        shapes[3] = (3, 4)
        shapes.flush()
        outcomes, bug = [], False
        for what, call in [("verify", lambda: mmapcache.verify(path, Points(), samples=None)),
                           ("ds[3]", lambda: MmapCachedDataset(path)[3])]:
            try:
                call()
                outcomes.append(f"{what}: no error")
            except Exception as exc:
                outcomes.append(f"{what}: {type(exc).__name__}: {exc}")
                bug |= not isinstance(exc, CacheFormatError)
        print("; ".join(outcomes))
        return verdict(bug, "a stored shape past the maximum is damage: reported, or CacheFormatError")


if __name__ == "__main__":
    sys.exit(main())
