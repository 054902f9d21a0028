"""The warm path's cache-wide check (``changes.u64``): a complete cache is read without per-row checks, and only
while no writer changes anything; a writer that died mid-change sends every reader back to the per-row checks."""

from __future__ import annotations

import numpy as np
import torch

from helpers.sources import ImageLabels, sample_equal
from mmapcache import MmapCachedDataset

N = 40


def _batch_equals(ds: MmapCachedDataset, source: ImageLabels, indices: list[int]) -> bool:
    images, labels = ds.read_batch(indices)
    return all(torch.equal(images[k], source[i][0]) and int(labels[k]) == source[i][1]
               for k, i in enumerate(indices))


def test_complete_counts_follow_fill_refresh_and_rewrites(cache_path: str) -> None:
    source = ImageLabels(N)
    with MmapCachedDataset(cache_path, source, ragged=None) as ds:  # no layout probes: counts start at 1
        state = ds._store.state
        assert state.all_complete() == -1 and state.changes[1] == 1  # the creator stored sample 0
        ds.fill()
        assert state.changes[1] == N and state.all_complete() >= 0
        counter = state.all_complete()
        assert _batch_equals(ds, source, [5, 0, 39, 5])
        assert state.all_complete() == counter  # reading changes nothing
        ds.refresh(indices=[3, 4])
        assert state.changes[1] == N - 2 and state.all_complete() == -1  # stale rows: the per-row checks
        assert _batch_equals(ds, source, [3, 4, 7])  # recomputed on access (stale="recompute")
        assert state.changes[1] == N and state.all_complete() > counter
        assert state.complete_rows() == N


def test_a_writer_killed_mid_change_never_lets_a_torn_row_through(cache_path: str) -> None:
    source = ImageLabels(N)
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        state, data = ds._store.state, ds._store.data[0]
        # What a writer killed in the middle of rewriting row 7 leaves: both counters odd, half the row written.
        state.changes[0] |= 1
        state.seq[7] |= 1
        data[7].reshape(-1)[: data[7].size // 2] = 255
        assert state.all_complete() == -1
        assert _batch_equals(ds, source, list(range(N)))  # row 7 read as a miss, recomputed and stored again
        # The next writer found the cache-wide counter odd and counted the complete rows again from the bits.
        assert state.changes[0] % 2 == 0 and state.changes[1] == N == state.complete_rows()
        assert sample_equal(ds[7], source[7]) and state.all_complete() >= 0
        assert np.array_equal(data[7], source[7][0].numpy())
