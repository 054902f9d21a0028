"""Node shares: each node caches only its part of the dataset, and ``ds.sampler()`` keeps its ranks on it.

The multi-node test is a real torchrun job on gloo over loopback: two launches with ``--nnodes=2``, each with its
own ``MMAPCACHE_DIR`` (a real cluster's nodes each have their own /dev/shm), two ranks each.
"""

from __future__ import annotations

import collections
import os
import subprocess

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from helpers.sources import Counting, ImageLabels, sample_equal
from helpers.torchrun import TESTS, results, two_nodes
from mmapcache import CacheMismatchError, DistributedOrderWarning, MmapCachedDataset, ShareSampler, describe
from mmapcache.store.share import Share, node_of_process, share_of

N = 50


# --- the partition --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length, nodes", [(50, 2), (50, 3), (7, 7), (1000, 64), (5, 1)])
def test_shares_are_disjoint_near_equal_and_cover_the_dataset(length: int, nodes: int) -> None:
    for generation in (0, 1):
        parts = [share_of(length, nodes, k, seed=11, generation=generation) for k in range(nodes)]
        joined = np.concatenate(parts)
        assert sorted(joined.tolist()) == list(range(length))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert all(len(p) == Share(k, nodes, 11).size(length) for k, p in enumerate(parts))
        assert all(np.array_equal(p, np.sort(p)) for p in parts)
    if nodes > 1 and length > 10:
        assert not np.array_equal(share_of(length, nodes, 0, 11, 0), share_of(length, nodes, 0, 11, 1))
        assert not np.array_equal(share_of(length, nodes, 0, 11, 0), share_of(length, nodes, 0, 12, 0))


def test_share_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"node 2 of 2: need 0 <= node < nodes"):
        Share(2, 2)
    with pytest.raises(ValueError, match="rotate_every must be None or an integer >= 1"):
        Share(0, 2, rotate_every=0)
    with pytest.raises(TypeError, match="share node must be an int"):
        Share(True, 2)  # type: ignore[arg-type]


def test_node_of_the_process_from_torchrun_slurm_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "RANK", "SLURM_NODEID", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    assert node_of_process() == (0, 1)
    monkeypatch.setenv("SLURM_NODEID", "3")
    monkeypatch.setenv("SLURM_NNODES", "8")
    assert node_of_process() == (3, 8)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "9")
    assert node_of_process() == (2, 4)  # torchrun's variables win; RANK // LOCAL_WORLD_SIZE without GROUP_RANK
    monkeypatch.setenv("GROUP_RANK", "1")
    assert node_of_process() == (1, 4)
    monkeypatch.setenv("GROUP_RANK", "4")
    with pytest.raises(ValueError, match=r"GROUP_RANK, of WORLD_SIZE/LOCAL_WORLD_SIZE nodes = 4/4"):
        node_of_process()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="WORLD_SIZE=16 is not a multiple of LOCAL_WORLD_SIZE=3"):
        node_of_process()


# --- one node's cache -----------------------------------------------------------------------------------------------


def test_a_node_caches_only_its_share(cache_path: str, tmp_path) -> None:
    source = Counting(ImageLabels(N), str(tmp_path / "calls"))
    share = share_of(N, 3, 1, seed=5)
    with MmapCachedDataset(cache_path, source, node_share=(1, 3), seed=5, fingerprint="f") as ds:
        assert ds.share == Share(1, 3, 5) and ds.num_cacheable == len(share)
        assert ds.cacheable_indices().tolist() == share.tolist()
        ds.prefill(rank=0, world_size=1)
        assert ds.num_cached == len(share)
        assert sorted(source.calls()) == share.tolist()  # the source computed nothing outside the share
        outside = next(i for i in range(N) if i not in set(share.tolist()))
        assert sample_equal(ds[outside], source.inner[outside]) and not ds.is_cached(outside)  # passes through
        info = describe(cache_path)
        assert info["share"]["node"] == 1 and info["share"]["nodes"] == 3 and info["share"]["size"] == len(share)
        assert f"node 1 of 3: {len(share)} of {N} indices" in info["share"]["text"]
    with MmapCachedDataset(cache_path, source, node_share=(1, 3), seed=5, fingerprint="f") as again:
        assert again.num_cached == len(share)  # the same share: reused


