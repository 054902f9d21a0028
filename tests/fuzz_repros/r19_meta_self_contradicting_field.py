"""meta.json field descriptions that contradict themselves pass read_meta: a ragged field also marked "variable"
(ds.loader then stacks its values: raw RuntimeError from torch.stack via mmapcache.collate), and a float64 field of
kind "bool" (a miss raises LayoutError "expected bool of dtype <f8", a hit returns a float where a bool is
declared). Either should be CacheFormatError (malformed meta.json) on open."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from _common import scratch, texts_cache, verdict
from torch.utils.data import Dataset

from mmapcache import CacheFormatError, MmapCachedDataset


class Halves(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        return torch.full((3,), i, dtype=torch.uint8), i + 0.5


def edit(path: str, field: int, key: str, value: Any) -> None:
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    meta["fields"][field][key] = value
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)


def attempt(call: Any) -> str:
    try:
        call()
        return "no error"
    except Exception as exc:
        return f"{type(exc).__module__}.{type(exc).__name__}: {str(exc)[:100]}"


def main() -> int:
    outcomes = []
    with scratch() as path:
        texts_cache(path)
        edit(path, 1, "variable", True)  # tokens: ragged and variable
        outcomes.append("ragged+variable, loader: " + attempt(
            lambda: list(MmapCachedDataset(path).loader(batch_size=5))))
    with scratch() as path:
        with MmapCachedDataset(path, Halves(), fingerprint="h") as ds:
            ds.fill(range(8))
        edit(path, 1, "kind", "bool")
        outcomes.append("kind bool of <f8, a miss: " + attempt(
            lambda: MmapCachedDataset(path, Halves(), fingerprint="h")[9]))
    print("\n".join(outcomes))
    return verdict(any(CacheFormatError.__name__ not in o for o in outcomes), "malformed meta.json: CacheFormatError")


if __name__ == "__main__":
    sys.exit(main())
