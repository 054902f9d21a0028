"""Opening a cache again: a changed source is refused, not served stale; the first sample is computed once; a
cache replaced by another source's job is refused in every process; indices are range-checked before any cast."""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from helpers.processes import collect, join_all, running
from helpers.sources import ImageLabels, Scaled, sample_equal
from mmapcache import CacheFormatError, CacheMismatchError, CacheRemovedWarning, MmapCachedDataset, SampleNotCachedError

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _calls(log: str) -> list[int]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [int(line) for line in f]


# --- a changed source without a fingerprint ------------------------------------------------------------------------


def test_a_source_that_differs_only_in_its_last_bits_is_named_as_thread_dependent(cache_path: str) -> None:
    # Found by a user: a float pipeline whose result depends on torch's thread count (DataLoader workers run 1
    # thread, the main process 2) failed every reopen with a CacheMismatchError that spoke of a changed source.
    with MmapCachedDataset(cache_path, Scaled(8, scale=1.0)) as ds:
        ds.fill()
    with pytest.raises(CacheMismatchError, match=r"field '0' only in its last bits \(relative difference \de-0\d\): a "
                                                 r"float pipeline whose result depends on the number of threads.*"
                                                 r"fingerprint=.*torch\.set_num_threads\(1\)"):
        MmapCachedDataset(cache_path, Scaled(8, scale=1.0000001))


def test_changed_source_without_fingerprint_is_refused(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Scaled(8, scale=1.0)) as ds:
        ds.fill()
    with pytest.raises(CacheMismatchError, match=r"sample 0 computed now differs .* field '0'.*fingerprint=.*"
                                                 r"deterministic=False.*overwrite=True"):
        MmapCachedDataset(cache_path, Scaled(8, scale=2.0))
    # The unchanged source is accepted, and serves the stored samples.
    with MmapCachedDataset(cache_path, Scaled(8, scale=1.0)) as ds:
        assert sample_equal(ds[3], Scaled(8, scale=1.0)[3])
    # overwrite=True replaces it with the new source's samples.
    with MmapCachedDataset(cache_path, Scaled(8, scale=2.0), overwrite=True) as ds:
        assert sample_equal(ds[3], Scaled(8, scale=2.0)[3])


def test_nondeterministic_source_is_checked_for_layout_only(cache_path: str) -> None:
    MmapCachedDataset(cache_path, Scaled(8, scale=1.0)).close()
    with MmapCachedDataset(cache_path, Scaled(8, scale=3.0), deterministic=False) as ds:
        assert sample_equal(ds[0], Scaled(8, scale=1.0)[0])  # the stored copy, as declared acceptable
    with pytest.raises(CacheMismatchError, match="layout differs"):
        MmapCachedDataset(cache_path, ImageLabels(8), deterministic=False)  # uint8 where float32 was stored
    # Asked to overwrite, a source declared random gets a cache made with its options: the stored copies of the
    # source that made the cache as deterministic were kept and served (a source changed to augment at random was
    # never augmented). Reopened the same way, that cache is kept.
    with MmapCachedDataset(cache_path, Scaled(8, scale=3.0), deterministic=False, overwrite=True) as ds:
        assert sample_equal(ds[0], Scaled(8, scale=3.0)[0])
    with MmapCachedDataset(cache_path, Scaled(8, scale=4.0), deterministic=False, overwrite=True) as ds:
        assert sample_equal(ds[0], Scaled(8, scale=3.0)[0])  # (a random source: its stored draw, as declared)


def test_fingerprintless_opener_of_a_fingerprinted_cache_must_match_its_first_sample(cache_path: str) -> None:
    MmapCachedDataset(cache_path, Scaled(8, scale=1.0), fingerprint="A").close()
    # Another source without a fingerprint may not read, and so never writes, into A's cache.
    with pytest.raises(CacheMismatchError, match="differs from the stored copy"):
        MmapCachedDataset(cache_path, Scaled(8, scale=5.0))
    # The same source without its fingerprint matches sample for sample, and may use it.
    with MmapCachedDataset(cache_path, Scaled(8, scale=1.0)) as ds:
        assert sample_equal(ds[5], Scaled(8, scale=1.0)[5])
    # A source that cannot be compared (declared random) needs the fingerprint.
    with pytest.raises(CacheMismatchError, match="pass fingerprint='A'"):
        MmapCachedDataset(cache_path, Scaled(8, scale=1.0), deterministic=False)


class Captions(Dataset):
    """An image, a caption of varying length and its token ids (ragged fields, found by the creator's probes)."""

    def __len__(self) -> int:
        return 120

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"image": torch.full((3, 2, 2), i, dtype=torch.uint8), "caption": "ü" * (i % 5) + str(i),
                "ids": torch.arange(i % 9, dtype=torch.int64) + i}


