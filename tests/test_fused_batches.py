"""The fused path of ``PadCollate`` and ``TextCollate`` (``read.heap_batch``): a warm batch copied straight from the
heaps into the padded tensors, for one cache or a mixture's sources at once. It must give exactly what the checked
path gives (the collate over the source's samples), for every kind of field a padded batch holds, and leave damage
to the checked path, which reports it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from helpers.text_sources import Tokenized
from mmapcache import CacheFormatError, Mixture, MmapCachedDataset, PadCollate, TextCollate

N = 48


class Kinds(torch.utils.data.Dataset):
    """Ragged fields of every kind the fused path pads (int64 and bfloat16 tensors, an int16 array, a list of
    numbers), one it leaves to the checked path (2-D values), text, and fixed fields."""

    def __init__(self, n: int = N, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        i += self.offset
        length = 1 + (i * 5) % 11
        return {
            "ids": torch.arange(length) + 1000 * i,
            "half": (torch.arange(length, dtype=torch.float32) / 8 + i).to(torch.bfloat16),
            "small": np.arange(length, dtype=np.int16) - i,
            "listed": [i] * (i % 4 + 1),
            "boxes": torch.full((length % 3 + 1, 4), float(i)),
            "caption": "x" * length,
            "label": i,
            "image": torch.full((2, 2), i, dtype=torch.uint8),
        }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple) and hasattr(a, "_fields"):
        return type(a) is type(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(
            (a.view(torch.int16) == b.view(torch.int16)).all() if a.dtype == torch.bfloat16 else torch.equal(a, b))
    return type(a) is type(b) and a == b


@pytest.fixture
def no_checked_gather(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the batches the checked gather reads (the fused path reads none of a warm cache's)."""
    calls: list[int] = []
    original = MmapCachedDataset.gather_columns

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MmapCachedDataset, "gather_columns", counted)
    return calls


RAGGED = ["ids", "half", "small", "listed", "boxes"]


@pytest.mark.parametrize("collate", [
    PadCollate(0), PadCollate(7, mask=True), PadCollate(-1, fields=["ids", "small"]),
    PadCollate(0, fields=["ids", "half", "small", "listed"]),
])
def test_a_warm_batch_is_padded_from_the_heaps_as_the_checked_path_pads_it(cache_path: str, collate: PadCollate,
                                                                            no_checked_gather: list[int]) -> None:
    """Against the checked gather's batch, and (where every ragged field is padded) the collate over the samples."""
    source = Kinds()
    with MmapCachedDataset(cache_path, source, ragged=[*RAGGED[:3], "boxes"]) as ds:
        ds.fill()
        every = PadCollate(collate.pad_value, mask=collate.mask, fields=collate.fields or RAGGED)
        for indices in (list(range(8)), [47, 3, 3, 20, 0], [5]):
            no_checked_gather.clear()
            got = ds.read_batch(indices, 0, collate)
            fused = not no_checked_gather
            assert fused == (collate.fields is not None and "boxes" not in collate.fields)  # (2-D: checked path)
            checked = ds.collate_columns(ds.gather_columns(np.array(indices), 0), collate)
            assert _same(got, checked), indices
            if set(every.fields or ()) >= set(RAGGED):
                assert _same(got, every([source[i] for i in indices])), indices


@pytest.mark.parametrize("collate", [PadCollate(-1, mask=True, fields=["ids", "small"]),
                                     TextCollate(pad={"ids": -1, "small": 0}, fields=["ids", "small"],
                                                 labels="ids")])
def test_held_warm_batches_are_never_overwritten_by_recycled_buffers(cache_path: str, collate: Any,
                                                                     no_checked_gather: list[int]) -> None:
    """The fused path pads into recycled buffers (``read.gather.BufferPool.bytes``) in the main process: a batch, or a
    view of one of its tensors, that the caller still holds is never reused; dropped ones are, and are padded anew
    wholly (a wider batch after a narrower one, and the other way round)."""
    with MmapCachedDataset(cache_path, Kinds(), ragged=RAGGED) as ds:
        ds.fill()
        orders = [list(range(k, N, 7)) for k in range(7)] + [[5], [47, 3, 3, 20, 0]]
        # The checked path's batches, copied out of any buffer first (they are compared with the fused ones after).
        wanted = {tuple(i): _copied(ds.collate_columns(ds.gather_columns(np.array(i), 0), collate)) for i in orders}
        no_checked_gather.clear()
        held = [ds.read_batch(indices, 0, collate) for indices in orders]  # every batch held
        views = [_padded(ds.read_batch(indices, 0, collate))[1:] for indices in orders]  # a view of each
        assert not no_checked_gather  # (all of them fused)
        for got, view, indices in zip(held, views, orders):
            assert _same(got, wanted[tuple(indices)]), indices
            assert torch.equal(view, _padded(wanted[tuple(indices)])[1:]), indices
        for _ in range(3):  # dropped at once: recycled and padded again
            for indices in orders[::-1] + orders:
                assert _same(ds.read_batch(indices, 0, collate), wanted[tuple(indices)]), indices


