"""``ds.loader()`` resumed from ``state_dict()``: for interruptions at several points of an epoch (before its first
batch, within it, after its last, and at its end, as an end-of-epoch checkpoint), ``first k batches + the batches a new
loader yields after load_state_dict(state at k)`` equals the uninterrupted run, through that epoch and the next, with
and without workers, for every kind of order (shuffled with or without a generator, ranks, a user's sampler,
``ds.sampler()`` over node shares, rotating or not, variants), whatever the resumed process's global random state,
and whether the trainer calls ``set_epoch`` before ``load_state_dict`` (PyTorch Lightning) or after.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from helpers.order_checks import N, epochs, labels, new_process, resumed
from helpers.sources import ImageLabels
from mmapcache import MmapCachedDataset


@pytest.fixture
def cache(cache_path: str) -> Any:
    with MmapCachedDataset(cache_path, ImageLabels(N)) as ds:
        ds.fill()
        yield ds


ORDERS: dict[str, Callable[[MmapCachedDataset], dict[str, Any]]] = {
    "shuffle": lambda ds: {"shuffle": True},
    "shuffle with a generator": lambda ds: {"shuffle": True, "generator": torch.Generator().manual_seed(3)},
    "in order, drop_last": lambda ds: {"drop_last": True},
    "rank 1 of 3": lambda ds: {"shuffle": True, "rank": 1, "world_size": 3},
    "a user sampler": lambda ds: {"sampler": SubsetRandomSampler(range(3, 40), torch.Generator().manual_seed(5))},
    "a distributed sampler": lambda ds: {"sampler": DistributedSampler(ds, num_replicas=2, rank=0, seed=4)},
}


@pytest.mark.parametrize(("workers", "set_then_load"), [(0, False), (0, True), (2, False)])
@pytest.mark.parametrize("order", list(ORDERS))
def test_a_resumed_loader_yields_what_the_uninterrupted_one_would(cache: MmapCachedDataset, order: str,
                                                                  workers: int, set_then_load: bool) -> None:
    def make() -> Any:
        return cache.loader(batch_size=4, num_workers=workers, **ORDERS[order](cache))

    new_process(0)
    reference = epochs(make(), 3)
    for epoch, k in [(0, 0), (0, 1), (1, 3), (1, len(reference[1]) - 1), (1, len(reference[1])), (0, -1)]:
        new_process(0)
        head, rest = resumed(make, epoch, k, set_then_load=set_then_load)
        assert head + rest == reference[epoch] + reference[epoch + 1], (order, epoch, k)


@pytest.mark.parametrize("set_then_load", [False, True])
@pytest.mark.parametrize("rotate_every", [None, 1])
def test_resuming_variants_and_node_shares(cache_path: str, rotate_every: int | None, set_then_load: bool) -> None:
    # A state between epochs holds ds.sampler()'s epoch; loaded after the trainer's set_epoch(next), it must not
    # put the epoch back (the next epoch would repeat the last one's order).
    with MmapCachedDataset(cache_path, ImageLabels(N), node_share=(1, 2), variants=2, rotate_every=rotate_every) as ds:
        def make() -> Any:
            return ds.loader(batch_size=3, sampler=ds.sampler(rank=0, world_size=2, seed=9))
        reference = epochs(make(), 3)
        for epoch, k in [(0, 2), (1, 1), (1, 4), (0, -1)]:
            ds.set_epoch(0)
            head, rest = resumed(make, epoch, k, set_then_load=set_then_load)
            assert head + rest == reference[epoch] + reference[epoch + 1], (epoch, k)
            assert ds.epoch == epoch + 1  # the variant of the epoch being read


def test_a_state_between_epochs_starts_the_next_one(cache: MmapCachedDataset) -> None:
    loader = cache.loader(batch_size=5, shuffle=True)
    first = [labels(b) for b in loader]
    state = loader.state_dict()
    expected = [labels(b) for b in loader]
    fresh = cache.loader(batch_size=5, shuffle=True)
    fresh.load_state_dict(state)
    assert [labels(b) for b in fresh] == expected != first


@pytest.mark.parametrize("other", [{"drop_last": True}, {"shuffle": False}, {"seed": 9},
                                   {"sampler": "sequential", "shuffle": False}])
def test_a_state_of_another_loader_is_refused(cache: MmapCachedDataset, other: dict[str, Any]) -> None:
    # (Another number of ranks or batch size is an elastic resume of the own order: test_resume_anywhere.py.)
    loader = cache.loader(batch_size=4, shuffle=True)
    next(iter(loader))
    state = loader.state_dict()
    if other.get("sampler") == "sequential":
        other = {**other, "sampler": torch.utils.data.SequentialSampler(cache)}
    with pytest.raises(ValueError, match=r"saved by a loader of another shape \(.* in the state, .* here"):
        cache.loader(**{"batch_size": 4, "shuffle": True, **other}).load_state_dict(state)
    with pytest.raises(ValueError, match=r"not a state of ds\.loader"):
        loader.load_state_dict({"epoch": 0})


def test_a_user_samplers_state_is_refused_on_another_number_of_ranks(cache: MmapCachedDataset) -> None:
    """A user's sampler decides the split itself: its state cannot be taken up elastically."""
    sampler = torch.utils.data.distributed.DistributedSampler(cache, num_replicas=2, rank=0, seed=1)
    loader = cache.loader(batch_size=4, sampler=sampler, rank=0, world_size=2)
    next(iter(loader))
    other = torch.utils.data.distributed.DistributedSampler(cache, num_replicas=4, rank=0, seed=1)
    with pytest.raises(ValueError, match=r"world_size 2 in the state, 4 here|another shape"):
        cache.loader(batch_size=4, sampler=other, rank=0, world_size=4).load_state_dict(loader.state_dict())


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


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_stream_state_saved_at_any_step_resumes_the_rest_and_then_the_next_epoch(cache_path: str,
                                                                                   drop_last: bool) -> None:
    """Found by review: with ``drop_last`` (42 positions, batches of 8: 2 dropped), a state saved on an epoch's last
    step said position 40, and the resumed loader's next pass was the empty rest of that epoch: an epoch of training
    silently lost. Every step's state, loaded by a new loader, gives the uninterrupted run's rest, then the next
    epoch whole."""
    from helpers.stream_sources import Fresh

    with MmapCachedDataset(cache_path, Fresh(42), stream=True, seed=4) as ds:
        steps = len(ds.loader(batch_size=8, drop_last=drop_last))
        assert steps == (5 if drop_last else 6)
        order = [ds._ring.order(epoch).tolist() for epoch in range(3)]
        whole = [[order[e][k:k + 8] for k in range(0, 40 if drop_last else 42, 8)] for e in range(3)]
        for step in range(steps + 1):
            loader = ds.loader(batch_size=8, drop_last=drop_last)
            loader.load_state_dict({**loader.state_dict(), "epoch": 0, "position": 0})
            it = iter(loader)
            for _ in range(step):
                next(it)
            state = loader.state_dict()
            del it, loader
            again = ds.loader(batch_size=8, drop_last=drop_last)
            again.load_state_dict(state)
            got = [[b["i"].tolist() for b in again] for _ in range(2)]
            # The rest, then the next epoch whole; after the last step (no rest), the next two epochs.
            assert got == ([whole[0][step:], whole[1]] if step < steps else whole[1:]), step


