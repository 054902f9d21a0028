"""A mixture of caches: its epochs hold each source's count exactly (within rounding of its weight), drawn without
replacement while the count allows; its loader serves every source's own values (hits, misses, ragged and fixed
fields, transforms, workers), splits each epoch across ranks with no overlap, and resumes exactly from a state taken
at any step, on the same ranks and on others, after a change of weights, in a new process; sources and states that
cannot be mixed are refused, naming why. (Real torchrun and Lightning jobs: ``test_mixture_jobs.py``.)"""

from __future__ import annotations

import collections
import math
import os
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from helpers.mix_sources import STRIDE, Rows, Texts, ids_of, rows_intact
from helpers.processes import another_process, collect, join_all, running
from helpers.stream_sources import Fresh
from mmapcache import LayoutError, Mixture, MmapCachedDataset, PadCollate, UsageError
from mmapcache.read.mix_order import MixPass, plan

SIZES = {"a": 60, "b": 25, "c": 7}
TAGS = {"a": 1, "b": 2, "c": 3}


@pytest.fixture(scope="module")
def caches() -> Iterator[dict[str, str]]:
    root = os.path.join("/dev/shm", f"mmapcache-test-mix-{os.getpid()}-{os.urandom(4).hex()}")
    os.makedirs(root)
    paths = {}
    for name, n in SIZES.items():
        paths[name] = os.path.join(root, name)
        with MmapCachedDataset(paths[name], Rows(n, TAGS[name]), fingerprint=f"rows-{name}") as ds:
            ds.fill()
    yield paths
    import shutil

    shutil.rmtree(root, ignore_errors=True)


def _mix(paths: dict[str, str], **kwargs: Any) -> Mixture:
    sources = {name: MmapCachedDataset(path, Rows(SIZES[name], TAGS[name]), fingerprint=f"rows-{name}")
               for name, path in paths.items()}
    return Mixture(sources, **kwargs)


def _epoch(loader: Any) -> list[list[int]]:
    out = []
    for batch in loader:
        assert rows_intact(batch)
        out.append(ids_of(batch))
    return out


