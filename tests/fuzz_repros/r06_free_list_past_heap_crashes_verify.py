"""A free extent's "next" pointer (or a list head) past the heap: verify() crashes with a raw ValueError (not enough
values to unpack) instead of reporting the damage."""

from __future__ import annotations

import os
import sys

import numpy as np
from _common import Texts, heap_block, scratch, texts_cache, verdict

import mmapcache
from mmapcache import _heap


def main() -> int:
    with scratch() as path:
        texts_cache(path)
        block = heap_block(path, 1)  # tokens: caption is ragged field 0
        head = int(block[_heap.HEADS:][block[_heap.HEADS:] != 0][0])
        with open(os.path.join(path, "tokens.heap"), "r+b") as f:
            f.seek(head - 1)
            f.write(np.array([2**31 - 1], "<u8").tobytes())  # the extent's next: 1 + an offset past the heap
        try:
            result = mmapcache.verify(path, Texts(), samples=None)
            print(f"verify ok: {result.ok}, problems: {result.problems}")
            return verdict(result.ok, "verify must report the damaged free list")
        except Exception as exc:
            return verdict(not isinstance(exc, mmapcache.CacheFormatError), f"verify raised {exc!r}")


if __name__ == "__main__":
    sys.exit(main())