def test_a_state_saved_again_before_iterating_is_the_one_loaded(cache: MmapCachedDataset) -> None:
    # A trainer that checkpoints again before the resumed loader yields a batch (validation first, a crash loop)
    # saved "start of the epoch", and the next resume trained the interrupted epoch's first batches twice.
    for ranks in ({}, {"rank": 0, "world_size": 2}):
        def make() -> Any:
            return cache.loader(batch_size=4, shuffle=True, **ranks)

        new_process(0)
        reference = epochs(make(), 2)
        new_process(0)
        first = make()
        first.sampler.set_epoch(0)
        list(first)
        first.sampler.set_epoch(1)
        batches = iter(first)
        head = [labels(next(batches)) for _ in range(3)]
        state = first.state_dict()
        second = make()
        second.load_state_dict(pickle.loads(pickle.dumps(state)))
        again = second.state_dict()
        assert (again["epoch"], again["batches"]) == (1, 3)
        third = make()
        third.load_state_dict(again)
        assert head + [labels(b) for b in third] == reference[1]


@pytest.mark.parametrize("generator", [False, True])
@pytest.mark.parametrize("k", [2, -1])
def test_persistent_workers_resume_exactly(cache: MmapCachedDataset, k: int, generator: bool) -> None:
    # Persistent workers draw their base seed once, not per epoch: a state between epochs must not assume a draw
    # (which matters with a generator=, which the order and the workers' seeds are both drawn from).
    def make() -> Any:
        return cache.loader(batch_size=5, shuffle=True, num_workers=2, persistent_workers=True,
                            multiprocessing_context="fork",
                            generator=torch.Generator().manual_seed(3) if generator else None)

    new_process(0)
    reference = epochs(make(), 3)
    head, rest = resumed(make, 0, k)
    assert head + rest == reference[0] + reference[1]


