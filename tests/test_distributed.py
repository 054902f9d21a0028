"""Distributed use: ranks of one node share one cache and fill it cooperatively (``prefill``); several nodes each
build their own. Real torchrun jobs on the gloo backend; "nodes" are torchrun launches with their own
``MMAPCACHE_DIR`` (each node of a real cluster has its own /dev/shm). Caches here are made with ``ragged=None`` (the
creator stores sample 0 and no layout probes), so the shares each rank fills are exact."""

from __future__ import annotations

import collections
import multiprocessing
import os
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from helpers.processes import another_process, join_all, running
from helpers.sources import Counting, ImageLabels
from helpers.torchrun import TESTS, TIMEOUT, finish, results, torchrun, two_nodes
from mmapcache import MmapCachedDataset
from mmapcache.distributed import local_rank_and_size, prefill

N = 48


def calls(log: str) -> collections.Counter:
    with open(log) as f:
        return collections.Counter(int(line) for line in f)


def check_node(ranks: list[dict], log: str, node_dir: str) -> None:
    """One node's ranks shared one cache, filled it cooperatively, and read every sample right."""
    assert os.listdir(node_dir) == ["cache"], "the ranks of a node must share one cache directory"
    assert len({tuple(r["cache_id"]) for r in ranks}) == 1
    assert sorted(r["local_rank"] for r in ranks) == list(range(len(ranks)))
    assert all(r["local_world"] == len(ranks) for r in ranks)
    assert all(r["samples_ok"] and r["cached_after_prefill"] == N for r in ranks)
    counted = calls(log)
    # Each sample computed once per node; sample 0 also once per opening rank (the layout probe of the opener).
    assert sorted(counted) == list(range(N))
    assert all(counted[i] == 1 for i in range(1, N)), {i: c for i, c in counted.items() if c != 1}
    assert 1 <= counted[0] <= len(ranks)
    # Disjoint shares, strided by local rank; sample 0 was stored when the cache was created.
    for r in ranks:
        share = list(range(N))[r["local_rank"]::r["local_world"]]
        assert r["stored"] == len(share) - (0 in share)


def test_one_node_two_ranks_share_one_cache(shm_dir: str, tmp_path) -> None:
    node = os.path.join(shm_dir, "node0")
    out, log = tmp_path / "out", str(tmp_path / "calls0")
    out.mkdir()
    proc = torchrun(["--standalone", "--nproc-per-node=2", os.path.join(TESTS, "helpers", "dist_script.py"),
                     "--results", str(out), "--cache-name", "cache", "--calls", log, "--samples", str(N)],
                    {"MMAPCACHE_DIR": node})
    finish(proc)
    ranks = results(str(out))
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    assert all(r["all_reduce"] == 1 + 2 for r in ranks)
    check_node(ranks, log, node)


def test_two_nodes_each_build_their_own_cache(shm_dir: str, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    two_nodes(lambda node: [os.path.join(TESTS, "helpers", "dist_script.py"), "--results", str(out), "--cache-name",
                            "cache", "--calls", str(tmp_path / f"calls{node}"), "--samples", str(N)], shm_dir)
    ranks = results(str(out))
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and all(r["world"] == 4 for r in ranks)
    assert all(r["all_reduce"] == 1 + 2 + 3 + 4 for r in ranks)  # one job of 4 ranks, across both "nodes"
    assert sorted(os.listdir(shm_dir)) == ["node0", "node1"]
    for node_rank in (0, 1):
        on_node = [r for r in ranks if r["node"] == node_rank]
        assert len(on_node) == 2
        assert all(r["path"] == os.path.join(shm_dir, f"node{node_rank}", "cache") for r in on_node)
        check_node(on_node, str(tmp_path / f"calls{node_rank}"), os.path.join(shm_dir, f"node{node_rank}"))


# --- prefill without a process group (explicit ranks, or the environment) ------------------------------------------


def _prefill_rank(path: str, log: str, rank: int, world: int, barrier: multiprocessing.synchronize.Barrier) -> None:
    ds = MmapCachedDataset(path, Counting(ImageLabels(N, delay=0.002), log), ragged=None)
    barrier.wait(TIMEOUT)
    prefill(ds, rank=rank, world_size=world)
    # The cache-based barrier returned: every sample must be filled now, whoever filled it.
    if ds.num_cached != N:
        raise AssertionError(f"rank {rank}: prefill returned with {ds.num_cached} of {N} samples filled")
    ds.close()


def test_prefill_without_process_group_waits_on_the_cache(cache_path: str, tmp_path) -> None:
    log = str(tmp_path / "calls")
    MmapCachedDataset(cache_path, ImageLabels(N), ragged=None).close()  # created (sample 0 stored) before the ranks
    ctx = another_process()
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_prefill_rank, args=(cache_path, log, r, 2, barrier)) for r in range(2)]
    with running(procs):
        assert join_all(procs, TIMEOUT) == [0, 0]
    counted = calls(log)
    assert all(counted[i] == 1 for i in range(1, N)) and counted[0] == 2  # each rank probed sample 0 once


