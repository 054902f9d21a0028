"""changes.u64's count of complete rows set to ``rows`` on a cache that is not full: the warm batch path trusts it,
skips the per-row checks, and serves unfilled rows as zeros, while verify(path, source, samples=None) reports
the cache ok (a silent wrong answer)."""

from __future__ import annotations

import os
import sys

import torch
from _common import Images, scratch, verdict, words

import mmapcache
from mmapcache import CacheFormatError, MmapCachedDataset


def main() -> int:
    with scratch() as path:
        with MmapCachedDataset(path, Images()) as ds:
            ds.fill(range(9))  # rows 9..12 unfilled
        changes = words(os.path.join(path, "changes.u64"), "<u8")
        changes[1] = 13
        changes.flush()
        try:
            with MmapCachedDataset(path) as ds:
                batch = ds.__getitems__(list(range(13)))
            source = Images()
            wrong = [i for i, (image, label) in enumerate(batch)
                     if label != i or not torch.equal(image, source[i][0])]
        except (CacheFormatError, mmapcache.SampleNotCachedError) as exc:
            wrong, batch = [], str(exc)[:100]
        result = mmapcache.verify(path, Images(), samples=None)
        print(f"wrong samples served: {wrong}; verify ok: {result.ok}")
        return verdict(bool(wrong) and result.ok, "wrong samples served while verify reports the cache ok")


if __name__ == "__main__":
    sys.exit(main())
