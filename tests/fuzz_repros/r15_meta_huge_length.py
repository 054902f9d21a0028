"""meta.json "length" of 2**63 (any non-negative int passes read_meta): opening, verify() and describe() raise a raw
ValueError (np.full in RowMap._lookup / describe: maximum allowed dimension exceeded); without a slot index
len(ds) raises OverflowError; a length of 2**33 asks numpy for 64 GiB before anything is read."""

from __future__ import annotations

import json
import os
import sys

from _common import Images, scratch, verdict

import mmapcache
from mmapcache import CacheFormatError, MmapCachedDataset


def main() -> int:
    with scratch() as path:
        with MmapCachedDataset(path, Images(), cache_indices=[1, 3, 5]) as ds:  # a slot index: RowMap's lookup
            ds.fill()
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        meta["length"] = 2**63
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(meta, f)
        outcomes, bug = [], False
        for what, call in [("len(ds)", lambda: len(MmapCachedDataset(path))),
                           ("verify", lambda: mmapcache.verify(path)), ("describe", lambda: mmapcache.describe(path))]:
            try:
                call()
                outcomes.append(f"{what}: no error")
            except Exception as exc:
                outcomes.append(f"{what}: {type(exc).__name__}: {exc}")
                bug |= not isinstance(exc, CacheFormatError)
        print("; ".join(outcomes))
        return verdict(bug, "a length no cache can have is a malformed meta.json: CacheFormatError")


if __name__ == "__main__":
    sys.exit(main())
