"""What a side of the text group's warm tables is: a ``Reader`` (one way to read the corpus in shuffled batches,
checked against the floor's before any timing) and a ``LoaderReader`` (one whose loader is a DataLoader, or one
that takes its arguments). The sides themselves are in ``text_sides`` and ``text_model_sides``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from benchmark import epochs
from benchmark.core import Timed
from benchmark.groups.text_corpus import SEED, Corpus
from mmapcache import MmapCachedDataset


class Reader:
    """One way to read the corpus in batches padded to their longest, shuffled.

    ``epoch(batch, workers)`` returns one warm epoch's work for ``interleave`` (its loader persists between calls);
    ``batches(index_lists)`` the batches of those indices as ``{"input_ids", "attention_mask", "labels": int64
    tensors, "text": list of str or None}``, checked against the floor's (a side that yields another form, such as
    flattened ids with ``cu_seqlens``, converts its batches to this one here). ``skipped``: why the side cannot run.
    """

    name = ""
    label = ""
    skipped = ""

    def __init__(self, corpus: Corpus, tmp: str, ds: MmapCachedDataset) -> None:
        self.corpus = corpus

    def epoch(self, batch: int, workers: int) -> Callable[[], Timed | None]:
        raise NotImplementedError

    def batches(self, index_lists: list[list[int]]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def release(self) -> None:
        """Ends the workers of the loaders made so far (after each table)."""

    def close(self) -> None:
        self.release()


class LoaderReader(Reader):
    """A side whose loader is a torch ``DataLoader`` (or one that takes its arguments): ``make(**kwargs)``."""

    def __init__(self, corpus: Corpus, tmp: str, ds: MmapCachedDataset) -> None:
        super().__init__(corpus, tmp, ds)
        self.loaders: list[Any] = []

    def make(self, **kwargs: Any) -> Any:
        raise NotImplementedError

    def canonical(self, batch: Any) -> dict[str, Any]:
        return batch

    def epoch(self, batch: int, workers: int) -> Callable[[], None]:
        loader = self.make(batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=workers > 0)
        self.loaders.append(loader)
        return epochs.epoch(loader)

    def batches(self, index_lists: list[list[int]]) -> list[dict[str, Any]]:
        flat = [i for rows in index_lists for i in rows]
        return [self.canonical(b) for b in self.make(batch_size=len(index_lists[0]), sampler=flat)]

    def release(self) -> None:
        self.loaders.clear()  # persistent workers end with their iterator, once nothing holds the loader


class GatherFloor(Reader):
    """A floor: ``gather(rows)`` copies a batch's bytes with numpy alone, one process (workers do not apply); an
    epoch gathers the batches of a seeded permutation."""

    def gather(self, rows: np.ndarray) -> Any:
        raise NotImplementedError

    def epoch(self, batch: int, workers: int) -> Callable[[], None]:
        rng, n = np.random.default_rng(SEED), self.corpus.n

        def run() -> None:
            perm = rng.permutation(n)
            for k in range(0, n, batch):
                self.gather(perm[k:k + batch])
        return run
