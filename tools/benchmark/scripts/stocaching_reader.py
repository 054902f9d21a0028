"""The stocaching rows of ``tools/bench.py``, run in its own virtual environment (stocaching needs numpy < 2).

Usage: ``python tools/benchmark/scripts/stocaching_reader.py IMAGES.npy LABELS.npy BATCH EPOCHS WORKERS...``;
prints one JSON object, ``{"nw0": samples_per_s, ...}``, on its last line of output. The cache is filled by a first
epoch in the main process; the best of ``EPOCHS`` warm, shuffled epochs with default collation is reported.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

import numpy as np
import torch
from stocaching import SharedCache
from torch.utils.data import DataLoader, Dataset


class Cached(Dataset):
    """The usage pattern of stocaching's README: get_slot, else load and set_slot."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels
        size_gib = math.ceil((images.nbytes + len(images)) / 1024**3) + 1
        self.cache = SharedCache(size_limit_gib=size_gib, dataset_len=len(images), data_dims=images.shape[1:],
                                 dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> Any:
        x = self.cache.get_slot(index)
        if x is None:
            x = torch.from_numpy(np.array(self.images[index]))
            self.cache.set_slot(index, x)
        return x, int(self.labels[index])


def main(argv: list[str]) -> None:
    images = np.load(argv[0], mmap_mode="r")
    labels = np.load(argv[1])
    batch, epochs = int(argv[2]), int(argv[3])
    ds = Cached(images, labels)
    for _ in DataLoader(ds, batch_size=batch):  # fill
        pass
    result = {}
    for workers in (int(w) for w in argv[4:]):
        loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=workers > 0)
        best = 0.0
        for _ in range(epochs):
            start = time.perf_counter()
            for _ in loader:
                pass
            best = max(best, len(ds) / (time.perf_counter() - start))
        result[f"nw{workers}"] = best
        del loader
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
