"""changes.u64 words near 2**64: the next writer raises a raw ValueError ("memoryview: invalid value for format
'Q'") from SlotState._end_change_locked (changes = 2**64 - 1) or _publish_locked (complete = 2**64 - 1)."""

from __future__ import annotations

import os
import sys

from _common import Images, scratch, verdict, words

from mmapcache import CacheFormatError, MmapCachedDataset


def main() -> int:
    bugs = []
    for word, value in ((0, 2**64 - 1), (1, 2**64 - 1)):
        with scratch() as path:
            with MmapCachedDataset(path, Images()) as ds:
                ds.fill(range(9))
            changes = words(os.path.join(path, "changes.u64"), "<u8")
            changes[word] = value
            changes.flush()
            try:
                with MmapCachedDataset(path, Images()) as ds:
                    ds[11]  # a miss: written
                error: Exception | None = None
            except Exception as exc:
                error = exc
            print(f"changes[{word}] = {value}: {type(error).__name__ if error else 'no error'}: {error}")
            bugs.append(error is not None and not isinstance(error, CacheFormatError))
    return verdict(any(bugs), "damaged counters must be CacheFormatError, or recounted")


if __name__ == "__main__":
    sys.exit(main())