@pytest.mark.parametrize("options", [{"max_bytes": 4000}, {"max_bytes": 20000}, {"stream": True, "max_bytes": 4000},
                                     {"stream": True, "max_bytes": 20000, "seed": 5},
                                     {"max_bytes": 4000, "cache_indices": list(range(0, 120, 2))}])
def test_the_same_arguments_reopen_a_cache_whose_budget_holds_ragged_fields(cache_path: str,
                                                                            options: dict[str, Any]) -> None:
    # The creator planned its slots from its probes' ragged sizes, which an opener cannot plan again: a restarted
    # script, or a rank arriving after the creator, with the same max_bytes was refused as another cache.
    stream = options.get("stream", False)
    with MmapCachedDataset(cache_path, Captions(), **options) as first:
        slots = first.num_cacheable
        assert stream or (0 < slots < 120) == (options["max_bytes"] == 4000)
        served = None if stream else first[3]
    with MmapCachedDataset(cache_path, Captions(), **options) as again:
        assert again.num_cacheable == slots and again.created is False
        assert stream or sample_equal(again[3], served)
    if not stream:  # another budget, or the budget without the chosen indices, caches other samples: refused
        with pytest.raises(CacheMismatchError):
            MmapCachedDataset(cache_path, Captions(), max_bytes=2000)
    if "cache_indices" in options:
        with pytest.raises(CacheMismatchError, match=r"\(a chosen subset\) in the cache"):
            MmapCachedDataset(cache_path, Captions(), max_bytes=4000)


# --- the first sample is computed once ------------------------------------------------------------------------------


def _racing_opener(path: str, n: int, log: str, go: str, fingerprint: str | None, out: Any) -> None:
    torch.set_num_threads(1)
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.001)
    with MmapCachedDataset(path, Scaled(n, log=log), fingerprint=fingerprint) as ds:
        ds.prefill(rank=out[0], world_size=2, barrier=False)
        out[1].put(ds.num_cached)


@pytest.mark.parametrize("fingerprint", ["v1", None])
def test_racing_ranks_compute_the_first_sample_once(shm_dir: str, tmp_path: Any, fingerprint: str | None) -> None:
    n = 60
    path, log, go = os.path.join(shm_dir, "c"), str(tmp_path / "calls"), str(tmp_path / "go")
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_racing_opener, args=(path, n, log, go, fingerprint, (rank, results)))
             for rank in range(2)]
    with running(procs):
        time.sleep(0.3)
        open(go, "w").close()  # start barrier: both open at once
        counts = collect(results, len(procs), 60)
        assert join_all(procs, 30) == [0, 0]
    calls = _calls(log)
    # One creator computed sample 0 (under the parent's lock); the other opened its cache. With a fingerprint the
    # other trusts it; without one it recomputes sample 0 (and up to 3 other stored samples) once to compare them
    # with the stored copies.
    compared = sorted(calls)
    for index in range(n):
        compared.remove(index)  # every sample computed once to fill the cache
    assert compared == [] if fingerprint else (0 in compared and len(set(compared)) == len(compared) <= 4)
    assert max(counts) <= n
    # A warm rerun: with a fingerprint, no source call at all; without, 4 (sample 0 and 3 others, compared).
    os.remove(log)
    MmapCachedDataset(path, Scaled(n, log=log), fingerprint=fingerprint).close()
    calls = _calls(log)
    assert calls == [] if fingerprint else (calls[0] == 0 and len(set(calls)) == len(calls) == 4)


# --- a cache replaced by another source's job -----------------------------------------------------------------------


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, ds: MmapCachedDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        return self.ds[i]


def test_replaced_cache_is_refused_by_spawned_workers_and_after_close(cache_path: str) -> None:
    a = MmapCachedDataset(cache_path, Scaled(16, scale=1.0), fingerprint="A")
    a.fill()
    # Another job replaces it: same length and layout, another source.
    MmapCachedDataset(cache_path, Scaled(16, scale=7.0), fingerprint="B", overwrite=True).fill()
    batches = iter(DataLoader(a, batch_size=4, num_workers=1, multiprocessing_context="spawn"))
    with pytest.raises(CacheMismatchError, match=r"replaced by one of another source.*fingerprint 'A' before, 'B' now"):
        next(batches)
    # Its worker stops now: left to the garbage collector (the exception's frames hold the iterator), it went on
    # fetching after the test had removed its directory, and created A's cache there again, left in /dev/shm.
    del batches
    gc.collect()
    # The dataset itself still maps A's (removed) files and serves A's samples; after close() it must reopen.
    assert sample_equal(a[3], Scaled(16, scale=1.0)[3])
    a.close()
    with pytest.raises(CacheMismatchError, match="replaced by one of another source"):
        a[3]


