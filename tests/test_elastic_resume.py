"""Elastic resume of ``ds.loader``'s own order: a state saved by a job of ``W`` ranks with batches of ``B``, at any
step of an epoch (before its first batch, after each, after its last), loaded by a job of ``W'`` ranks with batches
of ``B'`` (here the ranks are loaders with ``rank=``/``world_size=`` in one process; ``test_mixture_jobs.py`` runs
real torchrun jobs): over the new job, the rest of the epoch is read exactly once (plus ``DistributedSampler``'s
padding), every rank takes the same number of steps, and the epochs after it are the new job's own. On the same ranks
and batch size it is exactly the uninterrupted job's rest. A state of a user's sampler stays refused on other ranks.

Before, a state of another world size was refused ("saved by a loader of another shape").
"""

from __future__ import annotations

import collections
import math
import os
from typing import Any

import pytest
import torch

from helpers.processes import another_process, collect, join_all, running
from helpers.sources import Numbered
from mmapcache import MmapCachedDataset

N, SEED = 23, 7  # 23: not a multiple of any job size here, so every split pads


@pytest.fixture(scope="module")
def filled() -> Any:
    path = os.path.join("/dev/shm", f"mmapcache-test-elastic-{os.getpid()}-{os.urandom(4).hex()}")
    with MmapCachedDataset(path, Numbered(N), fingerprint="numbered", delete_on_close=True) as ds:
        ds.fill()
        yield path


def _loaders(ds: MmapCachedDataset, world: int, batch: int, workers: int = 0) -> list[Any]:
    return [ds.loader(batch_size=batch, shuffle=True, seed=SEED, rank=r, world_size=world, num_workers=workers)
            for r in range(world)]


def _labels(batch: Any) -> list[int]:
    return batch[1].tolist()


def _order(epoch: int) -> list[int]:
    """The epoch's global order: DistributedSampler's permutation of (seed, epoch)."""
    generator = torch.Generator()
    generator.manual_seed(SEED + epoch)
    return torch.randperm(N, generator=generator).tolist()


def _saved(ds: MmapCachedDataset, world: int, batch: int, epoch: int, k: int) -> tuple[dict[str, Any], list[list]]:
    """Rank 0's state after every rank of a job of ``world`` read ``k`` batches of ``epoch`` (all of them: after
    the last batch, the iterator not yet exhausted, as a trainer's last step checkpoints), and what each rank went
    on to read of that epoch."""
    loaders = _loaders(ds, world, batch)
    for loader in loaders:
        loader.sampler.set_epoch(epoch)
    its = [iter(loader) for loader in loaders]
    for it in its:
        for _ in range(k):
            next(it)
    state = loaders[0].state_dict()
    rest = [[_labels(b) for b in it] for it in its]
    return state, rest


def _resumed(ds: MmapCachedDataset, world: int, batch: int, state: dict[str, Any], epoch: int,
             workers: int = 0) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """Each rank of a job of ``world`` given ``state``: its batches of the pass resumed, and of the next epoch."""
    loaders = _loaders(ds, world, batch, workers)
    resumed = []
    for loader in loaders:
        loader.load_state_dict(state)
        resumed.append([_labels(b) for b in loader])
    after = []
    for loader in loaders:
        loader.sampler.set_epoch(epoch + 1)
        after.append([_labels(b) for b in loader])
    return resumed, after


def _check_rest(resumed: list[list[list[int]]], rest: list[int], world: int) -> None:
    """Over the job the rest of the epoch exactly once, padded as DistributedSampler pads, every rank the same
    number of steps."""
    assert len({len(r) for r in resumed}) == 1, [len(r) for r in resumed]
    read = [i for r in resumed for b in r for i in b]
    padding = math.ceil(len(rest) / world) * world - len(rest)
    assert len(read) == len(rest) + padding
    counts = collections.Counter(read)
    assert set(counts) >= set(rest) and all(counts[i] >= 1 for i in rest)
    assert sum(counts[i] - 1 for i in rest) + sum(c for i, c in counts.items() if i not in rest) == padding


JOBS = [(1, 4), (2, 4), (4, 3)]
RESUMED = [(1, 4), (2, 5), (4, 4), (3, 2)]


