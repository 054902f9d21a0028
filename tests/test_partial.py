"""Partial caching: under ``max_bytes`` (or with ``cache_indices``) some samples are cached and the rest pass
straight through to the source; the choice is recorded, checked on reopen, and suggested when space runs out."""

from __future__ import annotations

import json
import os
import re
import subprocess
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from helpers.sources import Counting, ImageLabels, sample_equal
from mmapcache import CacheMismatchError, InsufficientSpaceError, MmapCachedDataset, SampleNotCachedError
from mmapcache.store import create as _create

N = 40
SHAPE = (3, 16, 16)


def _layout_bytes(ds: MmapCachedDataset) -> int:
    """What the cache occupies, counted the way ``max_bytes`` bounds it."""
    store = ds._store
    return _create.plan_bytes(store.layout, store.rows, store.slots if store.slot_index is not None else 0)


@pytest.mark.parametrize("max_bytes", [10_000, "10000", "9.8K", "16K"])
def test_max_bytes_caches_as_many_leading_samples_as_fit(cache_path: str, max_bytes: Any) -> None:
    with MmapCachedDataset(cache_path, ImageLabels(N, SHAPE), max_bytes=max_bytes) as ds:
        limit = {"9.8K": int(9.8 * 1024), "16K": 16 * 1024}.get(max_bytes, 10_000)  # type: ignore[arg-type]
        k = ds.num_cacheable
        assert 0 < k < N
        assert _layout_bytes(ds) <= limit
        # As many as fit: one more would not.
        assert _create.plan_bytes(ds._store.layout, k + 1, 0) > limit
        assert ds._store.meta["slot_index"] is None and ds._store.meta["slots"] == k  # the first k, recorded


def test_pass_through_samples_are_never_stored(cache_path: str, tmp_path: Any) -> None:
    source = Counting(ImageLabels(N, SHAPE), str(tmp_path / "calls"))
    with MmapCachedDataset(cache_path, source, max_bytes="8K") as ds:
        k = ds.num_cacheable
        assert 0 < k < N - 2
        for _ in range(3):
            for i in range(N):
                assert sample_equal(ds[i], source.inner[i])
        calls = source.calls()
        for i in range(N):
            # Cached samples: computed once (index 0 also by the layout probe); the others on every access.
            assert calls.count(i) == (3 if i >= k else 1), i
            assert ds.is_cached(i) == (i < k)
        assert ds.num_cached == k
        assert ds.fill() == 0  # nothing left to fill: pass-through samples are not fillable


def test_mixed_batches_equal_the_source(cache_path: str) -> None:
    source = ImageLabels(N, SHAPE)
    with MmapCachedDataset(cache_path, source, max_bytes="8K") as ds:
        k = ds.num_cacheable
        order = [N - 1, 0, k, k - 1, 5, N - 2, 5, -1]  # pass-through, cached, repeated, negative
        for _ in range(2):  # misses, then hits for the cacheable ones
            batch = ds.__getitems__(order)
            assert all(sample_equal(s, source[i % N]) for s, i in zip(batch, order))
        expected_images = torch.stack([source[i][0] for i in range(N)])
        expected_labels = torch.tensor([source[i][1] for i in range(N)])
        for loader in (ds.loader(batch_size=7), ds.loader(batch_size=7, num_workers=2, multiprocessing_context="fork"),
                       DataLoader(ds, batch_size=7, num_workers=2, multiprocessing_context="fork")):
            images, labels = zip(*loader)
            assert torch.equal(torch.cat(images), expected_images)
            assert torch.equal(torch.cat(labels), expected_labels)


