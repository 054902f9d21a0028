"""A rotating node share's keys.i64: a row's key set to the index another generation keeps in the same slot makes
that generation read the row as its sample: ds[i] serves another index's sample, and verify(path, source,
samples=None) reports the cache ok (keys of rotating shares are not checked, and rows are compared with slot
indices of generation 0)."""

from __future__ import annotations

import os
import sys

import torch
from _common import Images, scratch, verdict, words

import mmapcache
from mmapcache import MmapCachedDataset


def main() -> int:
    with scratch() as path:
        with MmapCachedDataset(path, Images(20), node_share=(1, 3), rotate_every=1, fingerprint="s") as ds:
            ds.fill()
            first = ds.cacheable_indices().tolist()
            ds.set_epoch(1)
            second = ds.cacheable_indices().tolist()
        slot = next(s for s in range(len(first)) if first[s] != second[s])
        keys = words(os.path.join(path, "keys.i64"))
        keys[slot] = second[slot]
        keys.flush()
        with MmapCachedDataset(path) as ds:
            ds.set_epoch(1)
            image, label = ds[second[slot]]
        wrong = label != second[slot] or not torch.equal(image, Images(20)[second[slot]][0])
        result = mmapcache.verify(path, Images(20), samples=None)
        print(f"ds[{second[slot]}] in epoch 1 served label {label}; verify ok: {result.ok}")
        return verdict(wrong and result.ok, "a wrong sample served while verify reports the cache ok")


if __name__ == "__main__":
    sys.exit(main())