def _source_counts(ids: list[int]) -> dict[int, int]:
    return dict(sorted(collections.Counter(i // STRIDE for i in ids).items()))


# --- what an epoch holds ----------------------------------------------------------------------------------------------


def test_counts_give_each_source_exactly_its_count_every_epoch(caches: dict[str, str]) -> None:
    """A source over-weighted past its size (c: 7 samples, 20 a epoch) repeats whole before any sample repeats once
    more; one under-weighted (a: 60, 30 an epoch) gives a subset without repeats, another each epoch."""
    mix = _mix(caches, counts={"a": 30, "b": 25, "c": 20}, seed=4)
    loader = mix.loader(batch_size=8)
    subsets = []
    for epoch in range(3):
        mix.set_epoch(epoch)
        ids = [i for b in _epoch(loader) for i in b]
        assert _source_counts(ids) == {1: 30, 2: 25, 3: 20}
        per = collections.Counter(ids)
        assert max(per[i] for i in ids if i // STRIDE == 1) == 1  # without replacement
        assert {per[i] for i in ids if i // STRIDE == 2} == {1}  # b: exactly its 25, once each
        assert {per[3 * STRIDE + i] for i in range(7)} <= {2, 3} and sum(per[3 * STRIDE + i] for i in range(7)) == 20
        subsets.append(frozenset(i for i in ids if i // STRIDE == 1))
    assert len(set(subsets)) == 3  # a's subset differs from epoch to epoch


@pytest.mark.parametrize(("weights", "size"), [({"a": 0.7, "b": 0.2, "c": 0.1}, 50), ([1, 1, 1], 10),
                                               ([0.29, 0.71, 0.0], 100)])
def test_weights_are_apportioned_within_one_and_sum_to_the_epoch_size(caches: dict[str, str], weights: Any,
                                                                      size: int) -> None:
    mix = _mix(caches, weights=weights, epoch_size=size, seed=1)
    shares = list(weights.values()) if isinstance(weights, dict) else weights
    counts = mix.counts()
    assert sum(counts.values()) == size == len(mix)
    for (name, count), w in zip(counts.items(), shares):
        assert abs(count - size * w / sum(shares)) < 1, (name, count)
    ids = [i for b in _epoch(mix.loader(batch_size=7)) for i in b]
    assert _source_counts(ids) == {TAGS[n]: c for n, c in counts.items() if c}


def test_default_weights_read_every_sample_once_per_epoch(caches: dict[str, str]) -> None:
    mix = _mix(caches)
    ids = [i for b in _epoch(mix.loader(batch_size=16)) for i in b]
    assert sorted(ids) == sorted(TAGS[n] * STRIDE + i for n, k in SIZES.items() for i in range(k))


def test_per_batch_composition_holds_every_batch_in_proportion(caches: dict[str, str]) -> None:
    mix = _mix(caches, weights={"a": 0.5, "b": 0.3, "c": 0.2}, epoch_size=200, per_batch=True, seed=2)
    for world in (1, 2):
        for rank in range(world):
            for batch in _epoch(mix.loader(batch_size=10, rank=rank, world_size=world)):
                got = _source_counts(batch)
                for tag, w in ((1, 0.5), (2, 0.3), (3, 0.2)):
                    assert abs(got.get(tag, 0) - len(batch) * w) < 1, got
    # The guide's example: 70/20/10 in batches of 64 holds 44-45, 12-13 and 6-7 (every 5th batch held 46, 12, 6),
    # and the per-unit rounding of every mix of counts and batch sizes (the plan's compositions) stays within one.
    for size in (640, 6400):
        mix = _mix(caches, weights={"a": 0.7, "b": 0.2, "c": 0.1}, epoch_size=size, per_batch=True, seed=2)
        for batch in _epoch(mix.loader(batch_size=64)):
            got = _source_counts(batch)
            assert 44 <= got[1] <= 45 and 12 <= got[2] <= 13 and 6 <= got[3] <= 7, got
    rng = np.random.default_rng(0)
    for _ in range(300):
        counts = rng.integers(0, 150, int(rng.integers(1, 6)))
        unit, total = int(rng.integers(1, 70)), int(counts.sum())
        if not total:
            continue
        made = plan(counts.tolist(), counts.tolist(), 1, 0, 0, unit, per_batch=True)
        sizes = made.composition.sum(axis=1)
        assert (made.composition.sum(axis=0) == counts).all() and (sizes[:-1] == unit).all()
        exact = sizes[:, None] * counts[None, :] / total
        assert (np.abs(made.composition - exact) < 1).all(), (counts, unit)


def test_the_short_last_batches_of_several_ranks_are_dealt_across_the_last_units(caches: dict[str, str]) -> None:
    """Found by review: where each of W ranks has fewer than a batch left (66 samples, 3 ranks, batches of 10: 2
    each), rank r's last batch was the r-th run of 2 in the last unit, whose samples come grouped by source: rank 0's
    held only source a (per_batch promised each within one of its share; a random mix put 95% of one source there
    over 60 seeds). The last W x t positions are dealt out, every W-th to a rank."""
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    mix = _mix(caches, weights=weights, epoch_size=66, per_batch=True, seed=2)
    read = []
    for rank in range(3):
        batches = _epoch(mix.loader(batch_size=10, rank=rank, world_size=3))
        assert [len(b) for b in batches] == [10, 10, 2]
        for batch in batches:
            got = _source_counts(batch)
            assert all(abs(got.get(TAGS[n], 0) - len(batch) * w) < 1 for n, w in weights.items()), (rank, got)
        read += [i for b in batches for i in b]
    assert len(read) == 66 and _source_counts(read) == {TAGS[n]: c for n, c in mix.counts().items()}


def test_orders_are_a_function_of_seed_and_epoch(caches: dict[str, str]) -> None:
    one, two = _mix(caches, seed=5), _mix(caches, seed=5)
    assert _epoch(one.loader(batch_size=9)) == _epoch(two.loader(batch_size=9))
    two.set_epoch(1)
    assert _epoch(one.loader(batch_size=9)) != _epoch(two.loader(batch_size=9))
    assert _epoch(_mix(caches, seed=6).loader(batch_size=9)) != _epoch(two.loader(batch_size=9))
    loader = one.loader(batch_size=9)
    loader.set_epoch(1)  # (what Hugging Face's Trainer calls: the mixture's epoch)
    assert one.epoch == 1 and _epoch(loader) == _epoch(two.loader(batch_size=9))


# --- what a batch holds ----------------------------------------------------------------------------------------------


def test_a_batch_is_grouped_by_source_and_says_which(caches: dict[str, str]) -> None:
    mix = _mix(caches, seed=3)
    for (_, labels), sources in mix.loader(batch_size=12, return_source=True):
        assert torch.equal(sources, labels // STRIDE - 1)
        assert sources.tolist() == sorted(sources.tolist())
        assert mix.names == ["a", "b", "c"]


@pytest.mark.parametrize("context", [None, "fork", "spawn"])
def test_workers_read_what_one_process_reads(caches: dict[str, str], context: str | None) -> None:
    mix = _mix(caches, seed=8)
    alone = _epoch(mix.loader(batch_size=10))
    workers = {"num_workers": 2, "multiprocessing_context": context} if context else {}
    assert _epoch(mix.loader(batch_size=10, **workers)) == alone


def test_cold_and_partial_caches_compute_store_and_serve_their_misses(shm_dir: str) -> None:
    sources = {"a": MmapCachedDataset(os.path.join(shm_dir, "a"), Rows(40, 1)),
               "b": MmapCachedDataset(os.path.join(shm_dir, "b"), Rows(30, 2), max_bytes=400)}  # holds ~12 of 30
    mix = Mixture(sources, seed=1)
    first = _epoch(mix.loader(batch_size=8, num_workers=2))
    assert sorted(i for b in first for i in b) == sorted([1000 + i for i in range(40)] + [2000 + i for i in range(30)])
    assert sources["a"].num_cached == 40 and 0 < sources["b"].num_cached < 30
    assert _epoch(mix.loader(batch_size=8)) == first  # warm, and the partial cache's rest from its source


def test_ragged_fields_mix_with_fixed_ones_and_pad_from_the_heaps(shm_dir: str) -> None:
    """One source's input_ids vary in length (ragged), another's always have 4 (stored at a fixed shape): they mix,
    and PadCollate pads the batch as it pads one cache's, cold and warm (warm, the fixed source's maps were copied
    into the batch's fixed arrays, which a ragged field does not have: a TypeError), and without a collate_fn."""
    ragged = MmapCachedDataset(os.path.join(shm_dir, "r"), Texts(30, 1))
    fixed = MmapCachedDataset(os.path.join(shm_dir, "f"), Texts(20, 2, lengths=1), ragged=None)
    assert not fixed._store.layout.fields[0].ragged and ragged._store.layout.fields[0].ragged
    mix = Mixture({"r": ragged, "f": fixed}, seed=2)
    pad = PadCollate(-1, mask=True)
    everything = sorted([1000 + i for i in range(30)] + [2000 + i for i in range(20)])
    for state in ("cold", "warm"):
        seen = []
        for batch, sources in mix.loader(batch_size=6, collate_fn=pad, return_source=True):
            assert torch.equal(sources, batch["label"] // STRIDE - 1)
            padded = batch["input_ids"]
            for row, (label, length) in enumerate(zip(batch["label"].tolist(), padded.lengths.tolist())):
                assert length == (1 + ((label % STRIDE) * 7) % (13 if label // STRIDE == 1 else 1))
                assert (padded.data[row, :length] == label).all() and (padded.data[row, length:] == -1).all()
                assert padded.mask[row].sum() == length
            seen += batch["label"].tolist()
        assert sorted(seen) == everything, state
    assert ragged.num_cached == 30 and fixed.num_cached == 20
    seen = []
    for batch in mix.loader(batch_size=6):  # (default collation: the ragged field's values as a list)
        for label, ids in zip(batch["label"].tolist(), batch["input_ids"]):
            assert (ids == label).all() and len(ids) == 1 + ((label % STRIDE) * 7) % (13 if label < 2000 else 1)
        seen += batch["label"].tolist()
    assert sorted(seen) == everything


def test_sources_with_transforms_are_read_as_samples(caches: dict[str, str]) -> None:
    def double(sample: Any) -> Any:
        return sample[0] * 2, sample[1]

    sources = {name: MmapCachedDataset(path, transform=double) for name, path in caches.items()}
    mix = Mixture(sources, seed=1)
    for x, labels in mix.loader(batch_size=8, num_workers=2):
        assert torch.equal(x, 2 * labels[:, None].float().expand_as(x))


# --- ranks ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_split_an_epoch_with_no_overlap_and_the_same_number_of_batches(caches: dict[str, str],
                                                                               world: int) -> None:
    mix = _mix(caches, weights=[0.6, 0.3, 0.1], epoch_size=45, seed=9)
    ranks = [_epoch(mix.loader(batch_size=4, rank=r, world_size=world)) for r in range(world)]
    assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) == math.ceil(math.ceil(45 / world) / 4)
    order = mix.loader(batch_size=4).sampler.order(MixPass(0, 0, mix.counts_now(), 4))
    read = sorted(i for r in ranks for b in r for i in b)
    padding = math.ceil(45 / world) * world - 45
    assert read == sorted(_ids(mix, np.concatenate((order, order[:padding]))))


def _ids(mix: Mixture, flat: np.ndarray) -> list[int]:
    """The sample ids of flat ids (source s's index i is flat id starts[s] + i)."""
    source = np.searchsorted(mix.starts, flat, side="right") - 1
    return ((source + 1) * STRIDE + flat - mix.starts[source]).tolist()


# --- resume ---------------------------------------------------------------------------------------------------------


def _job(mix: Mixture, world: int, batch: int, **kwargs: Any) -> list[Any]:
    return [mix.loader(batch_size=batch, rank=r, world_size=world, **kwargs) for r in range(world)]


def _state_after(mix: Mixture, world: int, batch: int, k: int) -> tuple[dict[str, Any], list[list[list[int]]]]:
    """Rank 0's state after every rank read ``k`` batches of the mixture's epoch, and what each went on to read."""
    loaders = _job(mix, world, batch)
    its = [iter(loader) for loader in loaders]
    for it in its:
        for _ in range(k):
            next(it)
    state = loaders[0].state_dict()
    return state, [[ids_of(b) for b in it] for it in its]


def _check_rest(mix: Mixture, resumed: list[list[list[int]]], drawn: MixPass, offset: int, world: int) -> None:
    order = mix.loader(batch_size=1).sampler.order(drawn)
    rest = _ids(mix, order[offset:])
    read = [i for r in resumed for b in r for i in b]
    padding = math.ceil(len(rest) / world) * world - len(rest)
    assert len({len(r) for r in resumed}) == 1
    assert len(read) == len(rest) + padding and not (collections.Counter(rest) - collections.Counter(read))


@pytest.mark.parametrize(("world", "batch"), [(1, 4), (2, 3), (4, 2)])
def test_a_state_taken_at_every_step_resumes_on_any_number_of_ranks(caches: dict[str, str], world: int,
                                                                     batch: int) -> None:
    setting = {"weights": [0.5, 0.3, 0.2], "epoch_size": 37, "seed": 11}
    mix = _mix(caches, **setting)
    mix.set_epoch(2)
    per_epoch = len(mix.loader(batch_size=batch, rank=0, world_size=world))
    for k in range(per_epoch + 1):
        state, went_on = _state_after(mix, world, batch, k)
        assert state["epoch"] == 2 and state["in_epoch"] == (k > 0)  # (after iter(), before a batch: nothing drawn)
        for new_world, new_batch in [(world, batch), (1, 5), (2, 4), (3, 3), (4, 2)]:
            resumed_mix = _mix(caches, **setting)  # a new job: a new mixture over the same caches
            loaders = _job(resumed_mix, new_world, new_batch)
            for loader in loaders:
                loader.load_state_dict(state)
            resumed = [[ids_of(b) for b in loader] for loader in loaders]
            if (new_world, new_batch) == (world, batch):
                assert resumed == went_on, f"{world}x{batch} after {k}: not the uninterrupted rest"
            _check_rest(mix, resumed, MixPass(2, 0, tuple(state["counts"]), state["unit"]), state["offset"],
                        new_world)
            resumed_mix.set_epoch(3)
            mix3 = _mix(caches, **setting)
            mix3.set_epoch(3)
            assert [_epoch(loader) for loader in loaders] == [_epoch(loader) for loader in _job(mix3, new_world,
                                                                                                  new_batch)]


def test_a_state_records_the_weights_of_its_epoch_and_of_the_next(caches: dict[str, str]) -> None:
    """A curriculum: weights changed before epoch 1; a state mid-epoch 1, loaded by a job that never set them, reads
    the rest of epoch 1 as drawn, and epoch 2 with the state's weights."""
    mix = _mix(caches, weights=[1, 1, 1], epoch_size=30, seed=2)
    loader = mix.loader(batch_size=4)
    _epoch(loader)
    mix.set_epoch(1)
    mix.set_weights([0.8, 0.1, 0.1])
    it = iter(loader)
    head = [ids_of(next(it)) for _ in range(3)]
    state = loader.state_dict()
    rest = [ids_of(b) for b in it]
    mix.set_epoch(2)
    after = _epoch(loader)
    assert state["setting"] == {"weights": [0.8, 0.1, 0.1], "epoch_size": 30}
    fresh = _mix(caches, weights=[1, 1, 1], epoch_size=30, seed=2)
    again = fresh.loader(batch_size=4)
    again.load_state_dict(state)
    assert _epoch(again) == rest and fresh.counts() == {"a": 24, "b": 3, "c": 3}
    fresh.set_epoch(2)
    assert _epoch(again) == after
    assert _source_counts([i for b in head + rest for i in b]) == {1: 24, 2: 3, 3: 3}


@pytest.mark.parametrize("workers", [0, 2])
def test_after_a_resumed_pass_torchs_random_numbers_go_on_as_the_uninterrupted_runs(caches: dict[str, str],
                                                                                     workers: int) -> None:
    """The rest of a pass draws nothing from torch's generator (the pass drew as it began, before the state and a
    trainer's checkpoint of the generator were taken): what the job draws after a resume is what it drew before.
    With workers, DataLoader's iterator drew its base seed again for the resumed pass (review)."""
    torch.manual_seed(0)
    loader = _mix(caches, seed=3).loader(batch_size=4, num_workers=workers)
    batches = iter(loader)
    head = [ids_of(next(batches)) for _ in range(3)]
    state, rng = loader.state_dict(), torch.get_rng_state()
    rest, after = _epoch(batches), torch.rand(4)
    torch.manual_seed(1)
    again = _mix(caches, seed=3).loader(batch_size=4, num_workers=workers)
    again.load_state_dict(state)
    torch.set_rng_state(rng)
    assert _epoch(again) == rest and torch.equal(torch.rand(4), after) and head


def _resume_in(paths: dict[str, str], state: dict[str, Any], out: Any) -> None:
    mix = _mix(paths, weights=[0.5, 0.3, 0.2], epoch_size=40, seed=6)
    loaders = _job(mix, 2, 3, num_workers=2)
    for loader in loaders:
        loader.load_state_dict(state)
    out.put([[ids_of(b) for b in loader] for loader in loaders])


def test_a_state_resumes_in_a_new_process_with_workers(caches: dict[str, str]) -> None:
    mix = _mix(caches, weights=[0.5, 0.3, 0.2], epoch_size=40, seed=6)
    state, went_on = _state_after(mix, 2, 3, 2)
    ctx = another_process()
    out = ctx.Queue()
    proc = ctx.Process(target=_resume_in, args=(caches, state, out))
    with running([proc]):
        (got,) = collect(out, 1, 300)
        assert join_all([proc], 60) == [0]
    assert got == went_on


def test_a_state_of_another_mixture_or_loader_is_refused_naming_the_difference(caches: dict[str, str],
                                                                               shm_dir: str) -> None:
    mix = _mix(caches, seed=1)
    loader = mix.loader(batch_size=4)
    next(iter(loader))
    state = loader.state_dict()
    for other, match in [(_mix(caches, seed=2), r"seed 1 in the state, 2 here"),
                         (_mix(caches, seed=1, per_batch=True), r"per_batch False in the state, True here"),
                         (Mixture({"a": MmapCachedDataset(caches["a"]), "b": MmapCachedDataset(caches["b"])}, seed=1),
                          r"another mixture: sources \['a', 'b', 'c'\] in the state, \['a', 'b'\] here")]:
        with pytest.raises(ValueError, match=match):
            other.loader(batch_size=4).load_state_dict(state)
    refilled = MmapCachedDataset(os.path.join(shm_dir, "c"), Rows(7, 3), fingerprint="rows-c-v2")
    swapped = Mixture({"a": MmapCachedDataset(caches["a"]), "b": MmapCachedDataset(caches["b"]), "c": refilled}, seed=1)
    with pytest.raises(ValueError, match=r"source 'c''s fingerprint is 'rows-c' in the state, 'rows-c-v2' here"):
        swapped.loader(batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match=r"drop_last False in the state, True here"):
        mix.loader(batch_size=4, drop_last=True).load_state_dict(state)
    with pytest.raises(ValueError, match=r"not a state of a mixture's loader"):
        mix.loader(batch_size=4).load_state_dict(MmapCachedDataset(caches["a"]).loader(batch_size=4).state_dict())
    with pytest.raises(ValueError, match=r"not a state of ds\.loader"):
        MmapCachedDataset(caches["a"]).loader(batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match=r"key 'offset': -3"):
        mix.loader(batch_size=4).load_state_dict({**state, "offset": -3})
    # (review: an offset past the pass skipped the rest of the epoch, silently; a refused unit had already set the
    # mixture's epoch and weights from the state)
    assert state["in_epoch"] and not state["ended"]
    with pytest.raises(ValueError, match=r"key 'offset': 1000000, expected an int from 0 to"):
        mix.loader(batch_size=4).load_state_dict({**state, "offset": 10**6})
    mix.set_epoch(5)
    mix.set_weights({"a": 1, "b": 1, "c": 8})
    before = (mix.epoch, mix.setting())
    with pytest.raises(ValueError, match=r"key 'unit': 0"):
        mix.loader(batch_size=4).load_state_dict({**state, "unit": 0})
    assert (mix.epoch, mix.setting()) == before


# --- refused sources ------------------------------------------------------------------------------------------------


def test_sources_that_cannot_be_mixed_are_refused_naming_the_difference(shm_dir: str) -> None:
    def cache(name: str, source: Any, **kwargs: Any) -> MmapCachedDataset:
        return MmapCachedDataset(os.path.join(shm_dir, name), source, **kwargs)

    rows = cache("rows", Rows(10, 1))
    with pytest.raises(LayoutError, match=r"sources 'rows' and 'texts' hold samples of different structures"):
        Mixture({"rows": rows, "texts": cache("texts", Texts(10, 2))})
    with pytest.raises(LayoutError, match=r"store field '0' at different fixed shapes \(\(4,\) and \(6,\)\).*"
                                          r"ragged=\['0'\]"):
        Mixture([rows, cache("wide", Rows(10, 2, width=6))])

    class Halves(Rows):
        def __getitem__(self, i: int) -> Any:
            x, y = super().__getitem__(i)
            return x.half(), y

    with pytest.raises(LayoutError, match=r"differ in field '0': tensor of float32 and tensor of float16"):
        Mixture([rows, cache("half", Halves(10, 2))])
    stream = cache("stream", Fresh(20), stream=True)
    with pytest.raises(UsageError, match=r"source 's' \(the stream at .*\) is a stream"):
        Mixture({"r": rows, "s": stream})
    share = cache("share", Rows(10, 2), node_share=(0, 2))
    with pytest.raises(UsageError, match=r"must all be full \(or partial\) caches, or all node shares"):
        Mixture([rows, share])
    with pytest.raises(TypeError, match=r"source '0' is a Rows, not an MmapCachedDataset"):
        Mixture([Rows(10, 1)])
    class Reordered(Texts):  # (the same fields as Texts, in another order: two datasets mapped differently)
        def __getitem__(self, i: int) -> Any:
            sample = super().__getitem__(i)
            return {k: sample[k] for k in reversed(list(sample))}

    with pytest.raises(LayoutError, match=r"hold the same fields in another order .* return each dict's keys in "
                                          r"the same order from every source"):
        Mixture([cache("texts2", Texts(10, 1)), cache("reordered", Reordered(10, 2))])
    for bad, match in [({"weights": [1, -1]}, "weights must be finite numbers >= 0"),
                       ({"weights": [1e308, 1e308]}, "sum past the largest float"),
                       ({"weights": [10 ** 400, 1]}, "weights must be finite numbers >= 0"),
                       ({"weights": {"0": 1}}, r"weights name \['1'\] missing"),
                       ({"counts": [1, 2.5]}, "counts must be ints >= 0"),
                       ({"weights": [1, 1], "counts": [1, 1]}, "not both"),
                       ({"weights": [1, 1], "epoch_size": 0}, "epoch_size must be an int >= 1")]:
        with pytest.raises((ValueError, TypeError), match=match):
            Mixture([rows, cache("rows2", Rows(10, 2))], **bad)
    with pytest.raises(ValueError, match=r"shuffle= chooses an order"):
        Mixture([rows]).loader(batch_size=2, shuffle=False, sampler=[0])
    with pytest.raises(ValueError, match=r"sampler= chooses an order"):
        Mixture([rows]).loader(batch_size=2, sampler=[0])


class _Versions(torch.utils.data.Dataset):
    """Sample ``i``'s ``k``-th computation is ``i * 1000 + k``: with ``variants``, variant ``k`` of ``i`` as filled."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, collections.Counter()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.calls[i] += 1
        return {"x": torch.tensor([i * 1000 + self.calls[i] - 1])}


def test_a_mixture_of_caches_with_variants_reads_the_mixtures_epoch_whatever_the_collate(shm_dir: str) -> None:
    """Found by review: with PadCollate or TextCollate a mixture's batch read variant ``e % K`` of
    ``mix.set_epoch(e)``; with any other collate_fn, or a source with a transform, it read the sources' own epoch's
    (variant 0 forever): other samples for the same mixture, epoch and indices, and augmentations that never
    rotated."""
    sources = []
    for name, n in (("a", 6), ("b", 4)):
        ds = MmapCachedDataset(os.path.join(shm_dir, name), _Versions(n), variants=3, deterministic=False, ragged=None)
        for epoch in range(3):
            ds.set_epoch(epoch)
            ds.fill()
        ds.set_epoch(0)
        sources.append(ds)
    mix = Mixture({"a": sources[0], "b": sources[1]})
    for epoch in range(3):
        expected = sorted(i * 1000 + epoch for n in (6, 4) for i in range(n))
        mix.set_epoch(epoch)
        padded = [int(v) for b in mix.loader(batch_size=5, collate_fn=PadCollate(0)) for v in b["x"].reshape(-1)]
        for workers in (0, 2):
            mix.set_epoch(epoch)
            listed = [int(s["x"][0]) for b in mix.loader(batch_size=5, collate_fn=list, num_workers=workers)
                      for s in b]
            assert sorted(listed) == sorted(padded) == expected, (epoch, workers)


# --- node shares -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_mixture_of_node_shares_reads_every_sample_of_an_epoch_with_default_weights(shm_dir: str,
                                                                                     ranks: int) -> None:
    """Found by review: sources of 11 and 7 samples over 2 nodes (shares 5|6 and 3|4) with default weights (every
    sample once an epoch): each source's odd sample was handed to node 0, whose share is the smaller, so node 0 drew
    6 from its 5 (one twice) and node 1 left one of its 6 unread. Each node now reads its shares whole, and every
    rank of the job as many steps as the node with the most (the others pad, as ``DistributedSampler`` does)."""
    sizes = {"a": 11, "b": 7}
    per_node, shares = [], []
    for node in (0, 1):
        sources = {name: MmapCachedDataset(os.path.join(shm_dir, f"{name}{node}"), Rows(n, TAGS[name]),
                                           node_share=(node, 2)) for name, n in sizes.items()}
        mix = Mixture(sources, seed=1)
        held = [TAGS[name] * STRIDE + int(i) for name, ds in sources.items() for i in ds.cacheable_indices()]
        shares.append(held)
        ranks_read = [[i for b in _epoch(loader) for i in b] for loader in _job(mix, ranks, 2)]
        read = [i for r in ranks_read for i in r]
        assert set(read) == set(held), "a node left part of its shares unread, or read outside them"
        per_node.append(ranks_read)
    assert len({len(r) for ranks_read in per_node for r in ranks_read}) == 1  # the job's number of steps everywhere
    assert sorted(i for held in shares for i in held) == sorted(
        TAGS[name] * STRIDE + i for name, n in sizes.items() for i in range(n))
    padding = sum(len(r) for ranks_read in per_node for r in ranks_read) - sum(sizes.values())
    assert 0 <= padding <= 2 + 2 * ranks  # the smaller node's (2 samples short) and the ranks' rounding


def test_a_mixture_of_node_shares_resumes_at_every_step_inside_its_padding_too(shm_dir: str) -> None:
    """Found by review: node 0 (shares a 6|7, b 3|4, c 2|3: 11 positions against node 1's 14) pads over its last
    steps; a state saved inside that padding (offset 12 of 11) resumed with the padding started again from the
    order's first position: other samples than the uninterrupted run's."""
    sources = {name: MmapCachedDataset(os.path.join(shm_dir, name), Rows(size, tag), node_share=(0, 2))
               for name, size, tag in (("a", 13, 1), ("b", 7, 2), ("c", 5, 3))}
    mix = Mixture(sources, seed=1)
    whole = _epoch(mix.loader(batch_size=2, rank=0, world_size=1))
    assert len(whole) == 7  # (the job's 14 positions a node: node 0 pads 3)
    for k in range(len(whole) + 1):
        loader = mix.loader(batch_size=2, rank=0, world_size=1)
        it = iter(loader)
        for _ in range(k):
            next(it)
        again = mix.loader(batch_size=2, rank=0, world_size=1)
        again.load_state_dict(loader.state_dict())
        assert _epoch(again) == whole[k:], k


def test_loader_state_resumes_a_mixture_of_node_shares_on_the_job_that_saved_it(shm_dir: str, tmp_path: Any) -> None:
    """Found by review: Hugging Face's ``LoaderState`` compared the state's ranks (a mixture of node shares records
    its node's, 2) with ``Trainer``'s job (2 nodes x 2 ranks: 4), and refused to resume the job that saved it. It
    compares the job's ranks now, and still refuses another job's."""
    from mmapcache.hf import LoaderState

    sources = {name: MmapCachedDataset(os.path.join(shm_dir, name), Rows(SIZES[name], TAGS[name]),
                                       node_share=(0, 2)) for name in ("a", "b")}
    mix = Mixture(sources, seed=2)
    loader = mix.loader(batch_size=4, rank=0, world_size=2)
    it = iter(loader)
    next(it)
    step = types.SimpleNamespace(global_step=1)
    LoaderState(loader).on_save(types.SimpleNamespace(output_dir=str(tmp_path)), step, None)  # the checkpoint
    rest = [ids_of(b) for b in it]
    for world, refused in ((4, False), (2, True)):
        args = types.SimpleNamespace(output_dir=str(tmp_path), ignore_data_skip=True, world_size=world)
        resumed = mix.loader(batch_size=4, rank=0, world_size=2)
        if refused:
            with pytest.raises(ValueError, match=r"saved by a job of 4 rank\(s\) and this one has 2"):
                LoaderState(resumed).on_train_begin(args, step, None)
            continue
        LoaderState(resumed).on_train_begin(args, step, None)
        assert [ids_of(b) for b in resumed] == rest


def test_a_mixture_of_node_shares_reads_each_nodes_shares_and_the_jobs_number_of_steps(shm_dir: str) -> None:
    """Two "nodes" (caches made with node_share=(node, 2)), two ranks each: each node's ranks read only their node's
    shares, every rank of every node the same number of batches, and the job reads each source's count."""
    per_node = []
    for node in (0, 1):
        sources = {name: MmapCachedDataset(os.path.join(shm_dir, f"{name}{node}"), Rows(SIZES[name], TAGS[name]),
                                           node_share=(node, 2)) for name in ("a", "b", "c")}
        mix = Mixture(sources, counts={"a": 40, "b": 25, "c": 9}, seed=3)
        ranks = [_epoch(loader) for loader in _job(mix, 2, 4)]
        held = {TAGS[name] * STRIDE + int(i) for name, ds in sources.items() for i in ds.cacheable_indices()}
        assert all(i in held for r in ranks for b in r for i in b), "a rank read outside its node's shares"
        per_node.append(ranks)
    assert len({len(r) for ranks in per_node for r in ranks}) == 1  # the job's number of steps, everywhere
    read = [i for ranks in per_node for r in ranks for b in r for i in b]
    padding = len(read) - 74
    assert 0 <= padding < 4 and all(_source_counts(read)[t] >= c for t, c in ((1, 40), (2, 25), (3, 9)))