def test_cache_indices_choose_the_cached_subset(cache_path: str, tmp_path: Any) -> None:
    chosen = [7, 3, 30, 11]
    source = Counting(ImageLabels(N, SHAPE), str(tmp_path / "calls"))
    with MmapCachedDataset(cache_path, source, cache_indices=chosen) as ds:
        assert ds.num_cacheable == 4
        for _ in range(2):
            assert all(sample_equal(ds[i], source.inner[i]) for i in range(N))
        assert [i for i in range(N) if ds.is_cached(i)] == sorted(chosen)
        calls = source.calls()
        # Chosen: computed once (7, the first chosen, by the layout probe, which stored it); others every time.
        assert [calls.count(i) for i in range(N)] == [1 if i in chosen else 2 for i in range(N)]
        assert calls[0] == 7
    # The format, read without the library: slot s holds source index slot_index[s].
    with open(os.path.join(cache_path, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["slot_index"] == "slot_index.npy" and meta["slots"] == 4
    slot_index = np.load(os.path.join(cache_path, "slot_index.npy"))
    assert slot_index.dtype == np.int64 and slot_index.tolist() == chosen
    images = np.load(os.path.join(cache_path, "0.npy"), mmap_mode="r")
    assert images.shape == (4, *SHAPE)
    for slot, index in enumerate(slot_index):
        assert np.array_equal(images[slot], source.inner[int(index)][0].numpy())


def test_cache_indices_with_max_bytes_keeps_the_first_chosen_that_fit(cache_path: str) -> None:
    chosen = list(range(N - 1, -1, -2))  # 39, 37, ...
    with MmapCachedDataset(cache_path, ImageLabels(N, SHAPE), cache_indices=chosen, max_bytes="8K") as ds:
        k = ds.num_cacheable
        assert 0 < k < len(chosen)
        assert ds._store.slot_index.tolist() == chosen[:k]
        ds.fill()
        assert [i for i in range(N) if ds.is_cached(i)] == sorted(chosen[:k])
        assert _layout_bytes(ds) <= 8 * 1024


def test_reopen_uses_the_recorded_choice_and_rejects_another(cache_path: str) -> None:
    source = ImageLabels(N, SHAPE)
    with MmapCachedDataset(cache_path, source, max_bytes="8K") as ds:
        k = ds.num_cacheable
    with MmapCachedDataset(cache_path, source) as ds:  # no options: the recorded ones
        assert ds.num_cacheable == k
    with MmapCachedDataset(cache_path) as ds:  # no source at all
        assert ds.num_cacheable == k
        with pytest.raises(SampleNotCachedError, match=f"sample {N - 1} is not cacheable in the cache"):
            ds[N - 1]
    with MmapCachedDataset(cache_path, source, max_bytes="8K") as ds:  # the same option: the same choice
        assert ds.num_cacheable == k
    with MmapCachedDataset(cache_path, source, cache_indices=range(k)) as ds:  # the same indices, spelled out
        assert ds.num_cacheable == k
    with pytest.raises(CacheMismatchError, match=rf"{k} cacheable samples \(the first ones\) in the cache, "
                                                 rf"\d+ \(the first ones\) with max_bytes=16384"):
        MmapCachedDataset(cache_path, source, max_bytes="16K")
    with pytest.raises(CacheMismatchError, match="overwrite=True"):
        MmapCachedDataset(cache_path, source, max_bytes="1G")  # everything would fit: not what is recorded
    with pytest.raises(CacheMismatchError, match="a chosen subset"):
        MmapCachedDataset(cache_path, source, cache_indices=[1, 2])
    with MmapCachedDataset(cache_path, source, max_bytes="16K", overwrite=True) as ds:
        assert ds.num_cacheable > k
    with MmapCachedDataset(cache_path, source, overwrite=True, max_bytes="1G") as ds:
        assert ds.num_cacheable == N


def test_full_cache_matches_any_max_bytes_that_holds_it(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, ImageLabels(N, SHAPE)):
        pass
    with MmapCachedDataset(cache_path, ImageLabels(N, SHAPE), max_bytes="1G") as ds:
        assert ds.num_cacheable == N


@pytest.mark.parametrize("kwargs, error, message", [
    ({"max_bytes": "lots"}, ValueError, "max_bytes='lots' is not a size"),
    ({"max_bytes": 0}, ValueError, "max_bytes must be positive"),
    ({"max_bytes": 100}, ValueError, "max_bytes=100 is smaller than one sample"),
    ({"cache_indices": [1, 1]}, ValueError, "cache_indices contains duplicates"),
    ({"cache_indices": [0, N]}, IndexError, rf"cache_indices has values outside \[0, {N}\)"),
    ({"cache_indices": []}, ValueError, "cache_indices is empty"),
    ({"cache_indices": [0.5]}, TypeError, "cache_indices must be a 1-D sequence of integers"),
])
def test_bad_partial_options(cache_path: str, kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        MmapCachedDataset(cache_path, ImageLabels(N, SHAPE), **kwargs)
    assert not os.path.exists(cache_path)


@pytest.fixture
def small_tmpfs(tmp_path: Any) -> Iterator[str]:
    """A 1 MiB tmpfs mount (needs root), unmounted afterwards."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True,
                            text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root / CAP_SYS_ADMIN): {result.stderr.strip()}")
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", str(mount)], check=True, timeout=30)


def test_a_dataset_too_large_for_the_file_system_suggests_max_bytes(small_tmpfs: str) -> None:
    path = os.path.join(small_tmpfs, "cache")
    source = ImageLabels(200, (3, 64, 64))  # 200 x 12 KiB: more than the 1 MiB file system
    with pytest.raises(InsufficientSpaceError) as caught:
        MmapCachedDataset(path, source)
    message = str(caught.value)
    assert "max_bytes=" in message and "--max-bytes" in message and "of 200 samples fit" in message
    assert not os.path.exists(path)
    suggested = int(re.search(r"max_bytes=(\d+)", message).group(1))
    about = int(re.search(r"about (\d+) of 200 samples fit", message).group(1))
    with MmapCachedDataset(path, source, max_bytes=suggested) as ds:
        assert 0 < ds.num_cacheable < 200
        assert abs(ds.num_cacheable - about) <= max(2, about // 20)  # the suggestion's estimate was right
        stored = ds.num_cached  # by the creator: the first sample and the layout probes
        assert ds.fill() == ds.num_cacheable - stored  # every cacheable sample really fits
        assert all(sample_equal(ds[i], source[i]) for i in range(0, 200, 7))
        assert ds.num_cached == ds.num_cacheable


class _Tokens(torch.utils.data.Dataset):
    """1,000 samples of about 4 KB of ragged token ids (and a fixed int): 4 MB for a 1 MiB file system."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"ids": torch.full((500 + i % 13,), i, dtype=torch.int64), "i": i}


def test_a_ragged_dataset_too_large_says_how_many_samples_fit(small_tmpfs: str) -> None:
    """Found by review: the estimate counted only a sample's fixed bytes (8 B here), and said "about 249036 of 1000
    samples fit". It counts the ragged values too, and never more than the dataset holds."""
    path = os.path.join(small_tmpfs, "cache")
    with pytest.raises(InsufficientSpaceError) as caught:
        MmapCachedDataset(path, _Tokens())
    message = str(caught.value)
    suggested = int(re.search(r"max_bytes=(\d+)", message).group(1))
    about = int(re.search(r"about (\d+) of 1000 samples fit", message).group(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the heap fills: the rest passes through uncached, warned once)
        with MmapCachedDataset(path, _Tokens(), max_bytes=suggested) as ds:
            ds.fill()
            assert 0 < ds.num_cached < 1000
            assert abs(ds.num_cached - about) <= max(2, about // 10), (about, ds.num_cached)


def test_too_large_without_max_bytes_leaves_nothing_behind(small_tmpfs: str) -> None:
    with pytest.raises(InsufficientSpaceError, match="not enough space for the cache"):
        MmapCachedDataset(os.path.join(small_tmpfs, "cache"), ImageLabels(200, (3, 64, 64)))
    assert [name for name in os.listdir(small_tmpfs) if "cache" in name] == []