@pytest.mark.parametrize(("world", "batch"), JOBS)
def test_a_state_taken_at_every_step_continues_on_any_number_of_ranks(filled: str, world: int, batch: int) -> None:
    epoch = 2
    order = _order(epoch)
    with MmapCachedDataset(filled, Numbered(N), fingerprint="numbered") as ds:
        per_epoch = len(_loaders(ds, world, batch)[0])
        for k in range(per_epoch + 1):
            state, went_on = _saved(ds, world, batch, epoch, k)
            offset = min(N, k * batch * world) if k < per_epoch else N
            assert state["offset"] == offset and state["order_world"] == world
            for new_world, new_batch in RESUMED:
                resumed, after = _resumed(ds, new_world, new_batch, state, epoch)
                where = f"a state of {world}x{batch} after {k} batches, resumed on {new_world}x{new_batch}"
                _check_rest(resumed, order[offset:], new_world)
                if (new_world, new_batch) == (world, batch):
                    assert resumed == went_on, where  # the uninterrupted job's rest, batch for batch
                fresh = _loaders(ds, new_world, new_batch)
                for loader in fresh:
                    loader.sampler.set_epoch(epoch + 1)
                assert after == [[_labels(b) for b in loader] for loader in fresh], where


def test_a_pass_resumed_elastically_can_be_saved_and_resumed_again(filled: str) -> None:
    """4 ranks -> 2 (after 1 step) -> 3 with another batch size (after 2 more): still the epoch's rest, once."""
    epoch, order = 5, _order(5)
    with MmapCachedDataset(filled, Numbered(N), fingerprint="numbered") as ds:
        state, _ = _saved(ds, 4, 2, epoch, 1)
        assert state["offset"] == 8
        two = _loaders(ds, 2, 3)
        for loader in two:
            loader.load_state_dict(state)
        its = [iter(loader) for loader in two]
        first = [[_labels(next(it)) for _ in range(2)] for it in its]
        again = two[0].state_dict()
        assert (again["base"], again["offset"]) == (8, 8 + 2 * 3 * 2) and again["order_world"] == 4
        resumed, _ = _resumed(ds, 3, 5, again, epoch)
        _check_rest(resumed, order[20:], 3)
        assert sorted(i for r in first for b in r for i in b) == sorted(order[8:20])


def _resume_in(path: str, state: dict[str, Any], world: int, batch: int, epoch: int, out: Any) -> None:
    with MmapCachedDataset(path, Numbered(N), fingerprint="numbered") as ds:
        out.put(_resumed(ds, world, batch, state, epoch, workers=2))


def test_an_elastic_resume_in_a_new_process_with_workers(filled: str) -> None:
    epoch, order = 1, _order(1)
    with MmapCachedDataset(filled, Numbered(N), fingerprint="numbered") as ds:
        state, _ = _saved(ds, 2, 4, epoch, 1)
        expected = _resumed(ds, 4, 2, state, epoch)
    ctx = another_process()
    out = ctx.Queue()
    proc = ctx.Process(target=_resume_in, args=(filled, state, 4, 2, epoch, out))
    with running([proc]):
        (got,) = collect(out, 1, 300)
        assert join_all([proc], 60) == [0]
    assert got == expected
    _check_rest(got[0], order[8:], 4)


def test_a_state_of_format_2_resumes_elastically_too(filled: str) -> None:
    """A state saved by 0.4 or 0.5 (format 2: no offset) is taken as whole batches from the epoch's start."""
    epoch, order = 3, _order(3)
    with MmapCachedDataset(filled, Numbered(N), fingerprint="numbered") as ds:
        state, _ = _saved(ds, 2, 4, epoch, 2)
        old = {k: v for k, v in state.items() if k not in ("offset", "base", "order_world")}
        old["format"] = "mmapcache.loader/2"
        resumed, _ = _resumed(ds, 3, 4, old, epoch)
        _check_rest(resumed, order[16:], 3)


def test_the_padding_goes_on_from_an_offset_inside_it() -> None:
    """``padded_rest`` from an offset past the order's end (a node of node shares that pads over several steps, whose
    state was saved inside its padding): the padding goes on where it was, not from the order's start again."""
    import numpy as np

    from mmapcache.read.epoch_split import padded_rest

    order = np.arange(5) + 10
    uninterrupted = padded_rest(order, 0, 1, total=12)  # 5 positions, then the padding: 10..14, 10, 11
    for offset in range(13):
        assert padded_rest(order, offset, 1, total=12 - offset).tolist() == uninterrupted[offset:].tolist(), offset
