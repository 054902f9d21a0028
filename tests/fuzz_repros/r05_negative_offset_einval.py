"""An index row with a negative offset: a writer rewriting the row raises a raw OSError (EINVAL from pwrite)."""

from __future__ import annotations

import os
import sys

from _common import Texts, scratch, texts_cache, verdict, words

from mmapcache import CacheFormatError, MmapCachedDataset


def main() -> int:
    with scratch() as path:
        texts_cache(path)
        index = words(os.path.join(path, "tokens.index.npy"))
        index[3, 0] = -8
        index.flush()
        with MmapCachedDataset(path, Texts(), ragged=["tokens"], fingerprint="t") as ds:
            ds.refresh(indices=[3])
            try:
                ds.fill([3])
                error: Exception | None = None
            except Exception as exc:
                error = exc
        print(f"fill: {type(error).__name__}: {error}")
        return verdict(error is not None and not isinstance(error, CacheFormatError),
                       "damage must be CacheFormatError")


if __name__ == "__main__":
    sys.exit(main())
