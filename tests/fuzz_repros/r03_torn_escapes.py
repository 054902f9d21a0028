"""An index row whose extent lies past the heap (or with a negative shape): ds[i], ds.__getitems__ and verify()
raise the private mmapcache._ragged.Torn (an empty message) instead of CacheFormatError."""

from __future__ import annotations

import os
import sys

from _common import Texts, scratch, texts_cache, verdict, words

import mmapcache
from mmapcache import MmapCachedDataset


def main() -> int:
    with scratch() as path:
        texts_cache(path)
        index = words(os.path.join(path, "tokens.index.npy"))
        index[3, 0] = os.path.getsize(os.path.join(path, "tokens.heap")) + 4096  # the offset, past the heap
        index.flush()
        outcomes = []
        for what, call in [("ds[3]", lambda: MmapCachedDataset(path)[3]),
                           ("verify", lambda: mmapcache.verify(path, Texts(), samples=None))]:
            try:
                call()
                outcomes.append(f"{what}: no error")
            except Exception as exc:
                outcomes.append(f"{what}: {type(exc).__module__}.{type(exc).__qualname__}")
        print("; ".join(outcomes))
        return verdict(any("Torn" in o for o in outcomes), "a damaged index row must be CacheFormatError")


if __name__ == "__main__":
    sys.exit(main())