def test_a_job_restarted_at_an_epoch_end_without_a_state_reads_the_same_epochs(cache: MmapCachedDataset) -> None:
    # PyTorch Lightning restores no loader state from an end-of-epoch checkpoint (ModelCheckpoint's default): it
    # makes the loader again and calls set_epoch. The loader's own shuffle is a function of the seed and the epoch
    # (it was of a seed drawn from torch's global generator: an unseeded restart read other epochs).
    new_process(0)
    reference = epochs(cache.loader(batch_size=4, shuffle=True), 3)
    assert len({str(epoch) for epoch in reference}) == 3
    new_process(1)
    assert epochs(cache.loader(batch_size=4, shuffle=True), 2, start=1) == reference[1:]
    new_process(1)
    assert epochs(cache.loader(batch_size=4, shuffle=True, seed=1), 2, start=1) != reference[1:]


def test_a_loader_made_anew_each_epoch_without_set_epoch_still_reshuffles(cache: MmapCachedDataset) -> None:
    # Found by a review: with the order a function of (seed, epoch), a loop that makes a loader per epoch and never
    # calls set_epoch read the same order every epoch (DataLoader(shuffle=True) reshuffles there). A process counts
    # the passes it drew of each epoch; a restarted one starts again from the first.
    new_process(0)
    made_anew = [[labels(b) for b in cache.loader(batch_size=4, shuffle=True)] for _ in range(3)]
    assert len({str(order) for order in made_anew}) == 3
    new_process(5)
    one = cache.loader(batch_size=4, shuffle=True)
    assert [[labels(b) for b in one] for _ in range(3)] == made_anew


@pytest.mark.parametrize("seed", [0, 7])
def test_one_process_shuffles_as_distributed_sampler_of_one_rank(cache: MmapCachedDataset, seed: int) -> None:
    # The same global order on any number of ranks: one process reads what the ranks of a larger job split.
    sampler = DistributedSampler(range(N), num_replicas=1, rank=0, seed=seed)
    loader = cache.loader(batch_size=5, shuffle=True, seed=seed)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        loader.sampler.set_epoch(epoch)
        expected = list(sampler)
        assert [i for batch in loader for i in labels(batch)] == expected


def test_a_loop_without_set_epoch_gets_a_new_order_each_time_and_resumes_it(cache: MmapCachedDataset) -> None:
    new_process(0)
    loader = cache.loader(batch_size=4, shuffle=True)
    passes = [[labels(b) for b in loader] for _ in range(3)]
    assert len({str(p) for p in passes}) == 3  # as DataLoader(shuffle=True) reshuffles
    new_process(0)
    first = cache.loader(batch_size=4, shuffle=True)
    list(first)
    batches = iter(first)
    head = [labels(next(batches)) for _ in range(2)]
    state = first.state_dict()
    new_process(7)
    second = cache.loader(batch_size=4, shuffle=True)
    second.load_state_dict(state)
    assert head + [labels(b) for b in second] == passes[1]
    assert [labels(b) for b in second] == passes[2]