def test_removed_cache_is_recreated_by_spawned_workers(cache_path: str) -> None:
    source = ImageLabels(12)
    ds = MmapCachedDataset(cache_path, source)
    ds.fill()
    loader = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="spawn", persistent_workers=False)
    first = list(loader)
    _force_remove(cache_path)  # `mmapcache rm --force` while the dataset uses it
    # Every process that has the source keeps serving correct samples: the main process from its mapping, a
    # spawned worker (which opens the path anew) from a cache it creates again.
    second = list(loader)
    assert all(sample_equal(x, y) for x, y in zip(first, second))
    assert sample_equal(ds[7], source[7])
    assert os.path.isdir(cache_path)  # re-created by the worker
    ds.close()


@pytest.mark.parametrize("ragged", [False, True])
def test_every_read_path_serves_correct_samples_after_the_cache_is_removed(cache_path: str, ragged: bool) -> None:
    # Found by a user: after `rm --force` under a dataset with its source, ds.__getitems__, ds.loader and
    # DataLoader(ds) raised CacheFormatError ("lock was removed or replaced") at the first batch with a miss, and so
    # did ds[i] for any sample not stored before (the report's ds[70] was stored: a probe of the creator's).
    source = VaryingLength(40) if ragged else ImageLabels(40)
    ds = MmapCachedDataset(cache_path, source)
    for i in range(0, 40, 3):
        ds[i]
    missing = [int(i) for i in ds.missing_indices()]
    _force_remove(cache_path)
    with pytest.warns(CacheRemovedWarning, match=r"was removed or replaced while this process used it: the samples "
                                                 r"it lacks are computed from the source and served, not stored"):
        assert sample_equal(ds[missing[0]], source[missing[0]])
    batch = [*missing[1:4], 0]
    assert all(sample_equal(x, source[i]) for x, i in zip(ds.__getitems__(batch), batch))
    reads = [([i for b in ds.loader(batch_size=4) for i in b[1].tolist()] if not ragged else None),
             [i for b in DataLoader(ds, batch_size=4, collate_fn=list) for _, i in b],
             [i for b in DataLoader(ds, batch_size=4, collate_fn=list, num_workers=2,
                                    multiprocessing_context="fork") for _, i in b]]
    for labels in filter(None, reads):
        assert labels == [source[i][1] for i in range(40)]
    assert all(sample_equal(ds[i], source[i]) for i in range(40))
    assert not os.path.exists(cache_path)  # nothing wrote a cache back in its place, or into the removed one's files
    ds.close()


def _replace(path: str, n: int) -> None:
    """`mmapcache rm --force` under the users of the cache at ``path``, then a new cache of the same source there."""
    _force_remove(path)
    MmapCachedDataset(path, ImageLabels(n)).close()


def _filled_rows(ds: MmapCachedDataset) -> int:
    """Rows filled in the maps ``ds`` holds (the removed cache's, after a removal)."""
    return ds._store.state.count_filled()


@pytest.mark.parametrize("workers", [0, 2])
def test_after_a_removal_and_a_new_cache_old_readers_store_nothing_into_the_removed_one(cache_path: str,
                                                                                         workers: int) -> None:
    # Found by a hostile suite: forked DataLoader workers (their writer lock is opened by path after the fork) and
    # a reader that had not written before the removal took the *new* cache's lock file, passed the "removed or
    # replaced" check (its link count is 1) and stored their misses into the old, deleted maps: 505 -> 1,500 rows
    # with 2 workers, 505 -> 704 for a reader, with no CacheRemovedWarning; the deleted pages grew until the
    # process exited. Every sample is still served right; nothing more goes into the removed cache.
    n, source = 120, ImageLabels(120)
    with MmapCachedDataset(cache_path, source) as filler:
        filler.fill(range(0, n, 3))
    ds = MmapCachedDataset(cache_path, source)  # a reader that never wrote: it has no lock file open
    before = _filled_rows(ds)
    assert sample_equal(ds[0], source[0])  # (a hit)
    _replace(cache_path, n)
    with pytest.warns(CacheRemovedWarning, match="was removed or replaced while this process used it"):
        got = [s for b in DataLoader(ds, batch_size=8, collate_fn=list, num_workers=workers,
                                     multiprocessing_context="fork" if workers else None) for s in b]
        if workers:
            ds[1]  # (a worker's warning stays in the worker: the main process's first miss warns here)
    assert all(sample_equal(x, source[i]) for i, x in enumerate(got))
    assert _filled_rows(ds) == before, "misses were stored into the removed cache's maps"
    with MmapCachedDataset(cache_path) as new:
        assert new.num_cached <= 8  # the new cache holds what its creator probed, nothing of the old readers'
    ds.close()


