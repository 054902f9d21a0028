"""``ds.lengths(field)`` (each sample's length, from the index) and ``ds.loader(group_by_length=...)``: batches of
similar lengths whose epochs still read every sample once over the job's ranks, in an order of ``(seed, epoch)``,
resumed exactly at every step, and elastically on another number of ranks (the state says how the order was
grouped)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from helpers.text_sources import Tokenized
from mmapcache import Mixture, MmapCachedDataset, SampleNotCachedError, TextCollate

N, SEED = 101, 3


def _ids(batch: dict[str, Any]) -> list[int]:
    return [int(row[0]) // 1000 for row in batch["input_ids"]]


def _epoch(loaders: list[Any], epoch: int) -> list[list[list[int]]]:
    for loader in loaders:
        loader.sampler.set_epoch(epoch)
    return [[_ids(b) for b in loader] for loader in loaders]


@pytest.fixture
def tokens(cache_path: str) -> Any:
    source = Tokenized(N, longest=90)
    ds = MmapCachedDataset(cache_path, source)
    ds.fill()
    yield ds, source
    ds.close()


def _loaders(ds: MmapCachedDataset, world: int, batch: int, **kw: Any) -> list[Any]:
    return [ds.loader(batch_size=batch, shuffle=True, seed=SEED, rank=r, world_size=world, collate_fn=TextCollate(0),
                      group_by_length="input_ids", **kw) for r in range(world)]


def test_lengths_are_each_samples_first_dimension_read_from_the_index(cache_path: str) -> None:
    source = Tokenized(N)
    ds = MmapCachedDataset(cache_path, source)
    with pytest.raises(SampleNotCachedError, match=rf"\d+ of its {N} samples are not stored yet \(or stale\).*"
                                                   r"fill it first \(ds.fill\(\), ds.prefill\(\) on every rank"):
        ds.lengths("input_ids")  # (the creator stored a few: the first sample and its probes)
    ds.fill()
    assert np.array_equal(ds.lengths("input_ids"), source.lengths)
    assert np.array_equal(ds.lengths("attention_mask"), source.lengths)
    assert np.array_equal(ds.lengths("text"), 4 * source.lengths)  # a str's UTF-8 bytes
    assert ds.lengths("input_ids").dtype == np.int64
    with pytest.raises(ValueError, match=r"field 'label' of .* is a scalar \(int\): it has no length"):
        ds.lengths("label")
    with pytest.raises(ValueError, match=r"has no field 'ids'; its fields are"):
        ds.lengths("ids")
    ds.refresh(indices=[4])
    with pytest.raises(SampleNotCachedError, match=rf"1 of its {N} samples are not stored yet \(or stale\)"):
        ds.lengths("input_ids")  # (stale="recompute": a read computes it again, of a length not known yet)
    ds.close()
    # Found by review: stale="serve" reads a stale row as it is (beside `mmapcache build --follow`, which rewrites
    # it), so its length is the stored one: refused, a length-grouped loader failed at each epoch's start.
    with MmapCachedDataset(cache_path, source, stale="serve") as served:
        assert np.array_equal(served.lengths("input_ids"), source.lengths)
        loader = served.loader(batch_size=8, shuffle=True, collate_fn=TextCollate(0), group_by_length="input_ids")
        assert sorted(i for b in loader for i in (b["input_ids"][:, 0] // 1000).tolist()) == list(range(N))


def test_lengths_of_fixed_and_max_shapes_fields_and_of_each_variant(shm_dir: str) -> None:
    class Grows(torch.utils.data.Dataset):
        """A value of 1 + (i + calls) % 5 elements: each variant (a call per version) of its own length."""

        def __init__(self) -> None:
            self.calls = [0] * 20

        def __len__(self) -> int:
            return 20

        def __getitem__(self, i: int) -> dict[str, Any]:
            self.calls[i] += 1
            return {"x": torch.ones(1 + (i + self.calls[i]) % 5), "fixed": torch.zeros(3, 2)}

    ds = MmapCachedDataset(f"{shm_dir}/v", Grows(), variants=2, deterministic=False, ragged=["x"])
    seen = {}
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        ds.fill()
        seen[epoch] = [len(ds[i]["x"]) for i in range(20)]
    assert seen[0] != seen[1]
    for epoch in (0, 1):
        assert ds.lengths("x", epoch=epoch).tolist() == seen[epoch]
    assert ds.lengths("fixed").tolist() == [3] * 20
    ds.close()
    boxes = MmapCachedDataset(f"{shm_dir}/b", Tokenized(30), max_shapes={"input_ids": [60], "attention_mask": [60]},
                               ragged=None)
    boxes.fill()
    assert np.array_equal(boxes.lengths("input_ids"), Tokenized(30).lengths)
    boxes.close()


def test_a_partial_cache_a_stream_and_an_empty_one_have_no_lengths(shm_dir: str) -> None:
    partial = MmapCachedDataset(f"{shm_dir}/p", Tokenized(N), max_bytes=20_000)
    partial.fill()
    with pytest.raises(SampleNotCachedError, match=r"holds \d+ of its 101 samples \(max_bytes, cache_indices or a "
                                                   r"node share\)"):
        partial.lengths("input_ids")
    partial.close()
    stream = MmapCachedDataset(f"{shm_dir}/s", Tokenized(N), stream=True)
    with pytest.raises(ValueError, match="is a stream: its ring holds the next positions"):
        stream.lengths("input_ids")
    with pytest.raises(ValueError, match="a stream's order is its own"):
        stream.loader(batch_size=4, group_by_length="input_ids")
    stream.close()


def test_batches_hold_similar_lengths_and_every_sample_once_over_the_ranks(tokens: Any) -> None:
    ds, source = tokens
    for world in (1, 2, 3):
        per_rank = _epoch(_loaders(ds, world, 4), 0)
        counts = [len(b) for b in per_rank]
        assert len(set(counts)) == 1 and counts[0] == math.ceil(math.ceil(N / world) / 4)
        read = [i for rank in per_rank for batch in rank for i in batch]
        assert sorted(set(read)) == list(range(N)) and len(read) - N < world  # (DistributedSampler's padding)
    # Less padding than the plain order (the same epoch, the same batches' count).
    plain = ds.loader(batch_size=4, shuffle=True, seed=SEED, collate_fn=TextCollate(0))
    grouped = _loaders(ds, 1, 4)[0]
    cells = [sum(b["input_ids"].numel() for b in loader) for loader in (plain, grouped)]
    assert cells[1] < 0.75 * cells[0], cells
    # One rank's order: each run of the group size (50 batches of 4, here the whole epoch of 101) longest first.
    small = _loaders(ds, 1, 4, group_size=10)[0]
    order = [i for b in small for i in _ids(b)]
    lengths = source.lengths[order]
    for start in range(0, N, 10):
        run = lengths[start:start + 10]
        assert (np.diff(run) <= 0).all(), run
    assert sorted(order) == list(range(N))


def test_the_order_is_of_seed_and_epoch_and_workers_read_the_same(tokens: Any) -> None:
    ds, _ = tokens
    first = _epoch(_loaders(ds, 2, 4), 5)
    assert _epoch(_loaders(ds, 2, 4), 5) == first
    assert _epoch(_loaders(ds, 2, 4), 6) != first
    assert _epoch(_loaders(ds, 2, 4, num_workers=2), 5) == first


@pytest.mark.parametrize("world", [1, 2])
def test_a_resume_at_every_step_reads_the_uninterrupted_rest(tokens: Any, world: int) -> None:
    ds, _ = tokens
    whole = _epoch(_loaders(ds, world, 8), 2)
    steps = len(whole[0])
    for k in range(steps + 1):
        loaders = _loaders(ds, world, 8)
        for loader in loaders:
            loader.sampler.set_epoch(2)
        its = [iter(loader) for loader in loaders]
        for it in its:
            for _ in range(k):
                next(it)
        state = loaders[0].state_dict()
        again = _loaders(ds, world, 8)
        for loader in again:
            loader.load_state_dict(state)
        assert [[_ids(b) for b in loader] for loader in again] == [rank[k:] for rank in whole], k


def test_an_elastic_resume_reads_the_rest_of_the_grouped_order_once(tokens: Any) -> None:
    """Saved by 2 ranks with batches of 4 (groups of 24), resumed by 3 ranks with batches of 5, whose own group
    size (the default, 50 x 5 x 3) differs: the rest is of the order the state was drawn with, read once over the
    new job, every rank the same number of steps."""
    ds, _ = tokens
    order = [i for b in _epoch(_loaders(ds, 1, 1, group_size=24), 1)[0] for i in b]  # one rank: the order itself
    for k in (1, 5, 10):
        loaders = _loaders(ds, 2, 4, group_size=24)
        for loader in loaders:
            loader.sampler.set_epoch(1)
        its = [iter(loader) for loader in loaders]
        read = [i for it in its for _ in range(k) for i in _ids(next(it))]
        state = loaders[0].state_dict()
        assert state["order_group"] == 24 and sorted(read) == sorted(order[:8 * k])
        again = _loaders(ds, 3, 5)
        for loader in again:
            loader.load_state_dict(state)
        rest = [[_ids(b) for b in loader] for loader in again]
        assert len({len(r) for r in rest}) == 1
        got = [i for rank in rest for batch in rank for i in batch]
        padding = len(got) - (N - 8 * k)
        assert 0 <= padding < 3
        assert sorted(got) == sorted(order[8 * k:] + order[:padding])


def test_bad_arguments_are_refused_naming_the_fix(tokens: Any, shm_dir: str) -> None:
    ds, source = tokens
    with pytest.raises(ValueError, match=r"group_size= sizes the length groups of group_by_length="):
        ds.loader(batch_size=4, group_size=10)
    with pytest.raises(ValueError, match=r"group_by_length= names the field whose lengths group the batches, one of"):
        ds.loader(batch_size=4, group_by_length="tokens")
    with pytest.raises(ValueError, match=r"a sampler or batch_sampler chooses another"):
        ds.loader(batch_size=4, group_by_length="input_ids", sampler=range(N))
    with pytest.raises(ValueError, match=r"group_size must be an int >= 1"):
        ds.loader(batch_size=4, group_by_length="input_ids", group_size=0)
    with pytest.raises(ValueError, match=r"group_by_length= is ds.loader\(\)'s: a mixture's batches are composed"):
        Mixture([ds], counts=[N]).loader(batch_size=4, group_by_length="input_ids")
    cold = MmapCachedDataset(f"{shm_dir}/cold", source)
    with pytest.raises(SampleNotCachedError, match="fill it first"):
        next(iter(cold.loader(batch_size=4, group_by_length="input_ids")))
    cold.close()
