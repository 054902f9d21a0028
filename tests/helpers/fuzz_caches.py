"""The caches the damage fuzzer (``helpers.fuzz``) damages: deterministic sources, and one builder per kind.

Each kind is a small cache made the way a user makes it (``MmapCachedDataset`` with the kind's options), partly
filled, so that every file of its format exists and holds something worth damaging: fixed rows, heaps with free
lists (rows rewritten at other sizes), a slot index and shape files, two variants, a stream's ring with cursors,
a rotating node share. A kind's ``options`` are what reopening it takes; its sources are importable by the child
process that runs the cases. Sources are deterministic: a sample depends on its index (and the variant, or the
source's ``version``) only, so the fuzzer knows the one right answer for every index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from helpers.sources import ImageLabels, image_of


class Texts(Dataset):
    """``{"caption": str, "tokens": int64 tensor of 0..39 values, "boxes": float32 array (k, 4), "label": int}``.

    ``version`` changes every length and value: a cache filled with version 0, refreshed and refilled with version 1
    has rows that moved (grew) or shrank, so its heaps have free lists and abandoned bytes.
    """

    def __init__(self, n: int = 24, version: int = 1) -> None:
        self.n, self.version = n, version

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        rng = np.random.default_rng([index, self.version])
        tokens = torch.from_numpy(rng.integers(0, 50_000, int(rng.integers(0, 40))))
        boxes = rng.random((int(rng.integers(0, 5)), 4), dtype=np.float32)
        caption = f"#{index} " + "é✓ 猫" * int(rng.integers(0, 6))
        return {"caption": caption, "tokens": tokens, "boxes": boxes, "label": index}


class Points(Dataset):
    """``(uint8 image (2, 4, 4), float32 points (k, 2) with k in 0..5, int label)``: a ``max_shapes`` field."""

    def __init__(self, n: int = 22) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        rng = np.random.default_rng([index, 7])
        points = rng.standard_normal((index % 6, 2)).astype(np.float32)
        return image_of(index, (2, 4, 4)), points, index % 5


class Versions(Dataset):
    """``(uint8 image, float)`` whose value depends on the index and ``epoch % 2`` (the variant): ``set_epoch``
    selects it, as a source keyed on the epoch does (and as ``verify`` calls it per variant)."""

    def __init__(self, n: int = 12) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        variant = self.epoch % 2
        return image_of(1000 * variant + index, (3, 4, 4)), index + 0.5 * variant


class Tokens(Dataset):
    """Stream samples: ``{"x": int64 tensor of index-derived values, "i": index}`` (deterministic)."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return {"x": torch.arange(6, dtype=torch.int64) * 1_000_003 + index, "i": index}


def keep(batch: list[Any]) -> list[Any]:
    """A ``collate_fn`` that keeps the samples as they are (fields whose shape varies cannot be stacked)."""
    return batch


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of cache: how to make its source, the options that (re)open it, and how to build it.

    ``epochs``: the epochs a reader reads (variants and a rotating share serve other rows in epoch 1).
    ``stream``: read through ``ds.loader()``, which reads the ring; ``collate``: the loader's ``collate_fn``.
    """

    name: str
    source: Callable[[], Any]
    options: dict[str, Any]
    build: Callable[[str], None]
    epochs: tuple[int, ...] = (0,)
    stream: bool = False
    collate: Callable[[list[Any]], Any] | None = None


def _build_fixed(path: str) -> None:
    from mmapcache import MmapCachedDataset

    with MmapCachedDataset(path, ImageLabels(13)) as ds:
        ds.fill(range(9))


def _build_ragged(path: str) -> None:
    from mmapcache import MmapCachedDataset

    with MmapCachedDataset(path, Texts(24, version=0), **KINDS["ragged"].options) as ds:
        ds.fill(range(18))
    # Version 1 of every filled row: rows that grew move (their old extents go to the free lists), rows that
    # shrank below half of their extent move to a free extent that fits.
    with MmapCachedDataset(path, Texts(24, version=1), **KINDS["ragged"].options) as ds:
        ds.refresh(indices=range(18))
        ds.fill(range(18))
        ds.refresh(indices=range(0, 18, 3))
        ds.fill(range(18))


def _build_partial(path: str) -> None:
    from mmapcache import MmapCachedDataset

    with MmapCachedDataset(path, Points(22), **KINDS["partial"].options) as ds:
        ds.fill([1, 3, 4, 8, 15])


def _build_variants(path: str) -> None:
    from mmapcache import MmapCachedDataset

    source = Versions(12)
    with MmapCachedDataset(path, source, **KINDS["variants"].options) as ds:
        ds.fill(range(8))
        ds.set_epoch(1)
        source.set_epoch(1)
        ds.fill(range(2, 10))


class _After:
    """A stop "event" that is set after ``count`` checks: a producer loop that claims exactly ``count`` positions."""

    def __init__(self, count: int) -> None:
        self.count = count

    def is_set(self) -> bool:
        self.count -= 1
        return self.count < 0


def _build_stream(path: str) -> None:
    from mmapcache import MmapCachedDataset
    from mmapcache.fill.producer import produce

    with MmapCachedDataset(path, Tokens(24), **KINDS["stream"].options) as ds:
        slots = ds._store.slots
        produce(path, Tokens, _After(slots))  # in this process, deterministically: fills the ring
        batches = iter(ds.loader(batch_size=4))
        next(batches)  # the cursor moves past what was handed out
        next(batches)
        produce(path, Tokens, _After(8))  # and rows read are refilled with later positions


def _build_share(path: str) -> None:
    from mmapcache import MmapCachedDataset

    with MmapCachedDataset(path, ImageLabels(20, (3, 4, 4)), **KINDS["share"].options) as ds:
        ds.fill()
        ds.set_epoch(1)  # another generation: some rows are rewritten with other indices (other keys)
        ds.fill(ds.cacheable_indices()[:3])


KINDS: dict[str, Kind] = {
    "fixed": Kind("fixed", lambda: ImageLabels(13), {}, _build_fixed),
    "ragged": Kind("ragged", lambda: Texts(24, version=1), {"ragged": ["tokens", "boxes"], "fingerprint": "texts"},
                   _build_ragged),
    "partial": Kind("partial", lambda: Points(22),
                    {"cache_indices": [1, 3, 4, 8, 11, 15, 16, 20], "max_shapes": {"1": (5, 2)}}, _build_partial,
                    collate=keep),
    "variants": Kind("variants", lambda: Versions(12), {"variants": 2, "fingerprint": "versions"}, _build_variants,
                     epochs=(0, 1)),
    "stream": Kind("stream", lambda: Tokens(24), {"stream": True, "max_bytes": 1000, "seed": 3}, _build_stream,
                   stream=True),
    "share": Kind("share", lambda: ImageLabels(20, (3, 4, 4)),
                  {"node_share": (1, 3), "rotate_every": 1, "fingerprint": "share"}, _build_share, epochs=(0, 1)),
}


def build_all(root: str, kinds: list[str]) -> None:
    """Builds the pristine cache of each kind as ``root/<kind>/cache``."""
    for name in kinds:
        KINDS[name].build(f"{root}/{name}/cache")