def _copied(batch: Any) -> Any:
    """A batch with every tensor cloned (nothing shared with a buffer that may be recycled)."""
    if isinstance(batch, dict):
        return {k: _copied(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_copied(x) for x in batch))
    if isinstance(batch, list):
        return [_copied(x) for x in batch]
    return batch.clone() if isinstance(batch, torch.Tensor) else batch


def _padded(batch: Any) -> torch.Tensor:
    """A batch's padded ids (``PadCollate``'s ``Padded.data`` or ``TextCollate``'s tensor)."""
    return batch["ids"].data if hasattr(batch["ids"], "data") and not isinstance(batch["ids"], torch.Tensor) \
        else batch["ids"]


def test_a_mixtures_batch_is_padded_from_every_sources_heaps_at_once(shm_dir: str,
                                                                      no_checked_gather: list[int]) -> None:
    """Three sources, one with ids stored narrower (store_as): each batch equals the collate over its samples."""
    sources = [Kinds(20), Kinds(12, offset=100), Kinds(9, offset=200)]
    caches = [MmapCachedDataset(f"{shm_dir}/m{k}", s, ragged=["ids", "half", "small", "boxes"],
                                store_as={"ids": "int32"} if k == 1 else None) for k, s in enumerate(sources)]
    for ds in caches:
        ds.fill()
    mixture = Mixture(caches, counts=[20, 12, 9], seed=1)
    fields = ["ids", "half", "small", "listed"]
    for collate in (PadCollate(3, mask=True, fields=fields), TextCollate(0, fields=fields, attention_mask="mask")):
        no_checked_gather.clear()
        seen = []
        for batch, which in mixture.loader(batch_size=6, collate_fn=collate, return_source=True):
            labels = batch["label" if isinstance(collate, PadCollate) else "labels"].tolist()  # (as HF names it)
            samples = [sources[s][label - 100 * s] for label, s in zip(labels, which.tolist())]
            expected = collate([{k: v for k, v in x.items() if k != "boxes"} for x in samples])
            assert _same({k: v for k, v in batch.items() if k != "boxes"}, expected)
            assert _same(batch["boxes"], [x["boxes"] for x in samples])
            seen += labels
        assert sorted(seen) == sorted(list(range(20)) + list(range(100, 112)) + list(range(200, 209)))
        assert not no_checked_gather
    for ds in caches:
        ds.close()


@pytest.mark.parametrize("damage", ["past the heap", "negative offset", "misaligned", "past its extent"])
@pytest.mark.parametrize("collate", [PadCollate(0), TextCollate(0)])
def test_an_index_row_that_describes_no_value_is_reported_not_read(cache_path: str, damage: str,
                                                                    collate: Any) -> None:
    # (A fingerprint: an opener without one compares a few stored samples at random, and may meet row 4 first.)
    with MmapCachedDataset(cache_path, Tokenized(N), fingerprint="tokens") as ds:
        ds.fill()
    index = np.load(f"{cache_path}/input_ids.index.npy", mmap_mode="r+")
    offset, extent, length = (int(x) for x in index[4])
    index[4] = {"past the heap": (1 << 40, extent, length), "negative offset": (-8, extent, length),
                "misaligned": (offset + 3, extent, length), "past its extent": (offset, extent, length + 64)}[damage]
    index.flush()
    del index
    with MmapCachedDataset(cache_path, Tokenized(N), fingerprint="tokens") as ds, pytest.raises(
            CacheFormatError, match=r"row 4, field 'input_ids': the stored value cannot be read.*the cache is damaged"):
        for _ in ds.loader(batch_size=8, collate_fn=collate):
            pass