@pytest.mark.parametrize("other, what", [((0, 3), "node 0 of 3"), ((1, 2), "node 1 of 2"), (False, None)])
def test_reopening_as_another_node_is_a_mismatch_naming_the_fix(cache_path: str, other, what) -> None:
    MmapCachedDataset(cache_path, ImageLabels(N), node_share=(1, 3), fingerprint="f").close()
    if what is None:  # no share asked: the recorded one is used, as cache_indices are
        with MmapCachedDataset(cache_path, ImageLabels(N), fingerprint="f") as ds:
            assert ds.share == Share(1, 3)
        return
    with pytest.raises(CacheMismatchError, match=rf"the share node 1 of 3: .* in the cache, the share {what}: .* "
                                                  r"asked for .* node-local MMAPCACHE_DIR"):
        MmapCachedDataset(cache_path, ImageLabels(N), node_share=other, fingerprint="f")


def test_share_options_that_cannot_work_are_refused(cache_path: str) -> None:
    with pytest.raises(ValueError, match="rotate_every rotates a node share"):
        MmapCachedDataset(cache_path, ImageLabels(N), rotate_every=2)
    with pytest.raises(ValueError, match="node_share and cache_indices both choose"):
        MmapCachedDataset(cache_path, ImageLabels(N), node_share=(0, 2), cache_indices=[1, 2])
    with pytest.raises(ValueError, match="a share that rotates must fit whole"):
        MmapCachedDataset(cache_path, ImageLabels(N), node_share=(0, 2), rotate_every=1, max_bytes=3000)
    with pytest.raises(TypeError, match=r"node_share must be True, False or \(node, nodes\)"):
        MmapCachedDataset(cache_path, ImageLabels(N), node_share=2)


# --- the sampler ------------------------------------------------------------------------------------------------------


def _job(path_of, nodes: int, local: int, length: int, **sampler_kwargs) -> list[list[ShareSampler]]:
    """Samplers of a simulated job: ``nodes`` caches, ``local`` ranks each."""
    job = []
    for node in range(nodes):
        ds = MmapCachedDataset(path_of(node), ImageLabels(length), node_share=(node, nodes), fingerprint="f")
        job.append([ds.sampler(rank=r, world_size=local, **sampler_kwargs) for r in range(local)])
    return job


