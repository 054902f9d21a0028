"""ARGUABLE (the fuzzer's oracle allows CacheMismatchError for meta.json edits only): damage to a stored sample that
an opener without a fingerprint compares (row 0's bytes, or a max_shapes field's stored shape set to -1, which no
writer can produce) is reported as CacheMismatchError ("made from a different source ... pass overwrite=True"),
not as damage (CacheFormatError naming the file, as verify reports it)."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
from _common import scratch, verdict, words
from torch.utils.data import Dataset

from mmapcache import CacheFormatError, CacheMismatchError, MmapCachedDataset


class Points(Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        return np.ones((i % 5 + 1, 2), np.float32) * i, i


def main() -> int:
    with scratch() as path:
        with MmapCachedDataset(path, Points(), max_shapes={"0": (5, 2)}) as ds:
            ds.fill()
        shapes = words(os.path.join(path, "0.shape.npy"))
        shapes[0, 0] = -1
        shapes.flush()
        try:
            MmapCachedDataset(path, Points(), max_shapes={"0": (5, 2)}).close()
            error: Exception | None = None
        except (CacheFormatError, CacheMismatchError) as exc:
            error = exc
        print(f"open: {type(error).__name__ if error else 'no error'}: {str(error)[:160]}")
        return verdict(isinstance(error, CacheMismatchError), "a stored shape of -1 is damage, not another source")


if __name__ == "__main__":
    sys.exit(main())
