"""A ragged 2-D field's index row with a dimension of 2**62: np.prod of the shape overflows int64, the batch path
(gather_ragged) takes the row for valid, and ds.__getitems__ raises a raw ValueError (cannot reshape)."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
from _common import scratch, verdict, words
from torch.utils.data import Dataset

from mmapcache import CacheFormatError, MmapCachedDataset


class Boxes(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        return np.arange(4 * (i % 3 + 1), dtype=np.float32).reshape(-1, 4), i


def main() -> int:
    with scratch() as path:
        with MmapCachedDataset(path, Boxes(), ragged=["0"]) as ds:
            ds.fill()
        index = words(os.path.join(path, "0.index.npy"))  # [offset, extent, rows, 4]
        index[1, 3] = 2**62
        index.flush()
        try:
            with MmapCachedDataset(path) as ds:
                ds.__getitems__(list(range(8)))
            error: Exception | None = None
        except Exception as exc:
            error = exc
        print(f"__getitems__: {type(error).__name__ if error else 'no error'}: {error}")
        return verdict(error is not None and not isinstance(error, CacheFormatError), "damage: CacheFormatError")


if __name__ == "__main__":
    sys.exit(main())
