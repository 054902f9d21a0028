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
import torch
from torch.utils.data import Dataset

import mmapcache
from helpers.sources import ImageLabels, sample_equal
from mmapcache import MmapCachedDataset, UncachedFieldWarning
from mmapcache.store.state import Declined
from mmapcache.store.writer import RowWriter

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


class Captions(Dataset):
    """Ragged values of three item sizes (text as UTF-8 bytes, int16 and int64 tensors), empty ones among them, and
    a fixed label."""

    def __init__(self, n: int = 300) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"text": "é" * (i % 7) + "x" * (i % 5), "ids": torch.arange(i % 11, dtype=torch.int64) * i,
                "pcm": torch.full((3 * (i % 4),), -i, dtype=torch.int16), "label": i}


def _heaps(ds: MmapCachedDataset) -> list[tuple[list[int], np.ndarray, bytes]]:
    """Per ragged field: its counters (end, abandoned, uncached, free), its index and its heap's used bytes."""
    store, out = ds._store, []
    for number, n in enumerate(n for n, f in enumerate(store.layout.fields) if f.ragged):
        end, _, abandoned, uncached, free = (int(x) for x in store.heap_counters[number][:5])
        heap = store.heaps[n]
        out.append(([end, abandoned, uncached, free], np.array(store.index[n]), heap.covering(end)[:end].tobytes()))
    return out


def test_a_batch_of_ragged_values_is_stored_where_one_row_at_a_time_would_store_it(shm_dir: str,
                                                                                     monkeypatch) -> None:
    # A batch's ragged values are packed at the heaps' ends together (RowWriter.write_new_rows, one pwritev per
    # field). Two caches get the same batches (shuffled, one with an index twice, a fill of the rest), one of them
    # stored one row at a time: their heaps, index rows and counters must be identical, byte for byte.
    source = Captions(300)
    rng = np.random.default_rng(0)
    batches = [[*rng.permutation(150)[:64].tolist(), 7, 7], rng.permutation(200)[:100].tolist()]
    stored_at_once = []
    real = RowWriter.write_new_rows

    def spy(self: RowWriter, rows: list[int], *values: Any) -> None:
        real(self, rows, *values)
        stored_at_once.append(len(rows))

    def one_at_a_time(self: RowWriter, rows: list[int], *values: Any) -> None:
        raise Declined

    heaps = []
    for name, write in (("at-once", spy), ("one-at-a-time", one_at_a_time)):
        monkeypatch.setattr(RowWriter, "write_new_rows", write)
        with MmapCachedDataset(os.path.join(shm_dir, name), source, ragged=["text", "ids", "pcm"]) as ds:
            got = [ds.__getitems__(batch) for batch in batches]
            ds.fill()
            assert all(sample_equal(s, source[i]) for b, batch in zip(got, batches) for s, i in zip(b, batch))
            heaps.append(_heaps(ds))
        monkeypatch.undo()
        with MmapCachedDataset(os.path.join(shm_dir, name)) as reader:
            assert reader.num_cached == 300 and all(sample_equal(reader[i], source[i]) for i in range(300))
    assert sum(stored_at_once) >= 290 and max(stored_at_once) > 60  # the path under test was taken
    for (counters, index, data), (counters1, index1, data1) in zip(*heaps):
        assert counters == counters1 and counters[1:] == [0, 0, 0]  # no padding, nothing uncached, nothing free
        assert np.array_equal(index, index1) and data == data1


def test_ragged_batches_are_stored_whole_when_pwritev_writes_less_than_asked(cache_path: str, monkeypatch) -> None:
    # pwritev may write fewer bytes than asked, ending inside any of its buffers: the rest of that one follows,
    # then the others whole. Here each call writes at most 333 bytes.
    real = os.pwritev

    def short(fd: int, buffers: list[Any], offset: int) -> int:
        data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:333]
        return real(fd, [data], offset)

    source = Captions(200)
    with MmapCachedDataset(cache_path, source, ragged=["text", "ids", "pcm"]) as ds:
        monkeypatch.setattr(os, "pwritev", short)
        batch = ds.__getitems__(list(range(100, 0, -1)))
        ds.fill()
        monkeypatch.undo()
        assert all(sample_equal(got, source[i]) for got, i in zip(batch, range(100, 0, -1)))
    with MmapCachedDataset(cache_path) as reader:
        assert reader.num_cached == 200 and all(sample_equal(reader[i], source[i]) for i in range(200))


def test_a_ragged_batch_the_heap_budget_cannot_take_whole_stores_what_fits(cache_path: str) -> None:
    # A batch whose values need more room than the budget has left is stored one row at a time (write_new_rows
    # declines before any heap grows): the values that fit are stored, the others served uncached and counted.
    # The largest values first: the cacheable rows, planned from the mean size of a few probes, do not all fit.
    source = [{"ids": torch.full((800 - 2 * i,), i, dtype=torch.int64)} for i in range(256)]
    with pytest.warns(UncachedFieldWarning):
        ds = MmapCachedDataset(cache_path, source, ragged=["ids"], max_bytes="300K")
        probed = ds.num_cached  # (the layout's probes)
        got = ds.__getitems__(list(range(ds.num_cacheable)))
    assert all(sample_equal(g, source[i]) for i, g in enumerate(got))
    uncached = int(ds._store.heap_counters[0][3])
    assert probed < ds.num_cached < ds.num_cacheable and ds.num_cached + uncached == ds.num_cacheable
    assert all(sample_equal(ds[i], source[i]) for i in range(256))
    ds.close()
    assert sum(os.path.getsize(os.path.join(cache_path, f)) for f in os.listdir(cache_path)) <= 300_000 + 64_000