@pytest.mark.parametrize("length", [48, 50, 47])
def test_every_index_is_read_once_per_epoch_across_the_job(shm_dir: str, length: int) -> None:
    job = _job(lambda node: os.path.join(shm_dir, f"node{node}", "cache"), 2, 2, length)
    orders = []
    for epoch in range(3):
        reads = collections.Counter()
        steps = set()
        for node, samplers in enumerate(job):
            share = set(share_of(length, 2, node, 0).tolist())
            for sampler in samplers:
                sampler.set_epoch(epoch)
                indices = list(sampler)
                assert set(indices) <= share, "a rank read outside its node's share"
                assert len(indices) == len(sampler)
                steps.add(len(indices))
                reads.update(indices)
        assert len(steps) == 1, "every rank of the job takes the same number of steps"
        assert sorted(reads) == list(range(length))
        padding = sum(reads.values()) - length
        assert padding == 4 * -(-length // 4) - length  # DistributedSampler's padding: up to one per rank
        orders.append(list(job[0][0]))
    assert orders[0] != orders[1] != orders[2], "a fresh shuffle each epoch"
    for samplers in job:
        samplers[0].ds.close()


def test_drop_last_cuts_as_distributed_sampler_does(shm_dir: str) -> None:
    job = _job(lambda node: os.path.join(shm_dir, f"n{node}"), 2, 2, 50, drop_last=True)
    reads = [i for samplers in job for s in samplers for i in s]
    assert len(reads) == 4 * (50 // 4) and len(set(reads)) == len(reads)
    for samplers in job:
        samplers[0].ds.close()


def test_a_share_sampler_given_the_jobs_rank_and_size_says_it_takes_the_nodes(
        cache_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # As one passes them to DistributedSampler: rank 2 of 4 on node 1 of 2 was read as local rank 2 of 4, and each
    # node's two ranks read half of its share (49 of 101 indices never read in an epoch, in a new-user trial).
    for name, value in (("RANK", "2"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    with MmapCachedDataset(cache_path, ImageLabels(N), node_share=(1, 2), fingerprint="f") as ds:
        with pytest.raises(ValueError, match=r"sampler\(rank=2, world_size=4\) on a node share takes this node's "
                                             r"ranks, not the job's \(RANK/WORLD_SIZE\): here rank=0, world_size=2 "
                                             r"\(LOCAL_RANK/LOCAL_WORLD_SIZE\)"):
            ds.sampler(rank=2, world_size=4)
        assert ds.sampler().epoch_indices().tolist() == ds.sampler(rank=0, world_size=2).epoch_indices().tolist()
        mine = {i for r in range(2) for i in ds.sampler(rank=r, world_size=2)}
        assert mine == set(share_of(N, 2, 1, 0).tolist())  # the node's two ranks read its whole share


def test_the_loader_without_a_sampler_over_a_share_says_to_pass_the_shares(cache_path: str) -> None:
    # ds.loader(shuffle=True), the guide's loader for every launcher, reads the job's split of the whole dataset:
    # over a node share, half of a rank's samples (of 2 nodes) were computed from the source every epoch, silently.
    with MmapCachedDataset(cache_path, ImageLabels(N), node_share=(1, 2), fingerprint="f") as ds:
        with pytest.warns(DistributedOrderWarning, match=r"ds.loader\(\) without a sampler over the node share at "
                                                         r".*about 1 in 2 of this rank's samples lie outside this "
                                                         r"node's share .*pass sampler=ds.sampler\(shuffle=True\)"):
            assert sum(len(labels) for _, labels in ds.loader(batch_size=8, shuffle=True)) == N
        sampler = ds.sampler()  # no warning with it (the suite turns warnings into errors)
        assert sum(len(labels) for _, labels in ds.loader(batch_size=8, sampler=sampler)) == len(sampler)
        assert set(sampler.epoch_indices().tolist()) == set(share_of(N, 2, 1, 0).tolist())


def test_inspect_maps_the_indices_a_rotated_shares_rows_hold(cache_path: str) -> None:
    # The fill map was drawn from generation 0's partition even when the rows held a later one's samples (a
    # new-user trial): it showed indices filled that no row held. Once the rows hold another generation, it shows
    # the indices their keys name.
    n = 32
    with MmapCachedDataset(cache_path, ImageLabels(n), node_share=(0, 2), rotate_every=1, fingerprint="f") as ds:
        first = set(ds.cacheable_indices().tolist())
        assert describe(cache_path)["fill_map"] == "".join(
            ("@" if ds.is_cached(i) else " ") if i in first else "_" for i in range(n))  # generation 0, partly filled
        ds.set_epoch(1)
        ds.fill(ds.missing_indices().tolist())
        held = set(ds.cacheable_indices().tolist())
        assert held != first and ds.num_cached == len(held)
    assert describe(cache_path)["fill_map"] == "".join("@" if i in held else "_" for i in range(n))


def test_without_a_share_it_is_a_distributed_sampler(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, ImageLabels(N)) as ds:
        samplers = [ds.sampler(rank=r, world_size=3, seed=1) for r in range(3)]
        reads = [i for s in samplers for i in s]
        assert sorted(set(reads)) == list(range(N)) and len(reads) == 3 * -(-N // 3)
        assert list(samplers[0]) == samplers[0].epoch_indices().tolist()


def test_the_loader_over_the_sampler_gathers_the_same_batches(cache_path: str) -> None:
    source = ImageLabels(N)
    with MmapCachedDataset(cache_path, source, node_share=(0, 2)) as ds:
        sampler = ds.sampler(rank=1, world_size=2)
        sampler.set_epoch(4)
        fast = list(ds.loader(batch_size=5, sampler=sampler))
        plain = list(DataLoader(ds, batch_size=5, sampler=sampler))
        assert len(fast) == len(plain) == -(-len(sampler) // 5)
        for (a, b), (c, d) in zip(fast, plain):
            assert torch.equal(a, c) and torch.equal(b, d)
        labels = [label for _, batch in fast for label in batch.tolist()]
        assert labels == [source[i][1] for i in sampler.epoch_indices().tolist()]


# --- rotation ---------------------------------------------------------------------------------------------------------


def test_rotation_moves_the_share_and_never_serves_another_generations_sample(cache_path: str, tmp_path) -> None:
    source = Counting(ImageLabels(N), str(tmp_path / "calls"))
    refills = []
    # ragged=None: the creator stores the first sample only (no layout probes), so each refill is counted exactly.
    with MmapCachedDataset(cache_path, source, node_share=(0, 2), rotate_every=2, fingerprint="f",
                           ragged=None) as ds:
        shares = [share_of(N, 2, 0, 0, g) for g in range(3)]
        for epoch in range(6):
            sampler = ds.sampler(rank=0, world_size=1)
            sampler.set_epoch(epoch)
            share = shares[epoch // 2]
            assert ds.cacheable_indices().tolist() == share.tolist()
            before = len(source.calls())
            ds.prefill(rank=0, world_size=1)
            refills.append(len(source.calls()) - before)
            assert ds.num_cached == len(share)
            got = [int(label) for _, labels in ds.loader(batch_size=7, sampler=sampler) for label in labels]
            assert got == [source.inner[i][1] for i in sampler.epoch_indices().tolist()]
            assert all(sample_equal(ds[i], source.inner[i]) for i in range(N))  # any index, any generation
    # Each generation's first epoch refills the share (but for indices the previous generation held in the same
    # slot); its second epoch reads it warm. Epoch 0 filled all but the sample stored at creation.
    assert refills[1] == refills[3] == refills[5] == 0
    assert refills[0] == len(shares[0]) - 1 and 0 < refills[2] <= len(shares[1]) and 0 < refills[4] <= len(shares[2])


# --- a real two-node job ----------------------------------------------------------------------------------------------


def test_two_nodes_cache_disjoint_shares_and_read_only_them(shm_dir: str, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    two_nodes(lambda node: [os.path.join(TESTS, "helpers", "share_script.py"), "--results", str(out),
                            "--calls", str(tmp_path / f"calls{node}"), "--samples", str(N), "--epochs", "2"], shm_dir)
    ranks = results(str(out))
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(r["correct"] for r in ranks), "a batch differed from the source"
    shares = {r["node"]: r["share"] for r in ranks}
    assert sorted(shares) == [0, 1] and all(r["nodes"] == 2 for r in ranks)
    assert not set(shares[0]) & set(shares[1]) and sorted(shares[0] + shares[1]) == list(range(N))
    for r in ranks:
        share = set(shares[r["node"]])
        assert r["cacheable"] == shares[r["node"]] and r["num_cached"] == len(share)
        assert set(r["stored_keys"]) == share, "a node's cache holds exactly its share"
        for epoch in r["epochs"]:
            assert set(epoch) <= share, "a rank read outside its node's share"
        assert r["calls_after_epochs"] == r["calls_after_prefill"], "warm epochs read the source"
    for epoch in range(2):
        reads = collections.Counter(i for r in ranks for i in r["epochs"][epoch])
        assert sorted(reads) == list(range(N)) and sum(reads.values()) == 4 * -(-N // 4)
    calls = [i for node in (0, 1) for i in Counting(ImageLabels(N), str(tmp_path / f"calls{node}")).calls()]
    assert sorted(set(calls)) == list(range(N))
    assert len(calls) == N, "with a fingerprint, the source is called once per index across the cluster"
    assert sorted(os.listdir(os.path.join(shm_dir, "node0"))) == ["cache"]


# --- the build command ------------------------------------------------------------------------------------------------


def test_build_fills_only_the_nodes_share(shm_dir: str, tmp_path) -> None:
    path = os.path.join(shm_dir, "built")
    env = {**os.environ, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "LOCAL_RANK": "0",
           "PYTHONPATH": TESTS}
    spec = os.path.join(TESTS, "helpers", "cli_sources.py") + ":images"
    proc = subprocess.run(["mmapcache", "build", path, "--dataset", spec, "--kwargs", '{"n": 40}', "--workers", "1",
                           "--node-share", "--shard", "0/1"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    share = share_of(40, 2, 1, 0)
    assert f"share: node 1 of 2: {len(share)} of 40 indices" in proc.stdout
    info = describe(path)
    assert info["filled"] == len(share) and info["slots"] == len(share)
    shown = subprocess.run(["mmapcache", "inspect", path], capture_output=True, text=True, timeout=60).stdout
    assert f"share:       node 1 of 2: {len(share)} of 40 indices (seed 0)" in shown