class FixedLength(torch.utils.data.Dataset):
    """Token ids a tokenizer padded to one length (``padding="max_length"``), beside ragged ones: the cache stores
    ``input_ids`` as a fixed field."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": torch.arange(6) + 10 * i, "extra": torch.arange(1 + i % 5),
                "image": torch.full((2, 3), i, dtype=torch.uint8), "label": i}


@pytest.mark.parametrize("mask", [False, True])
def test_a_fixed_field_named_in_fields_is_padded_as_over_samples(cache_path: str, mask: bool) -> None:
    """``PadCollate(fields=[...])`` pads every named field over samples, values of one shape too; over a cache a
    named field stored fixed must come back the same way (a ``Padded``, every length full), not as a plain tensor:
    the fused path, the checked one and the loader's, and a mixture's."""
    collate = PadCollate(3, mask=mask, fields=["input_ids", "extra", "image"])
    source = FixedLength()
    with MmapCachedDataset(cache_path, source) as ds:
        ragged = {f.name: f.ragged for f in ds._store.layout.fields}
        assert not ragged["input_ids"] and not ragged["image"] and ragged["extra"]
        ds.fill()
        for indices in (list(range(8)), [47, 3, 3, 20, 0], [5]):
            want = collate([source[i] for i in indices])
            assert isinstance(want["input_ids"], tuple) and isinstance(want["image"], tuple)
            assert _same(ds.read_batch(indices, 0, collate), want), indices
            assert _same(ds.collate_columns(ds.gather_columns(np.array(indices), 0), collate), want), indices
        for workers in (0, 2):
            loader = ds.loader(batch_size=8, collate_fn=collate, num_workers=workers)
            for k, batch in enumerate(loader):
                assert _same(batch, collate([source[i] for i in range(8 * k, 8 * k + 8)])), (workers, k)
        refused = PadCollate(-1, fields=["image"])  # (uint8 values: refused over samples, so over the cache)
        for read in (lambda: refused([source[0]]), lambda: ds.read_batch([0], 0, refused)):
            with pytest.raises(ValueError, match="does not fit the values' dtype uint8"):
                read()
        mix = Mixture([ds], seed=0)
        for batch in mix.loader(batch_size=8, collate_fn=collate):
            ids = batch["input_ids"]
            assert isinstance(ids, tuple) and torch.equal(ids.lengths, torch.full((len(ids.data),), 6))
            assert (ids.mask is not None) == mask and (not mask or bool(ids.mask.all()))


def test_fields_of_the_same_lengths_get_equal_masks_each_its_own(cache_path: str,
                                                                  no_checked_gather: list[int]) -> None:
    """``input_ids`` and ``attention_mask`` share their lengths: the second's mask is copied from the first's, and
    stays its own (a mask changed in place changes no other field's)."""
    with MmapCachedDataset(cache_path, Tokenized(24, longest=50)) as ds:
        ds.fill()
        for indices in ([3, 17, 0, 9], [5]):
            batch = ds.read_batch(indices, 0, PadCollate(0, mask=True))
            ids, mask = batch["input_ids"], batch["attention_mask"]
            assert torch.equal(ids.mask, mask.mask)
            assert torch.equal(ids.mask.sum(1), ids.lengths)
            assert ids.mask.data_ptr() != mask.mask.data_ptr()
            ids.mask.zero_()
            assert torch.equal(mask.mask.sum(1), mask.lengths)
        assert not no_checked_gather


@pytest.mark.parametrize("flatten", [False, True])
def test_a_batch_whose_rows_a_writer_rewrote_between_two_fields_is_read_again(cache_path: str,
                                                                              monkeypatch: pytest.MonkeyPatch,
                                                                              flatten: bool) -> None:
    """A rewrite (``stale="serve"``: ``refresh`` and ``fill`` in another process, as ``build --follow`` does) that
    lands between the reads of ``input_ids`` and ``labels`` gives fields of different lengths. The batch must be
    read again, consistent; a flattened batch raised "not as long as" instead (found by review, 1 epoch in ~16,000
    batches under a real writer). Here the rewrite runs at that moment, in this process."""
    from mmapcache.read import heap_batch

    class Fresh(torch.utils.data.Dataset):  # each call: new tokens of a new length
        def __init__(self) -> None:
            self.calls = 0

        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, Any]:
            self.calls += 1
            ids = torch.arange(1 + (i + self.calls) % 13) + 100 * self.calls
            return {"input_ids": ids, "labels": ids.clone()}

    ds = MmapCachedDataset(cache_path, Fresh(), deterministic=False, stale="serve")
    ds.fill()
    located = heap_batch.WarmRows.located
    armed = [True]

    def rewritten_after_the_first(self: Any, k: int) -> Any:
        out = located(self, k)
        if armed[0]:
            armed[0] = False
            ds.refresh(indices=list(range(8)))
            ds.fill()
        return out

    monkeypatch.setattr(heap_batch.WarmRows, "located", rewritten_after_the_first)
    batch = ds.read_batch(list(range(8)), pad=TextCollate(flatten=flatten))
    assert not armed[0]  # (the rewrite ran between the fields)
    stored = [ds[i] for i in range(8)]
    wanted = TextCollate(flatten=flatten)(stored)
    assert all(torch.equal(batch[key], wanted[key]) for key in ("input_ids", "labels")), (batch, wanted)
    ds.close()
