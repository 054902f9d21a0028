"""No damage needed: a stream opened without its source (MmapCachedDataset(path)) and read with ds.loader() raises a
raw TypeError ('NoneType' object is not subscriptable, in _misses.fetch) at the first position the ring does not
hold, instead of SampleNotCachedError."""

from __future__ import annotations

import sys

from _common import Tokens, scratch, verdict

from mmapcache import MmapCachedDataset, SampleNotCachedError


def main() -> int:
    with scratch() as path:
        MmapCachedDataset(path, Tokens(), stream=True, max_bytes=1000, seed=3).close()
        try:
            with MmapCachedDataset(path) as ds:
                list(ds.loader(batch_size=5, rank=0, world_size=1))
            error: Exception | None = None
        except Exception as exc:
            error = exc
        print(f"loader: {type(error).__name__ if error else 'no error'}: {error}")
        return verdict(error is not None and not isinstance(error, SampleNotCachedError),
                       "a miss without a source is SampleNotCachedError")


if __name__ == "__main__":
    sys.exit(main())
