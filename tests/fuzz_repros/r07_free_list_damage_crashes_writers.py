"""Free-list damage reaches a writer looking for room (Heap.reuse): a list head of 2**64-1 raises a raw IndexError,
a head at the heap's last bytes a raw ValueError (numpy view), and a ``free`` counter smaller than the extent a
numpy RuntimeWarning (an error under filterwarnings=error) from ``c[FREE] -= size``."""

from __future__ import annotations

import sys
import warnings

from _common import Texts, heap_block, scratch, texts_cache, verdict

from mmapcache import CacheFormatError, MmapCachedDataset, _heap


def damage(path: str, how: str) -> None:
    block = heap_block(path, 1)
    heads = [i for i in range(_heap.HEADS, _heap.BLOCK) if block[i]]
    if how == "head -1":
        block[heads] = 2**64 - 1
    elif how == "head at the end":
        block[heads] = int(block[_heap.CAPACITY])  # 1 + (capacity - 1): 1 byte before the end
    else:
        block[_heap.FREE] = 1
    block.flush()


def main() -> int:
    bugs = []
    for how in ("head -1", "head at the end", "free counter 1"):
        with scratch() as path:
            texts_cache(path)
            damage(path, how)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with MmapCachedDataset(path, Texts(version=2), ragged=["tokens"], fingerprint="t") as ds:
                    ds.refresh(indices=range(10))
                    try:
                        ds.fill(range(10))  # version 2: values move, looking for room on the free lists
                        error: Exception | None = None
                    except Exception as exc:
                        error = exc
            print(f"{how}: {type(error).__name__ if error else 'no error'}: {error}")
            bugs.append(error is not None and not isinstance(error, CacheFormatError))
    return verdict(any(bugs), "a damaged free list must be CacheFormatError (or ignored), never a raw error")


if __name__ == "__main__":
    sys.exit(main())