def _prefill_slow_rank(path: str, log: str, rank: int, patience: float) -> None:
    ds = MmapCachedDataset(path, Counting(ImageLabels(600, delay=0.01), log), ragged=None, fingerprint="slow")
    prefill(ds, rank=rank, world_size=2, patience=patience)
    ds.close()


def test_prefill_waits_for_a_live_peer_whose_batches_are_slow(cache_path: str, tmp_path) -> None:
    """Found by review: fill() stored a batch of up to 1,024 samples at its end, so a live peer computing one of slow
    samples showed no progress for longer than the patience, and the waiting rank computed its whole share again
    (645 of 645 twice, with the default 60 s). fill's batches take about half a second of the source at most now."""
    log = str(tmp_path / "calls")
    with MmapCachedDataset(cache_path, ImageLabels(600), ragged=None, fingerprint="slow") as ds:
        ds.fill(ds.cacheable_indices()[0::2])  # rank 0's share stored already (a resumed prefill)
    ctx = another_process()
    procs = [ctx.Process(target=_prefill_slow_rank, args=(cache_path, log, r, 2.0)) for r in (1, 0)]
    with running(procs):  # (rank 1: 300 samples of 10 ms, 3 s at least, against a patience of 2 s)
        assert join_all(procs, TIMEOUT) == [0, 0]
    counted = calls(log)
    assert sorted(counted) == list(range(1, 600, 2)) and max(counted.values()) == 1, counted


class _OneTooLarge(torch.utils.data.Dataset):
    """Ragged ids, sample 1's too large for the cache's max_bytes (served uncached, counted), 20 ms a sample."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __len__(self) -> int:
        return 300

    def __getitem__(self, i: int) -> dict[str, Any]:
        time.sleep(self.delay)
        return {"ids": torch.arange(200_000 if i == 1 else 5 + i % 7), "label": i}


def _prefill_heap_rank(path: str, log: str, rank: int, out: Any) -> None:
    ds = MmapCachedDataset(path, Counting(_OneTooLarge(0.02), log), fingerprint="big", max_bytes=400_000,
                           ragged=["ids"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (sample 1 served uncached, warned)
        prefill(ds, rank=rank, world_size=2)
    out.put((rank, ds.missing_indices().tolist()))
    ds.close()


def test_prefill_after_a_heap_once_ran_out_of_room_still_waits_for_a_live_peer(cache_path: str, tmp_path) -> None:
    """Found by review: once any sample had been served uncached for want of heap room (a counter of the cache's
    life), the barrier gave up on a peer after 1 s without progress, and a peer storing ragged batches of 64 slow
    samples was still at work: the rank's first epoch computed what the peer was computing. Only a heap that ran out
    of room during this prefill cuts the wait short."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with MmapCachedDataset(cache_path, _OneTooLarge(0), fingerprint="big", max_bytes=400_000,
                               ragged=["ids"]) as ds:
            ds[1]  # (too large: served uncached, and counted)
            assert ds.uncached_by_heap == 1
            ds.fill(ds.cacheable_indices()[0::2])  # rank 0's share stored already
    log, ctx = str(tmp_path / "calls"), another_process()
    out = ctx.Queue()
    procs = [ctx.Process(target=_prefill_heap_rank, args=(cache_path, log, r, out)) for r in (1, 0)]
    with running(procs):
        assert join_all(procs, TIMEOUT) == [0, 0]
    missing = dict(out.get(timeout=10) for _ in range(2))
    assert missing == {0: [1], 1: [1]}  # (only the sample no heap room holds)
    counted = calls(log)
    assert all(n == 1 for i, n in counted.items() if i != 1), counted


