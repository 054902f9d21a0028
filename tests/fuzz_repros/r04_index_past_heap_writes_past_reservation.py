"""An index row whose offset points past the heap: a writer rewriting that row (refresh + fill) writes there with
pwrite, growing the heap past what posix_fallocate reserved (offset 2**30: a sparse 1 GiB file, SIGBUS territory
on a full tmpfs; offset = the heap's size: 17 unreserved bytes)."""

from __future__ import annotations

import os
import sys

from _common import Texts, scratch, texts_cache, verdict, words

from mmapcache import MmapCachedDataset


def main() -> int:
    bugs = []
    for offset in ("size", 2**30):
        with scratch() as path:
            texts_cache(path)
            heap = os.path.join(path, "tokens.heap")
            before = os.path.getsize(heap)
            index = words(os.path.join(path, "tokens.index.npy"))
            index[3, 0] = before if offset == "size" else offset
            index.flush()
            with MmapCachedDataset(path, Texts(), ragged=["tokens"], fingerprint="t") as ds:
                ds.refresh(indices=[3])
                try:
                    ds.fill([3])
                    error = "no error"
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
            st = os.stat(heap)
            print(f"offset {offset}: fill: {error}; heap {before} -> {st.st_size} bytes, {st.st_blocks * 512} "
                  "allocated")
            bugs.append(st.st_size != before)
    return verdict(any(bugs), "the heap must never grow except by posix_fallocate")


if __name__ == "__main__":
    sys.exit(main())