def test_fill_and_prefill_of_a_removed_cache_raise_instead_of_storing_into_it(cache_path: str) -> None:
    # Found by a hostile suite: after `rm --force` and a new cache at the path, fill() of the old dataset returned a
    # count (99) and prefill() reported success while the new cache stayed empty; after `rm --force` alone, fill()
    # of rows the removed maps already held returned 0. The documented answer is CacheFormatError.
    n = 60
    ds = MmapCachedDataset(cache_path, ImageLabels(n))
    ds.fill(range(30))
    _force_remove(cache_path)
    with pytest.raises(CacheFormatError, match=r"was removed .* while this process had it open"):
        ds.fill(range(30))  # all held by the removed maps: nothing to compute, still no cache to fill
    MmapCachedDataset(cache_path, ImageLabels(n)).close()
    before = _filled_rows(ds)
    for fill in (ds.fill, lambda: ds.prefill(rank=0, world_size=1)):
        with pytest.raises(CacheFormatError, match="open the dataset again"):
            fill()
    assert _filled_rows(ds) == before
    ds.close()
    with MmapCachedDataset(cache_path, ImageLabels(n)) as again:
        assert again.fill() > 0 and again.num_cached == n


class VaryingLength(Dataset):
    """``(int64 tensor of 1 + i % 5 values, label)``: a ragged field."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.arange(1 + i % 5, dtype=torch.int64) * i, i % 7


def _force_remove(path: str) -> None:
    subprocess.run([sys.executable, "-m", "mmapcache", "rm", "--force", path], env=ENV, check=True, timeout=60)


# --- indices and counts ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["getitems", "refresh", "fill", "missing"])
def test_huge_unsigned_index_does_not_wrap(cache_path: str, call: str) -> None:
    with MmapCachedDataset(cache_path, ImageLabels(8)) as ds:
        huge = np.array([2**64 - 1], np.uint64)
        with pytest.raises(IndexError, match="18446744073709551615 is out of range"):
            {"getitems": ds.__getitems__, "refresh": lambda i: ds.refresh(indices=i), "fill": ds.fill,
             "missing": ds.missing_indices}[call](huge)
        with pytest.raises(IndexError, match="out of range"):
            ds.__getitems__([2**70])  # a Python int beyond int64
        with pytest.raises(IndexError):
            ds[np.uint64(2**64 - 1)]
        assert sample_equal(ds.__getitems__(np.array([7], np.uint64))[0], ImageLabels(8)[7])


def test_num_cached_counts_samples_not_rows(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, ImageLabels(10), variants=4) as ds:
        for epoch in range(4):
            ds.set_epoch(epoch)
            ds.fill()
        assert ds.num_cached == 10 and len(ds) == 10


def test_uncacheable_index_without_source_names_the_real_fix(cache_path: str) -> None:
    MmapCachedDataset(cache_path, ImageLabels(20), cache_indices=[0, 1, 2]).close()
    with MmapCachedDataset(cache_path) as ds:
        with pytest.raises(SampleNotCachedError, match=r"not cacheable .* chose 3 of 20 .* MmapCachedDataset\(path, "
                                                      r"dataset\)") as info:
            ds[10]
        assert "mmapcache build" not in str(info.value)  # a build can never fill an index the cache cannot hold


def test_refresh_takes_numpy_fractions(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, ImageLabels(10)) as ds:
        ds.fill()
        assert ds.refresh(fraction=np.float32(0.5)) == 5
        assert ds.refresh(fraction=np.float64(1.0)) == 5


def test_created_says_who_made_the_cache(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, ImageLabels(8), ragged=None) as first:
        assert first.created and first.num_cached == 1  # the first sample, stored while creating the cache
    with MmapCachedDataset(cache_path, ImageLabels(8)) as again, MmapCachedDataset(cache_path) as reader:
        assert not again.created and not reader.created


class _Typed(torch.utils.data.Dataset):
    """Returns a Parameter, a tensor requiring grad and an IntEnum: what a hit can never return."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        import enum

        label = enum.IntEnum("Label", "A B C D")(i + 1)
        return torch.nn.Parameter(torch.full((3,), float(i))), torch.ones(2, requires_grad=True) * i, label


def test_a_miss_returns_what_a_hit_returns(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, _Typed()) as ds:
        miss = ds[2]
        hit = ds[2]
    for a, b in zip(miss, hit):
        assert type(a) is type(b), (type(a), type(b))
    assert type(miss[0]) is torch.Tensor and not miss[1].requires_grad and type(miss[2]) is int
    assert sample_equal(miss, hit)
