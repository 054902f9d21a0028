"""``ds.loader()`` in a distributed job, and resumed mid-epoch.

Split: without a sampler, each rank reads exactly what ``DataLoader(ds, sampler=DistributedSampler(ds, ...))`` reads
(torch's own sampler is the reference), so an epoch covers the dataset once across the ranks, whichever way the job
was launched (explicit ranks, torchrun's environment, an initialised process group). A sampler that gives every rank
the whole dataset is warned about, once.

Resume: for interruptions at several points of an epoch, ``first k batches + the batches a new loader yields after
load_state_dict(state at k)`` equals the uninterrupted run, through that epoch and the next, with and without
workers, for every kind of order (shuffled with or without a generator, ranks, a user's sampler, ``ds.sampler()``
over node shares, variants), and whatever the resumed process's global random state.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SubsetRandomSampler

from helpers.sources import ImageLabels
from mmapcache import DistributedOrderWarning, MmapCachedDataset

N = 46  # not a multiple of the ranks or of the batch sizes: padding and short batches matter


@pytest.fixture
def cache(cache_path: str) -> Any:
    with MmapCachedDataset(cache_path, ImageLabels(N)) as ds:
        ds.fill()
        yield ds


def _labels(batch: Any) -> list[int]:
    """The sample indices of a batch (``ImageLabels``' labels are not unique: its images' first bytes are)."""
    images = batch[0]
    return [_index_of[bytes(image.reshape(-1)[:16].tolist())] for image in images]


_index_of = {bytes(ImageLabels(N)[i][0].reshape(-1)[:16].tolist()): i for i in range(N)}


def _epochs(loader: Any, epochs: int, start: int = 0) -> list[list[list[int]]]:
    out = []
    for epoch in range(start, start + epochs):
        loader.sampler.set_epoch(epoch)
        out.append([_labels(b) for b in loader])
    return out


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
                got = [_labels(b) for b in fast]
                assert got == [_labels(b) for b in plain]
                assert len(got) == len(fast)
                covered[epoch] |= {i for batch in got for i in batch}
        assert covered == [set(range(N))] * 2  # each epoch covers the dataset across the ranks


def test_the_split_is_found_in_torchruns_environment(cache: MmapCachedDataset, monkeypatch: pytest.MonkeyPatch) -> None:
    per_rank = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        per_rank.append({i for b in cache.loader(batch_size=8, shuffle=True) for i in _labels(b)})
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
    first = [_labels(b) for b in loader]
    with pytest.warns(DistributedOrderWarning, match=r"set_epoch\(epoch\)"):
        assert [_labels(b) for b in loader] == first
    loader.sampler.set_epoch(1)
    assert [_labels(b) for b in loader] != first


def test_lightning_leaves_the_loaders_sampler_alone(cache: MmapCachedDataset) -> None:
    # A trainer that replaces a loader's sampler unless it is a DistributedSampler (Lightning's
    # use_distributed_sampler) keeps ours, which splits by itself; set_epoch reaches the dataset (variants).
    loader = cache.loader(batch_size=8, shuffle=True, rank=1, world_size=2)
    assert isinstance(loader.sampler, DistributedSampler)
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (2, 1)
    loader.sampler.set_epoch(7)
    assert cache.epoch == 7


# --- resume -----------------------------------------------------------------------------------------------------


def _resumed(make: Callable[[], Any], epoch: int, k: int, then: int = 1) -> tuple[list[list[int]], list[Any]]:
    """Batches of ``make()`` read for epoch ``epoch``'s first ``k`` batches, then (after saving its state and making
    a new loader in a process whose global random state differs) the rest of that epoch and ``then`` more epochs."""
    first = make()
    for earlier in range(epoch):  # the epochs before, read whole
        first.sampler.set_epoch(earlier)
        list(first)
    first.sampler.set_epoch(epoch)
    batches = iter(first)
    head = [_labels(next(batches)) for _ in range(k)]
    state = pickle.loads(pickle.dumps(first.state_dict()))  # what a checkpoint holds
    torch.manual_seed(12345)  # the resumed process's global generator is not the interrupted one's
    np.random.seed(12345)
    second = make()
    second.load_state_dict(state)
    rest = [_labels(b) for b in second]
    for later in range(epoch + 1, epoch + 1 + then):
        second.sampler.set_epoch(later)
        rest += [_labels(b) for b in second]
    return head, rest


ORDERS: dict[str, Callable[[MmapCachedDataset], dict[str, Any]]] = {
    "shuffle": lambda ds: {"shuffle": True},
    "shuffle with a generator": lambda ds: {"shuffle": True, "generator": torch.Generator().manual_seed(3)},
    "in order, drop_last": lambda ds: {"drop_last": True},
    "rank 1 of 3": lambda ds: {"shuffle": True, "rank": 1, "world_size": 3},
    "a user sampler": lambda ds: {"sampler": SubsetRandomSampler(range(3, 40), torch.Generator().manual_seed(5))},
    "a distributed sampler": lambda ds: {"sampler": DistributedSampler(ds, num_replicas=2, rank=0, seed=4)},
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("order", list(ORDERS))
def test_a_resumed_loader_yields_what_the_uninterrupted_one_would(cache: MmapCachedDataset, order: str,
                                                                  workers: int) -> None:
    torch.manual_seed(0)
    reference_loader = cache.loader(batch_size=4, num_workers=workers, **ORDERS[order](cache))
    torch.manual_seed(0)
    reference = _epochs(reference_loader, 3)
    for epoch, k in [(0, 0), (0, 1), (1, 3), (1, len(reference[1]) - 1), (1, len(reference[1]))]:
        torch.manual_seed(0)
        head, rest = _resumed(lambda: cache.loader(batch_size=4, num_workers=workers, **ORDERS[order](cache)),
                              epoch, k)
        assert head + rest == reference[epoch] + reference[epoch + 1], (order, epoch, k)


def test_resuming_variants_and_node_shares(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, ImageLabels(N), node_share=(1, 2), variants=2) as ds:
        def make() -> Any:
            return ds.loader(batch_size=3, sampler=ds.sampler(rank=0, world_size=2, seed=9))
        reference = _epochs(make(), 3)
        for epoch, k in [(0, 2), (1, 1), (1, 4)]:
            ds.set_epoch(0)
            head, rest = _resumed(make, epoch, k)
            assert head + rest == reference[epoch] + reference[epoch + 1]
            assert ds.epoch == epoch + 1  # the variant of the epoch being read


def test_a_state_between_epochs_starts_the_next_one(cache: MmapCachedDataset) -> None:
    loader = cache.loader(batch_size=5, shuffle=True)
    first = [_labels(b) for b in loader]
    state = loader.state_dict()
    expected = [_labels(b) for b in loader]
    fresh = cache.loader(batch_size=5, shuffle=True)
    fresh.load_state_dict(state)
    assert [_labels(b) for b in fresh] == expected != first


@pytest.mark.parametrize("other", [{"batch_size": 5}, {"drop_last": True}, {"rank": 0, "world_size": 2},
                                   {"shuffle": False}])
def test_a_state_of_another_loader_is_refused(cache: MmapCachedDataset, other: dict[str, Any]) -> None:
    loader = cache.loader(batch_size=4, shuffle=True)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"saved by a loader of another shape \(.* in the state, .* here"):
        cache.loader(**{"batch_size": 4, "shuffle": True, **other}).load_state_dict(state)
    with pytest.raises(ValueError, match=r"not a state of ds\.loader"):
        loader.load_state_dict({"epoch": 0})


def test_a_state_of_another_dataset_length_is_refused(cache: MmapCachedDataset, shm_dir: str) -> None:
    loader = cache.loader(batch_size=4)
    with MmapCachedDataset(os.path.join(shm_dir, "other"), ImageLabels(N + 1)) as other:
        with pytest.raises(ValueError, match=rf"length {N} in the state, {N + 1} here"):
            other.loader(batch_size=4).load_state_dict(loader.state_dict())


def test_a_stream_loader_resumes_through_the_same_protocol(cache_path: str) -> None:
    from helpers.stream_sources import Fresh

    with MmapCachedDataset(cache_path, Fresh(40), stream=True, seed=2) as ds:
        loader = ds.loader(batch_size=4)
        it = iter(loader)
        head = [next(it)["i"].tolist() for _ in range(3)]
        state = loader.state_dict()
        rest = [b["i"].tolist() for b in it]  # the run goes on past the checkpoint, then is lost
        assert state["epoch"] == 0 and state["position"] == 12
        again = ds.loader(batch_size=4)
        again.load_state_dict(state)
        assert [b["i"].tolist() for b in again] == rest  # the same positions after the checkpoint
        assert [i for batch in head + rest for i in batch] == ds._ring.order(0).tolist()


@pytest.mark.parametrize("process_group", [False, True])
def test_a_torchrun_job_splits_each_epoch_with_no_sampler(shm_dir: str, tmp_path: Any, process_group: bool) -> None:
    from helpers.torchrun import TESTS, finish, results, torchrun

    out = tmp_path / "out"
    out.mkdir()
    script = os.path.join(TESTS, "helpers", "loader_script.py")
    finish(torchrun(["--standalone", "--nproc-per-node=2", script, str(out), os.path.join(shm_dir, "c"),
                     "--samples", "50", *(["--process-group"] if process_group else [])], {}))
    ranks = results(str(out))
    for epoch in range(2):
        read = [r["epochs"][epoch] for r in ranks]
        assert len(read[0]) == len(read[1]) == 25 and sorted(read[0] + read[1]) == list(range(50))
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1] and ranks[0]["batches"] == 7