# --- found by an adversarial review ---------------------------------------------------------------------------------


RESUMED_TWICE: dict[str, Callable[[MmapCachedDataset], dict[str, Any]]] = {
    "shuffle": lambda ds: {"batch_size": 4, "shuffle": True},
    "shuffle, 2 workers": lambda ds: {"batch_size": 4, "shuffle": True, "num_workers": 2},
    "unbatched": lambda ds: {"batch_size": None, "shuffle": True},
    "rank 1 of 2": lambda ds: {"batch_size": 4, "shuffle": True, "rank": 1, "world_size": 2},
    "a distributed sampler": lambda ds: {"batch_size": 4, "sampler": DistributedSampler(ds, 2, 0, seed=4)},
    "a batch sampler": lambda ds: {"batch_sampler": BatchSampler(
        RandomSampler(range(N), generator=torch.Generator().manual_seed(2)), 4, False)},
}


@pytest.mark.parametrize("order", list(RESUMED_TWICE))
def test_a_loader_resumed_twice_in_one_epoch_yields_what_the_uninterrupted_one_would(cache: MmapCachedDataset,
                                                                                     order: str) -> None:
    # A job preempted twice in one epoch: the second state counted only the batches of the resumed pass, and the
    # third run trained again on the batches between the first and second interruptions.
    def make() -> Any:
        return cache.loader(**RESUMED_TWICE[order](cache))

    def ids(batch: Any) -> list[int]:
        return labels(batch) if order != "unbatched" else labels((batch[0][None],))

    new_process(0)
    reference = [ids(b) for b in make()]
    new_process(0)
    read, state = [], None
    for seed, k in [(1, 2), (2, 1), (3, 2)]:
        new_process(seed)  # each run a job of its own
        loader = make()
        if state is not None:
            loader.load_state_dict(pickle.loads(pickle.dumps(state)))
        batches = iter(loader)
        read += [ids(next(batches)) for _ in range(k)]
        state = loader.state_dict()
        assert state["batches"] == len(read)
    new_process(4)
    loader = make()
    loader.load_state_dict(state)
    assert read + [ids(b) for b in loader] == reference


