"""A byte of a str field's heap set to 0xFF (or two rows sharing one extent after a rewrite): ds[i] and
ds.__getitems__ raise a raw UnicodeDecodeError instead of CacheFormatError (verify with the source reports the
difference; the reader crashes on it)."""

from __future__ import annotations

import os
import sys

import numpy as np
from _common import Texts, scratch, texts_cache, verdict, words

from mmapcache import CacheFormatError, MmapCachedDataset


def main() -> int:
    with scratch() as path:
        texts_cache(path)
        offset = int(np.load(os.path.join(path, "caption.index.npy"))[2, 0])
        heap = words(os.path.join(path, "caption.heap"), np.uint8)
        heap[offset] = 0xFF
        heap.flush()
        outcomes, bug = [], False
        with MmapCachedDataset(path, Texts(), ragged=["tokens"], fingerprint="t") as ds:
            for what, call in [("ds[2]", lambda: ds[2]), ("__getitems__", lambda: ds.__getitems__([1, 2]))]:
                try:
                    call()
                    outcomes.append(f"{what}: no error")
                except Exception as exc:
                    outcomes.append(f"{what}: {type(exc).__name__}")
                    bug |= not isinstance(exc, CacheFormatError)
        print("; ".join(outcomes))
        return verdict(bug, "undecodable stored bytes are damage: CacheFormatError")


if __name__ == "__main__":
    sys.exit(main())
