"""``ds.loader()`` in a distributed job: without a sampler, each rank reads exactly what ``DataLoader(ds,
sampler=DistributedSampler(ds, ...))`` reads (torch's own sampler is the reference), so an epoch covers the dataset
once across the ranks, whichever way the job was launched (explicit ranks, torchrun's environment, an initialised
process group). A sampler that gives every rank the whole dataset is warned about, once. Resuming is in
``test_loader_resume.py``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from helpers.once import once_per_run
from helpers.order_checks import N, labels
from helpers.sources import ImageLabels
from mmapcache import DistributedOrderWarning, MmapCachedDataset


@pytest.fixture
def cache(cache_path: str) -> Any:
    with MmapCachedDataset(cache_path, ImageLabels(N)) as ds:
        ds.fill()
        yield ds


# --- the split --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("batch_size", [4, 5])
def test_ranks_read_what_distributed_sampler_gives_them(cache: MmapCachedDataset, shuffle: bool,
                                                        batch_size: int) -> None:
    for world in (2, 3):
        covered: list[set[int]] = [set(), set()]
        for rank in range(world):
            fast = cache.loader(batch_size=batch_size, shuffle=shuffle, rank=rank, world_size=world)
            sampler = DistributedSampler(cache, num_replicas=world, rank=rank, shuffle=shuffle, seed=cache.seed)
            plain = DataLoader(cache, batch_size=batch_size, sampler=sampler)
            for epoch in range(2):
                fast.sampler.set_epoch(epoch)
                sampler.set_epoch(epoch)
                got = [labels(b) for b in fast]
                assert got == [labels(b) for b in plain]
                assert len(got) == len(fast)
                covered[epoch] |= {i for batch in got for i in batch}
        assert covered == [set(range(N))] * 2  # each epoch covers the dataset across the ranks


def test_the_split_is_found_in_torchruns_environment(cache: MmapCachedDataset, monkeypatch: pytest.MonkeyPatch) -> None:
    per_rank = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        per_rank.append({i for b in cache.loader(batch_size=8, shuffle=True) for i in labels(b)})
    assert per_rank[0] | per_rank[1] == set(range(N)) and len(per_rank[0]) == len(per_rank[1]) == N // 2


def test_a_sampler_that_gives_every_rank_everything_is_warned_about_once(cache: MmapCachedDataset,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = cache.loader(batch_size=8, sampler=RandomSampler(cache))
    with pytest.warns(DistributedOrderWarning, match=r"gives every rank the whole dataset.*ds\.sampler\(\)"):
        assert sum(len(b[0]) for b in loader) == N
    list(loader)  # once


def test_reading_the_same_epoch_twice_under_ranks_is_warned_about(cache: MmapCachedDataset) -> None:
    loader = cache.loader(batch_size=8, shuffle=True, rank=0, world_size=2)
    first = [labels(b) for b in loader]
    with pytest.warns(DistributedOrderWarning, match=r"set_epoch\(epoch\)"):
        assert [labels(b) for b in loader] == first
    loader.sampler.set_epoch(1)
    assert [labels(b) for b in loader] != first


def test_lightning_leaves_the_loaders_sampler_alone(cache: MmapCachedDataset) -> None:
    # A trainer that replaces a loader's sampler unless it is a DistributedSampler (Lightning's
    # use_distributed_sampler) keeps ours, which splits by itself; set_epoch reaches the dataset (variants).
    loader = cache.loader(batch_size=8, shuffle=True, rank=1, world_size=2)
    assert isinstance(loader.sampler, DistributedSampler)
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (2, 1)
    loader.sampler.set_epoch(7)
    assert cache.epoch == 7


@pytest.fixture
def torchrun_job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank of a 2-rank torchrun job read with no sampler (``loader_script.py``), in two phases: finding
    its rank from torchrun's environment alone, then from a gloo process group. Run once per test run; its cache
    is removed when it ends."""
    from helpers.torchrun import TESTS, finish, results, torchrun

    def run(out: Path) -> None:
        cache_dir = os.path.join("/dev/shm", f"mmapcache-test-{uuid.uuid4().hex[:12]}")
        try:
            finish(torchrun(["--standalone", "--nproc-per-node=2", os.path.join(TESTS, "helpers", "loader_script.py"),
                             str(out), os.path.join(cache_dir, "c"), "--samples", "50"], {}))
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)

    return results(str(once_per_run(tmp_path_factory, "torchrun-no-sampler", run)))


@pytest.mark.parametrize("phase", ["environment", "process group"])
def test_a_torchrun_job_splits_each_epoch_with_no_sampler(torchrun_job: list[dict[str, Any]], phase: str) -> None:
    ranks = [r[phase] for r in torchrun_job]
    for epoch in range(2):
        read = [r["epochs"][epoch] for r in ranks]
        assert len(read[0]) == len(read[1]) == 25 and sorted(read[0] + read[1]) == list(range(50))
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1] and ranks[0]["batches"] == 7


def test_either_epoch_setter_reaches_a_users_sampler_and_the_dataset(cache_path: str) -> None:
    # ds.set_epoch is offered as the alternative to loader.sampler.set_epoch; with a user's DistributedSampler it
    # reached only the dataset (every epoch the same order), and the sampler's own set_epoch never the dataset
    # (every epoch the same variant).
    with MmapCachedDataset(cache_path, ImageLabels(N), variants=3) as ds:
        def reference(epoch: int) -> list[list[int]]:
            sampler = DistributedSampler(range(N), num_replicas=2, rank=1, seed=3)
            sampler.set_epoch(epoch)
            return [labels(b) for b in DataLoader(ImageLabels(N), batch_size=4, sampler=sampler)]

        sampler = DistributedSampler(ds, num_replicas=2, rank=1, seed=3)
        loader = ds.loader(batch_size=4, sampler=sampler)
        for epoch, set_epoch in enumerate([ds.set_epoch, sampler.set_epoch, ds.set_epoch, sampler.set_epoch]):
            set_epoch(epoch)
            assert [labels(b) for b in loader] == reference(epoch), set_epoch
            assert ds.epoch == sampler.epoch == epoch