GLOBAL_RNG_SAMPLERS: dict[str, Callable[[], dict[str, Any]]] = {
    "RandomSampler": lambda: {"batch_size": 3, "sampler": RandomSampler(range(N))},
    "SubsetRandomSampler": lambda: {"batch_size": 3, "sampler": SubsetRandomSampler(range(2, 40))},
    "WeightedRandomSampler": lambda: {"batch_size": 3, "sampler": WeightedRandomSampler([1.0] * N, 30)},
    "BatchSampler over a RandomSampler": lambda: {"batch_sampler": BatchSampler(RandomSampler(range(N)), 3, False)},
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("sampler", list(GLOBAL_RNG_SAMPLERS))
def test_a_sampler_drawing_from_the_global_generator_resumes_its_interrupted_epoch(cache: MmapCachedDataset,
                                                                                   sampler: str,
                                                                                   workers: int) -> None:
    # Samplers without a generator draw from torch's global one; only RandomSampler's draw was recorded, and the
    # others resumed another permutation: some samples twice in the epoch, others never.
    def make() -> Any:
        return cache.loader(num_workers=workers, **GLOBAL_RNG_SAMPLERS[sampler]())

    new_process(0)
    reference = epochs(make(), 2)
    for epoch, k in [(0, 2), (1, 4)]:
        new_process(0)
        head, rest = resumed(make, epoch, k, then=0)
        assert head + rest == reference[epoch], (epoch, k)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("options", [{"shuffle": True}, {"shuffle": True, "generator": "seeded"}, {}])
def test_after_a_resumed_pass_torchs_random_numbers_go_on_as_the_uninterrupted_runs(cache: MmapCachedDataset,
                                                                                     options: dict[str, Any],
                                                                                     workers: int) -> None:
    """A trainer's checkpoint holds torch's generator as it was when the loader's state was taken, after the pass
    drew the workers' base seed as it began: the resumed pass draws nothing more, so dropout and augmentations
    after a resume are the uninterrupted run's (Hugging Face's ``Trainer`` with ``ignore_data_skip=True``). With
    workers, DataLoader's iterator drew the base seed again for the resumed pass (review)."""
    def make() -> Any:
        generator = {"generator": torch.Generator().manual_seed(4)} if "generator" in options else {}
        return cache.loader(batch_size=4, num_workers=workers, **{**options, **generator})

    torch.manual_seed(0)
    loader = make()
    batches = iter(loader)
    head = [labels(next(batches)) for _ in range(3)]
    state, rng = loader.state_dict(), torch.get_rng_state()
    rest, after = [labels(b) for b in batches], torch.rand(4)
    torch.manual_seed(1)  # (a new process)
    again = make()
    again.load_state_dict(state)
    torch.set_rng_state(rng)  # (the checkpoint's)
    assert [labels(b) for b in again] == rest and torch.equal(torch.rand(4), after) and head


def test_torchdatas_stateful_distributed_sampler_resumes_in_every_epoch(cache: MmapCachedDataset) -> None:
    # Its state_dict says how far its last pass went ("all of it" at an epoch's start), not what the next draws:
    # loaded as the epoch's start, it made the resumed epoch skip everything (a ValueError from epoch 1 on).
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    def make() -> Any:
        return cache.loader(batch_size=3, sampler=StatefulDistributedSampler(cache, num_replicas=2, rank=1, seed=3))

    reference = epochs(make(), 3)
    for epoch, k in [(0, 2), (1, 2), (1, 0), (0, -1), (1, -1)]:
        head, rest = resumed(make, epoch, k)
        assert head + rest == reference[epoch] + reference[epoch + 1], (epoch, k)


def test_in_order_false_with_workers_refuses_to_save_a_state(cache: MmapCachedDataset) -> None:
    # Batches reach the loop out of order, so "k batches yielded" does not say which: a resume skipped the wrong
    # ones (a slow first batch was never trained on, the one before it twice).
    loader = cache.loader(batch_size=4, num_workers=2, in_order=False)
    batches = iter(loader)
    next(batches)
    with pytest.raises(ValueError, match=r"in_order=False.*pass in_order=True"):
        loader.state_dict()
    del batches
    assert len(list(cache.loader(batch_size=4, in_order=False))) == len(loader)  # without workers, in order


@pytest.mark.parametrize(("saved", "loaded", "key"), [
    ({"shuffle": True, "generator": "g", "num_workers": 2, "persistent_workers": True},
     {"shuffle": True, "generator": "g", "num_workers": 2}, "seeds_workers_once"),
    ({"shuffle": True, "rank": 0, "world_size": 2, "seed": 1},
     {"shuffle": True, "rank": 0, "world_size": 2, "seed": 2}, "seed"),
    ({"sampler": "subset"}, {}, "sampler_kinds"),
])
def test_a_state_of_a_loader_drawing_its_order_otherwise_is_refused(cache: MmapCachedDataset, saved: dict[str, Any],
                                                                    loaded: dict[str, Any], key: str) -> None:
    # Each was accepted, and the resumed loader read another order from the next epoch (the workers' seeds drawn
    # from the generator once instead of each epoch), or at once (another seed; a subset read in order).
    def make(options: dict[str, Any]) -> Any:
        options = dict(options)
        if options.get("generator") == "g":
            options["generator"] = torch.Generator().manual_seed(7)
        if options.get("sampler") == "subset":
            options["sampler"] = SubsetRandomSampler(range(N), torch.Generator().manual_seed(1))
        if options.get("num_workers"):
            options["multiprocessing_context"] = "fork"
        return cache.loader(batch_size=4, **options)

    first = make(saved)
    list(first)
    with pytest.raises(ValueError, match=rf"another shape \({key} "):
        make(loaded).load_state_dict(first.state_dict())
    make(saved).load_state_dict(first.state_dict())


def test_a_pass_left_for_the_next_epoch_is_not_resumed(cache: MmapCachedDataset) -> None:
    # A loop that breaks out of an epoch, sets the next and checkpoints saved "epoch 0, 2 batches": the resumed job
    # read the rest of epoch 0 as epoch 1.
    new_process(0)
    loader = cache.loader(batch_size=4, shuffle=True)
    batches = iter(loader)
    next(batches), next(batches)
    loader.sampler.set_epoch(1)
    state = loader.state_dict()
    expected = [labels(b) for b in loader]
    new_process(1)
    resumed_loader = cache.loader(batch_size=4, shuffle=True)
    resumed_loader.load_state_dict(state)
    assert (state["epoch"], state["batches"]) == (1, 0)
    assert [labels(b) for b in resumed_loader] == expected
    assert cache.epoch == 1


def test_a_stream_loaders_state_resumes_every_rank(cache_path: str) -> None:
    # Lightning saves rank 0's loader state and gives it to every rank: the other ranks refused it.
    from helpers.stream_sources import Fresh

    with MmapCachedDataset(cache_path, Fresh(24), stream=True, seed=2) as ds:
        loaders = [ds.loader(batch_size=4, rank=rank, world_size=2) for rank in range(2)]
        iters = [iter(loader) for loader in loaders]
        for it in iters:
            next(it)
        state = loaders[0].state_dict()
        rests = [[b["i"].tolist() for b in it] for it in iters]
        for rank in range(2):
            again = ds.loader(batch_size=4, rank=rank, world_size=2)
            again.load_state_dict(state)
            assert [b["i"].tolist() for b in again] == rests[rank]


def test_a_state_of_mmapcache_0_3_is_refused_with_what_to_do(cache: MmapCachedDataset) -> None:
    # Found by a review: 0.3's one-process shuffle was drawn from a seed taken from torch's global generator; this
    # version draws (seed, epoch), so 0.3's "k batches of epoch e" would skip k batches of another permutation.
    loader = cache.loader(batch_size=4, shuffle=True)
    state = {**loader.state_dict(), "format": "mmapcache.loader/1", "batches": 3}
    with pytest.raises(ValueError, match=r"saved by mmapcache 0\.3.*start the epoch afresh"):
        cache.loader(batch_size=4, shuffle=True).load_state_dict(state)


@pytest.mark.parametrize("sampler", [False, True])
def test_a_state_of_a_loader_with_or_without_a_generator_is_refused_by_the_other(cache: MmapCachedDataset,
                                                                                 sampler: bool) -> None:
    # Found by a review: either way round, the state was accepted and the resumed epoch was another permutation.
    def make(generator: bool) -> Any:
        g = torch.Generator().manual_seed(2) if generator else None
        if sampler:
            return cache.loader(batch_size=4, sampler=RandomSampler(range(N), generator=g))
        return cache.loader(batch_size=4, shuffle=True, generator=g)

    for saved in (False, True):
        loader = make(saved)
        next(iter(loader))
        with pytest.raises(ValueError, match=r"another shape \(.*generators \["):
            make(not saved).load_state_dict(loader.state_dict())


class PositionStateShuffle(torch.utils.data.Sampler):
    """A shuffle in torchdata's Stateful protocol, written by hand: its state says how far its pass went (and its
    generator, kept under a name of its own), and loading it makes the next pass skip that far."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.g = n, torch.Generator().manual_seed(seed)
        self.yielded, self.next_yielded = 0, None

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        order = torch.randperm(self.n, generator=self.g).tolist()
        skip, self.next_yielded = self.next_yielded or 0, None
        self.yielded = skip
        for i in order[skip:]:
            self.yielded += 1
            yield i

    def state_dict(self) -> dict[str, Any]:
        return {"yielded": self.yielded, "g": self.g.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_yielded = state["yielded"]
        self.g.set_state(state["g"])


def test_a_stateful_sampler_with_a_generator_resumes_by_its_generator(cache: MmapCachedDataset) -> None:
    # Found by a review: its position state, taken at an epoch's start, said "all of the last pass": loaded, the
    # resumed epoch skipped everything (a ValueError from epoch 1 on).
    def make() -> Any:
        return cache.loader(batch_size=4, sampler=PositionStateShuffle(N, 1))

    reference = epochs(make(), 3)
    for epoch, k in [(0, 2), (1, 2), (1, 0), (0, -1)]:
        head, rest = resumed(make, epoch, k)
        assert head + rest == reference[epoch] + reference[epoch + 1], (epoch, k)


# --- states edited by hand or from elsewhere --------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value", "says"), [
    ("batches", 11, r"'batches': 11 \(int\), expected an int from 0 to 10 of this loader's 10 batches per epoch"),
    ("batches", 10**6, r"'batches': 1000000 \(int\), expected an int from 0 to 10"),
    ("batches", -2, r"'batches': -2 \(int\), expected an int from 0 to 10"),
    ("batches", None, r"'batches': None \(NoneType\), expected an int"),
    ("batches", 2.7, r"'batches': 2\.7 \(float\), expected an int"),
    ("batches", True, r"'batches': True \(bool\), expected an int"),
    ("batches", "missing", r"'batches': missing, expected an int"),
    ("in_epoch", "False", r"'in_epoch': 'False' \(str\), expected True or False"),
    ("in_epoch", "missing", r"'in_epoch': missing, expected True or False"),
    ("epoch", 2**63, r"'epoch': 9223372036854775808 \(int\), expected an int from -9223372036854775808"),
    ("epoch", "1", r"'epoch': '1' \(str\), expected an int"),
    ("repeat", -1, r"'repeat': -1 \(int\), expected an int from 0"),
    ("persistent", 1, r"'persistent': 1 \(int\), expected True or False"),
    ("generator", [1, 2], r"'generator': \[1, 2\] \(list\), expected None or a torch generator's state"),
    ("rng", torch.zeros(3), r"'rng': tensor\(.*\) \(Tensor\), expected None or a torch generator's state"),
    ("sampler", "x", r"'sampler': 'x' \(str\), expected None or a dict"),
])
def test_a_hand_edited_state_is_refused_naming_the_key_the_value_and_what_it_must_be(cache: MmapCachedDataset,
                                                                                     key: str, value: Any,
                                                                                     says: str) -> None:
    # Each was accepted: batches beyond the epoch skipped the rest of it silently, -2 failed later inside
    # itertools.islice, a missing key was a bare KeyError, "False" read as true and 2.7 as 2.
    loader = cache.loader(batch_size=5, shuffle=True)  # 46 samples: 10 batches
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    if value == "missing":
        del state[key]
    else:
        state[key] = value
    fresh = cache.loader(batch_size=5, shuffle=True)
    with pytest.raises(ValueError, match=rf"loader state key {says}.*state_dict\(\) returned, unedited"):
        fresh.load_state_dict(state)
    assert fresh.sampler.resume is None and cache.epoch == 0  # nothing taken from it


def test_a_state_between_passes_says_it_has_yielded_nothing(cache: MmapCachedDataset) -> None:
    loader = cache.loader(batch_size=5, shuffle=True)
    state = {**loader.state_dict(), "batches": 3}  # in_epoch False: the next pass, not begun
    with pytest.raises(ValueError, match=r"'batches': 3 \(int\), expected an int from 0 to 0 as the state is of a "
                                         r"pass not begun"):
        cache.loader(batch_size=5, shuffle=True).load_state_dict(state)
