"""meta.json with a ragged field's "heap" (or a fixed field's "file") set to null: read_meta accepts it, and
opening, verify() and describe() raise a raw TypeError (os.path.join of None) instead of CacheFormatError."""

from __future__ import annotations

import json
import os
import sys

from _common import Texts, scratch, texts_cache, verdict

import mmapcache
from mmapcache import CacheFormatError, MmapCachedDataset


def main() -> int:
    with scratch() as path:
        texts_cache(path)
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        meta["fields"][1]["heap"] = None
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(meta, f)
        outcomes, bug = [], False
        for what, call in [("open", lambda: MmapCachedDataset(path, Texts(), ragged=["tokens"], fingerprint="t")),
                           ("verify", lambda: mmapcache.verify(path))]:
            try:
                call()
                outcomes.append(f"{what}: no error")
                bug = True
            except Exception as exc:
                outcomes.append(f"{what}: {type(exc).__name__}: {exc}")
                bug |= not isinstance(exc, CacheFormatError)
        print("; ".join(outcomes))
        return verdict(bug, "a meta.json field without its files is malformed: CacheFormatError")


if __name__ == "__main__":
    sys.exit(main())