def test_prefill_fills_the_share_of_a_missing_peer_after_patience(cache_path: str, tmp_path) -> None:
    source = Counting(ImageLabels(N), str(tmp_path / "calls"))
    with MmapCachedDataset(cache_path, source, ragged=None) as ds:
        stored = prefill(ds, rank=0, world_size=3, patience=0.2)  # ranks 1 and 2 never come
        assert ds.num_cached == N and stored == N - 1
        assert sorted(calls(source.log)) == list(range(N)) and max(calls(source.log).values()) == 1


def test_prefill_without_barrier_fills_only_its_share(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, ImageLabels(N), ragged=None) as ds:
        assert prefill(ds, rank=1, world_size=4, barrier=False) == N // 4
        filled = [i for i in range(N) if ds.is_cached(i)]
        assert filled == sorted({0, *range(1, N, 4)})
        assert ds.prefill(rank=1, world_size=4, barrier=False) == 0  # already filled: nothing computed again


def test_prefill_respects_cache_indices(cache_path: str) -> None:
    chosen = np.array([5, 40, 17, 3, 22])
    with MmapCachedDataset(cache_path, ImageLabels(N), cache_indices=chosen) as ds:
        prefill(ds, rank=0, world_size=1)
        assert [i for i in range(N) if ds.is_cached(i)] == sorted(chosen.tolist())


def test_local_rank_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    assert local_rank_and_size() == (0, 1)
    monkeypatch.setenv("SLURM_LOCALID", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    assert local_rank_and_size() == (2, 4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert local_rank_and_size() == (1, 8)  # torchrun's variables win
    monkeypatch.setenv("LOCAL_RANK", "8")
    with pytest.raises(ValueError, match="LOCAL_RANK/LOCAL_WORLD_SIZE = 8/8"):
        local_rank_and_size()
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match="LOCAL_RANK='one' is not an integer"):
        local_rank_and_size()


def test_prefill_rejects_bad_ranks(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, ImageLabels(4)) as ds:
        with pytest.raises(TypeError, match="both rank= and world_size="):
            prefill(ds, rank=0)
        with pytest.raises(ValueError, match="rank/world_size = 2/2"):
            prefill(ds, rank=2, world_size=2)
        with pytest.raises(TypeError, match="rank must be an int"):
            prefill(ds, rank=0.5, world_size=2)
        with pytest.raises(ValueError, match="patience"):
            prefill(ds, rank=0, world_size=1, patience=-1)


@pytest.mark.parametrize("checkpoint", [4, 8])
def test_a_trainer_of_two_ranks_resumes_ds_loader_where_each_rank_was(cache_path: str, tmp_path,
                                                                       checkpoint: int) -> None:
    """Hugging Face's ``Trainer`` under torchrun, reading ``ds.loader`` by the guide's recipe
    (``helpers.trainer_recipe``): each rank reads its half of every epoch (disjoint, every sample once an epoch), and
    a job resumed from a checkpoint in the first epoch or in the second (step 4 or 8 of 6 an epoch) reads on each
    rank the batches that rank read after it in the uninterrupted job, with its losses."""
    pytest.importorskip("transformers")
    script = os.path.join(TESTS, "helpers", "trainer_script.py")
    runs = {}
    for name, resume in (("whole", []), ("resumed", ["--resume", str(tmp_path / "out" / f"checkpoint-{checkpoint}")])):
        (tmp_path / name).mkdir()
        finish(torchrun(["--standalone", "--nproc-per-node=2", script, cache_path, str(tmp_path / "out"),
                         str(tmp_path / name), *resume], {}))
        runs[name] = results(str(tmp_path / name))
    whole, resumed = runs["whole"], runs["resumed"]
    assert len(whole[0]["seen"]) == len(whole[1]["seen"]) == 12
    for epoch in range(2):
        read = [i for r in whole for batch in r["seen"][epoch * 6:epoch * 6 + 6] for i in batch]
        assert sorted(read) == list(range(48))  # (each rank its half)
    for before, after in zip(whole, resumed):
        assert after["seen"] == before["seen"][checkpoint:]
        assert after["losses"][checkpoint:] == pytest.approx(before["losses"][checkpoint:], rel=1e-5)
