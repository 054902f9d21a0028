"""The ways samples get into a cache besides the loader's misses (issue 28): ``fill``, ``prefill`` and build workers
compute, check and store a batch at a time (``Misses.fill``, the loader's path), with every protection of the
per-sample path: a source that refills one buffer, a sample that fails, a heap without room, stale rows, a build's
failures and ``fail_fast``. (Speed: ``tools/bench.py --only waysin``, never a timed assertion.)
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from torch.utils.data import Dataset

import mmapcache
from helpers.sources import ImageLabels, sample_equal
from mmapcache import MmapCachedDataset

HERE = os.path.dirname(os.path.abspath(__file__))


class Refills(Dataset):
    """Every sample written into one buffer and returned as a view (some decoders do): a batch computed before it
    is copied would store the last sample's bytes under every index. ``bad`` indices raise after refilling it."""

    def __init__(self, n: int = 300, ragged: bool = False, bad: tuple[int, ...] = ()) -> None:
        self.n, self.ragged, self.bad = n, ragged, bad
        self.buf = np.zeros(40, np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.buf[:] = i
        if i in self.bad:
            raise OSError(f"record {i} is corrupt")
        return {"x": self.buf[:5 + i % 7] if self.ragged else self.buf[:8], "i": i}


def refills(n: int = 300, ragged: bool = False, bad: list[int] | None = None) -> Refills:
    return Refills(n, ragged, tuple(bad or ()))


def _each_its_own(path: str, n: int, ragged: bool, skip: tuple[int, ...] = ()) -> None:
    with MmapCachedDataset(path) as reader:
        for i in range(n):
            if i in skip:
                assert not reader.is_cached(i)
                continue
            value = np.asarray(reader[i]["x"])
            assert value.shape == ((5 + i % 7,) if ragged else (8,)) and (value == i).all(), (i, value)


@pytest.mark.parametrize("ragged", [False, True])
def test_fill_and_prefill_store_each_sample_of_a_refilling_source_its_own_value(cache_path: str,
                                                                                ragged: bool) -> None:
    options: dict[str, Any] = {"ragged": ["x"]} if ragged else {"ragged": None}
    with MmapCachedDataset(cache_path, Refills(300, ragged), **options) as ds:
        before = sum(ds.is_cached(i) for i in range(150))  # the creator's first sample (and probes)
        assert ds.fill(range(150)) == 150 - before
        assert ds.prefill(rank=0, world_size=1, barrier=False) > 0
        assert ds.num_cached == 300
    _each_its_own(cache_path, 300, ragged)


def test_fill_stops_at_a_failing_sample_and_keeps_the_ones_computed_before(cache_path: str) -> None:
    # As the per-sample fill did: the error reaches the caller, naming the index, and the samples computed before
    # it are stored, each its own (computed again one by one: the failure may have half-written the buffer).
    with MmapCachedDataset(cache_path, Refills(300, bad=(77,)), ragged=None) as ds:
        with pytest.raises(OSError, match="record 77 is corrupt"):
            ds.fill()
        assert all(ds.is_cached(i) for i in range(77)) and not ds.is_cached(77)
    _each_its_own(cache_path, 77, False)


def test_fill_rewrites_stale_rows_even_where_they_are_served(cache_path: str) -> None:
    # stale="serve" serves a stale row until something rewrites it: fill() is what does (its batch path must not
    # take a stale row for one filled meanwhile).
    with MmapCachedDataset(cache_path, ImageLabels(40), stale="serve", ragged=None) as ds:
        ds.fill()
        assert ds.refresh(indices=list(range(10, 30))) == 20
        assert ds.fill() == 20
        assert ds.missing_indices().tolist() == []
        assert all(sample_equal(ds[i], ImageLabels(40)[i]) for i in range(40))


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("ragged", [False, True])
def test_a_build_stores_a_refilling_source_right_and_reports_each_failure(cache_path: str, workers: int,
                                                                           ragged: bool) -> None:
    # A chunk is one batch now: its failing samples are reported one by one and the others stored, each its own.
    bad = [3, 150, 151, 299]
    report = mmapcache.build(cache_path, os.path.join(HERE, "test_ways_in.py") + ":refills",
                             kwargs={"n": 300, "ragged": ragged, "bad": bad}, workers=workers,
                             ragged=["x"] if ragged else None, progress=False)
    assert sorted(f.index for f in report.failed) == bad
    assert all("record" in f.error and "is corrupt" in f.error for f in report.failed)
    assert report.filled + report.skipped + len(bad) == 300
    _each_its_own(cache_path, 300, ragged, skip=tuple(bad))
    assert report.steady[0] >= 0 and report.steady[1] >= 0


def test_fail_fast_stores_what_its_batch_computed_before_the_failure(cache_path: str) -> None:
    report = mmapcache.build(cache_path, os.path.join(HERE, "test_ways_in.py") + ":refills",
                             kwargs={"n": 300, "bad": [40]}, workers=1, ragged=None, fail_fast=True,
                             progress=False)
    assert [f.index for f in report.failed] == [40]
    with MmapCachedDataset(cache_path) as ds:
        # (Past the failing chunk, the worker may have filled the chunks it had been handed ahead: more, not less.)
        assert not ds.is_cached(40) and ds.num_cached >= report.filled == 40
    _each_its_own(cache_path, 40, False)


def test_rows_of_a_page_or_more_are_stored_whole_when_pwrite_writes_less_than_asked(cache_path: str,
                                                                                     monkeypatch) -> None:
    # pwrite may write fewer bytes than asked (POSIX allows it; a signal or a nearly full file system can cause
    # it). Every write path must go on from where it stopped: a batch's shuffled rows (one run each), a fill's
    # consecutive rows (one run of many) and single misses. Here each call writes at most 1000 bytes.
    real = os.pwrite

    def short(fd: int, data: Any, offset: int) -> int:
        return real(fd, memoryview(data)[:1000], offset)

    source = ImageLabels(n=96, shape=(3, 40, 40))  # 4,800-byte rows: written with pwrite, not through the map
    with MmapCachedDataset(cache_path, source) as ds:
        monkeypatch.setattr(os, "pwrite", short)
        order = np.random.default_rng(0).permutation(64).tolist()
        batch = ds.__getitems__(order)  # shuffled misses: a run per row
        ds.fill(range(64, 90))  # consecutive rows: one run
        singles = [ds[i] for i in range(90, 96)]  # single misses
        monkeypatch.undo()
        assert all(sample_equal(got, source[i]) for got, i in zip(batch, order))
        assert all(sample_equal(got, source[i]) for got, i in zip(singles, range(90, 96)))
    with MmapCachedDataset(cache_path) as reader:
        assert reader.num_cached == 96
        for i in range(96):
            assert sample_equal(reader[i], source[i]), i
