"""Refresh: stale rows are recomputed on access (``stale="recompute"``) or served until rewritten (``"serve"``);
rewrites racing reads never show a half-written sample; a writer killed mid-rewrite is recovered from."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
from typing import Any

import numpy as np
import pytest

from helpers.feature_workers import (
    RandomAugment,
    Versioned,
    check_loop,
    check_versioned,
    die_mid_write,
    read_calls,
    rewrite_forever,
    rewrite_loop,
    versioned_sample,
    wait_for,
)
from helpers.processes import another_process, join_all
from helpers.sources import sample_equal
from mmapcache import MmapCachedDataset, SampleNotCachedError

SHAPE = (3, 64, 64)


def test_recompute_calls_the_source_again_and_stores_the_new_version(cache_path: str, tmp_path: Any) -> None:
    log = str(tmp_path / "calls")
    with MmapCachedDataset(cache_path, RandomAugment(8, log)) as ds:
        ds.fill()
        before = [ds[i] for i in range(8)]
        assert sorted(read_calls(log)) == list(range(8))
        assert ds.refresh(indices=[2, 5]) == 2
        after = [ds[i] for i in range(8)]
        calls = read_calls(log)
        assert sorted(calls[8:]) == [2, 5]  # exactly the refreshed samples were computed again
        for i in range(8):
            assert sample_equal(after[i], before[i]) == (i not in (2, 5))
        again = [ds[i] for i in range(8)]
        assert len(read_calls(log)) == 10  # the new versions were stored
        assert all(sample_equal(a, b) for a, b in zip(again, after))


def test_recompute_through_getitems(cache_path: str, tmp_path: Any) -> None:
    log = str(tmp_path / "calls")
    with MmapCachedDataset(cache_path, RandomAugment(8, log)) as ds:
        ds.fill()
        before = ds.__getitems__(list(range(8)))
        ds.refresh(indices=[1, 6])
        after = ds.__getitems__(list(range(8)))
        assert sorted(read_calls(log)[8:]) == [1, 6]
        assert [not sample_equal(a, b) for a, b in zip(before, after)] == [i in (1, 6) for i in range(8)]


def test_serve_keeps_the_old_version_until_fill_rewrites_it(cache_path: str, tmp_path: Any) -> None:
    log = str(tmp_path / "calls")
    with MmapCachedDataset(cache_path, RandomAugment(8, log), stale="serve") as ds:
        ds.fill()
        before = [ds[i] for i in range(8)]
        assert ds.refresh(indices=[3]) == 1
        assert ds.refresh(indices=[3]) == 0  # already stale
        served = ds[3]
        assert sample_equal(served, before[3]) and len(read_calls(log)) == 8  # stale, still served, no call
        assert sample_equal(ds.__getitems__([3])[0], before[3])
        assert ds.fill() == 1  # fill rewrites the stale row, and only it
        assert read_calls(log)[8:] == [3]
        fresh = ds[3]
        assert not sample_equal(fresh, before[3])
        assert ds.fill() == 0


def test_refresh_fraction_is_seeded_and_marks_that_share(cache_path: str, tmp_path: Any) -> None:
    log = str(tmp_path / "calls")
    with MmapCachedDataset(cache_path, RandomAugment(40, log), seed=5) as ds:
        ds.fill()
        stale_a = _marked(ds, 0.25)
        assert len(stale_a) == 10
    other = cache_path + "-b"
    with MmapCachedDataset(other, RandomAugment(40, log), seed=5, delete_on_close=True) as ds:
        ds.fill()
        assert _marked(ds, 0.25) == stale_a  # same seed and epoch, same rows
        ds.set_epoch(1)
        ds.refresh(fraction=0.25)
        assert len(np.flatnonzero(ds._store.state.stale_mask())) > 10  # another epoch picks other rows too


def _marked(ds: MmapCachedDataset, fraction: float) -> list[int]:
    ds.refresh(fraction=fraction)
    return np.flatnonzero(ds._store.state.stale_mask()).tolist()


def test_refresh_rejects_bad_arguments(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, RandomAugment(4)) as ds:
        with pytest.raises(TypeError, match="exactly one of fraction= or indices="):
            ds.refresh()
        with pytest.raises(ValueError, match=r"fraction must be a number in \[0, 1\]"):
            ds.refresh(fraction=1.5)
        with pytest.raises(IndexError, match="out of range"):
            ds.refresh(indices=[9])
    with pytest.raises(ValueError, match="stale must be one of 'recompute', 'serve'"):
        MmapCachedDataset(cache_path, RandomAugment(4), stale="keep")


def test_refresh_of_a_partial_cache_ignores_pass_through_indices(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, RandomAugment(8), cache_indices=[1, 4]) as ds:
        ds.fill()
        assert ds.refresh(indices=[0, 1, 2, 3, 4]) == 2


def test_rewrites_racing_reads_never_show_a_torn_sample(cache_path: str) -> None:
    """Writers mark samples stale and rewrite them while ``stale="serve"`` readers keep reading them (so the
    rewrite races the copy); every byte of a sample is a function of (index, version), so a torn copy shows."""
    n = 6  # few samples: writers and readers collide on the same rows constantly
    with MmapCachedDataset(cache_path, Versioned(n, SHAPE), stale="serve", deterministic=False) as ds:
        ds.fill()
    ctx = another_process()
    barrier = cache_path + ".go"
    results = ctx.Queue()
    procs = [ctx.Process(target=rewrite_loop, args=(cache_path, n, SHAPE, w, barrier, 20_000, 6.0, results))
             for w in range(2)]
    procs += [ctx.Process(target=check_loop, args=(cache_path, n, SHAPE, r, barrier, 200_000, 6.0, results))
              for r in range(2)]
    reports = _run(procs, barrier, results)
    writers = [r for r in reports if r[0] == "writer"]
    readers = [r for r in reports if r[0] == "reader"]
    assert all(rounds > 50 and stored > 50 for _, _, rounds, stored in writers), writers
    assert all(checks > 2_000 for _, _, checks, _ in readers), readers
    assert sum(torn for _, _, _, torn in readers) == 0, readers
    with MmapCachedDataset(cache_path, Versioned(n, SHAPE), stale="serve", deterministic=False) as ds:
        assert all(check_versioned(ds[i], i) for i in range(n))


def _run(procs: list[Any], barrier: str, results: Any, timeout: float = 90) -> list[tuple]:
    for p in procs:
        p.start()
    try:
        with open(barrier, "w"):
            pass
        reports = [results.get(timeout=timeout) for _ in procs]
    except queue.Empty:
        pytest.fail("a worker process did not report in time")
    finally:
        join_all(procs, 30)
        if os.path.exists(barrier):
            os.unlink(barrier)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return reports


def test_writer_killed_mid_rewrite_is_recovered(cache_path: str, tmp_path: Any) -> None:
    """A writer SIGKILLed halfway through a row's bytes leaves an odd counter: readers treat the row as a miss
    and recompute it, the lock is free again, and writers go on."""
    n, shape = 4, (3, 512, 512)
    log = str(tmp_path / "calls")
    with MmapCachedDataset(cache_path, Versioned(n, shape), stale="serve", deterministic=False) as ds:
        ds.fill()
        row = ds._rows.row(2, ds.epoch)
        seq_before = int(ds._store.state.seq_np[row])
        ctx = another_process()
        started = str(tmp_path / "started")
        victim = ctx.Process(target=die_mid_write, args=(cache_path, n, shape, 2, started))
        victim.start()
        try:
            assert wait_for(started, 60), "the writer never reached the middle of its write"
            # Mid-write: the counter is odd, so readers do not copy the half-written bytes.
            assert int(ds._store.state.seq_np[row]) == seq_before + 1
            os.kill(victim.pid, signal.SIGKILL)
        finally:
            victim.join(timeout=30)
        assert victim.exitcode == -signal.SIGKILL
        assert int(ds._store.state.seq_np[row]) % 2 == 1  # the dead writer's odd counter stays
        assert not ds.is_cached(2)
        recovering = MmapCachedDataset(cache_path, Versioned(n, shape, base=9_000_000, log=log), stale="serve",
                                       deterministic=False)
        sample = recovering[2]  # a miss: recomputed and stored (the lock was released by the kernel)
        assert check_versioned(sample, 2) and sample[2] > 9_000_000 and read_calls(log).count(2) == 1
        assert int(ds._store.state.seq_np[row]) % 2 == 0 and ds.is_cached(2)
        assert sample_equal(ds[2], sample)  # the other process now reads the recomputed version
        assert all(check_versioned(ds[i], i) for i in range(n))
        recovering.close()


def test_writer_killed_at_random_during_large_rewrites(cache_path: str, tmp_path: Any) -> None:
    """A real writer (``refresh`` + ``fill`` in a loop, 12 MB rows) killed at arbitrary moments: afterwards every
    sample read is consistent and a new writer can fill the cache again."""
    n, shape = 3, (3, 2048, 2048)
    with MmapCachedDataset(cache_path, Versioned(n, shape), stale="serve", deterministic=False) as ds:
        ds.fill()
        ctx = multiprocessing.get_context("fork")
        odd_seen = 0
        rng = np.random.default_rng(0)
        for attempt in range(6):
            ready = str(tmp_path / f"ready{attempt}")
            writer = ctx.Process(target=rewrite_forever, args=(cache_path, n, shape, ready, 60.0))
            writer.start()
            try:
                assert wait_for(ready, 60)
                wait_for(ready + ".never", float(rng.uniform(0.05, 0.3)))  # let it rewrite a while
                os.kill(writer.pid, signal.SIGKILL)
            finally:
                writer.join(timeout=30)
            assert writer.exitcode == -signal.SIGKILL
            odd_seen += int((ds._store.state.seq_np % 2 == 1).any())
            # Whatever the kill interrupted, what readers get is whole.
            assert all(check_versioned(ds[i], i) for i in range(n))
            assert all(check_versioned(s, i) for i, s in zip(range(n), ds.__getitems__(list(range(n)))))
            ds.fill()
            assert ds.num_cached == n and not (ds._store.state.seq_np % 2 == 1).any()
    # Not asserted (timing-dependent), reported: how often the kill landed inside a row's write.
    print(f"kills mid-write: {odd_seen} of 6")


def test_versioned_sample_detects_mixed_versions() -> None:
    """The torn-sample detector itself: a sample mixing two versions' bytes is rejected."""
    a = versioned_sample(3, 10, SHAPE)
    b = versioned_sample(3, 11, SHAPE)
    assert check_versioned(a, 3) and check_versioned(b, 3)
    mixed = a[0].clone()
    mixed.view(-1)[6000:] = b[0].view(-1)[6000:]
    assert not check_versioned((mixed, 3, 10), 3)
    assert not check_versioned((b[0], 3, 10), 3)  # header and version field disagree
    assert not check_versioned(a, 4)


def test_fill_without_a_source_says_it_needs_one(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, RandomAugment(6), ragged=None) as ds:  # no probes: sample 0 stored
        ds.fill(range(3))
    with MmapCachedDataset(cache_path) as ds:
        assert ds.fill(range(3)) == 0  # nothing to do: no source needed
        needs = r"fill\(\) needs the source dataset: 3 sample\(s\) .* \(first: 3\)"
        with pytest.raises(SampleNotCachedError, match=needs):
            ds.fill()
        ds.refresh(indices=[1])
        with pytest.raises(SampleNotCachedError, match=r"\(first: 1\)"):
            ds.fill(range(3))
