"""Variable shapes: fields declared in ``max_shapes`` store each sample's actual shape beside the data, and a hit
returns exactly the stored value, through every read path, including numpy alone."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from helpers.feature_workers import list_collate, pad_collate
from helpers.sources import Counting, sample_equal
from mmapcache import CacheMismatchError, LayoutError, MmapCachedDataset, PadCollate


class Images(Dataset):
    """``{"image": uint8 (3, h, w), "meta": (float32 boxes (b, 4), int)}`` with sizes varying per index."""

    def __init__(self, n: int = 24, big: int | None = None) -> None:
        self.n, self.big = n, big

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        h, w = 8 + index % 5 * 3, 20 - index % 7 * 2
        if index == self.big:
            h = 40
        g = torch.Generator().manual_seed(index)
        image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
        boxes = np.arange(index % 4 * 4, dtype=np.float32).reshape(-1, 4) + index  # 0 boxes for index % 4 == 0
        return {"image": image, "meta": (boxes, index)}


class Sequences(Dataset):
    """``(int64 tokens of length index % 6, label)``: length 0 for every sixth sample."""

    def __init__(self, n: int = 18) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return torch.arange(index % 6, dtype=torch.int64) * 10 + index, index % 3


MAX = {"image": (3, 32, 32), "meta.0": (3, 4)}


def test_hits_return_exactly_the_stored_shape(cache_path: str, tmp_path: Any) -> None:
    source = Counting(Images(), str(tmp_path / "calls"))
    with MmapCachedDataset(cache_path, source, max_shapes=MAX) as ds:
        misses = [ds[i] for i in range(len(ds))]
        calls = len(source.calls())
        hits = [ds[i] for i in range(len(ds))]
        batch = ds.__getitems__(list(range(len(ds)))[::-1])
        assert len(source.calls()) == calls  # the second pass and the batch were all hits
        for i in range(len(ds)):
            expected = source.inner[i]
            assert sample_equal(misses[i], expected)
            assert sample_equal(hits[i], expected)  # not padded: the actual shape, dtype and bytes
            assert sample_equal(batch[len(ds) - 1 - i], expected)
            assert hits[i]["image"].is_contiguous()
        assert {tuple(h["meta"][0].shape) for h in hits} == {(0, 4), (1, 4), (2, 4), (3, 4)}


def test_zero_length_sequences(cache_path: str) -> None:
    source = Sequences()
    with MmapCachedDataset(cache_path, source, max_shapes={"0": (8,)}) as ds:
        assert ds[0][0].shape == (0,)  # the very first sample, the layout probe, is empty
        for _ in range(2):
            assert all(sample_equal(ds[i], source[i]) for i in range(len(ds)))
            assert all(sample_equal(s, source[i]) for i, s in enumerate(ds.__getitems__(list(range(len(ds))))))
        assert ds.num_cached == len(ds)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_dataloader_workers_with_a_padding_collate(cache_path: str, start: str) -> None:
    source = Sequences()
    with MmapCachedDataset(cache_path, source, max_shapes={"0": (8,)}) as ds:
        ds.fill()
        expected = [pad_collate([source[i] for i in range(k, min(k + 4, len(ds)))]) for k in range(0, len(ds), 4)]
        loaders = [ds.loader(batch_size=4, num_workers=2, collate_fn=pad_collate, multiprocessing_context=start,
                             timeout=120)]
        if start == "fork":  # spawned workers cost seconds each here: the plain DataLoader once, with fork
            loaders.append(DataLoader(ds, batch_size=4, num_workers=2, collate_fn=pad_collate,
                                      multiprocessing_context=start, timeout=120))
        for loader in loaders:
            got = list(loader)
            assert len(got) == len(expected)
            for (padded, labels, lengths), (want_padded, want_labels, want_lengths) in zip(got, expected):
                assert torch.equal(padded, want_padded) and torch.equal(labels, want_labels)
                assert lengths == want_lengths


def test_loader_with_a_list_collate_returns_the_stored_samples(cache_path: str) -> None:
    source = Images()
    with MmapCachedDataset(cache_path, source, max_shapes=MAX) as ds:
        loader = ds.loader(batch_size=5, shuffle=False, collate_fn=list_collate, num_workers=2,
                           multiprocessing_context="fork", timeout=120)
        for _ in range(2):  # misses in workers, then hits
            samples = [s for batch in loader for s in batch]
            assert len(samples) == len(source)
            assert all(sample_equal(s, source[i]) for i, s in enumerate(samples))


def test_numpy_alone_reads_a_variable_field(cache_path: str) -> None:
    """The documented recipe: row ``r``'s value is the first ``prod(shape)`` elements of ``<field>.npy[r]``,
    reshaped to ``<field>.shape.npy[r]``; a row is valid when its bit in ``filled.bits`` is set."""
    source = Images()
    with MmapCachedDataset(cache_path, source, max_shapes=MAX) as ds:
        ds.fill(range(0, len(source), 2))  # only even samples
    with open(os.path.join(cache_path, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    image_spec = next(f for f in meta["fields"] if f["name"] == "image")
    assert image_spec["variable"] and image_spec["shape"] == [3, 32, 32]
    assert image_spec["file"] == "image.npy" and image_spec["shape_file"] == "image.shape.npy"
    data = np.load(os.path.join(cache_path, image_spec["file"]), mmap_mode="r")
    shapes = np.load(os.path.join(cache_path, image_spec["shape_file"]))
    filled = np.unpackbits(np.fromfile(os.path.join(cache_path, "filled.bits"), np.uint8), bitorder="little")
    assert data.shape == (len(source), 3, 32, 32) and shapes.shape == (len(source), 3) and shapes.dtype == np.int64
    for row in range(len(source)):  # no slot_index and one variant: row == index
        assert filled[row] == (row % 2 == 0)
        if not filled[row]:
            continue
        shape = tuple(shapes[row])
        image = np.asarray(data[row]).reshape(-1)[: int(np.prod(shape))].reshape(shape)
        assert np.array_equal(image, source[row]["image"].numpy())


def test_shape_beyond_the_maximum_names_field_shape_limit_and_fix(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Images(big=5), max_shapes=MAX) as ds:
        with pytest.raises(LayoutError) as caught:
            ds[5]
        message = str(caught.value)
        for part in ("sample 5", "'image'", "(3, 40, 10)", "(3, 32, 32)", "max_shapes={'image': (3, 40, 32)}"):
            assert part in message, (part, message)
        assert not ds.is_cached(5)
        with pytest.raises(LayoutError, match="sample 5, field 'image'"):
            ds.__getitems__([4, 5])
        assert sample_equal(ds[4], Images()[4])  # other samples are unaffected


def test_wrong_number_of_dimensions_is_refused(cache_path: str) -> None:
    with pytest.raises(LayoutError, match=r"field 'image': shape \(3, 8, 20\) does not fit the declared maximum "
                                          r"shape \(32, 32\)"):
        MmapCachedDataset(cache_path, Images(), max_shapes={"image": (32, 32)})


def test_undeclared_varying_field_points_to_ragged_not_to_the_largest_shape_so_far(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Images(), ragged=None) as ds:  # no probes: the layout of sample 0 alone
        with pytest.raises(LayoutError) as caught:
            ds[1]
        message = str(caught.value)
        assert "sample 1, field 'image': expected shape (3, 8, 20), found (3, 11, 18)" in message
        # Before: "max_shapes={'image': (3, 11, 20)}", the largest shape seen so far, so users raised the limit one
        # failure at a time. Now: ragged (any size), 'auto', or a maximum the user chooses, and how to replace the
        # cache whose layout is wrong.
        assert "ragged=['image']" in message and "ragged='auto'" in message
        assert "max_shapes={'image': ...}" in message and "overwrite=True" in message
        assert "(3, 11, 20)" not in message
    with MmapCachedDataset(cache_path, Images(), ragged=["image", "meta.0"], overwrite=True) as ds:
        for i in range(len(ds)):
            assert sample_equal(ds[i], Images()[i])


def test_unknown_field_in_max_shapes(cache_path: str) -> None:
    with pytest.raises(LayoutError, match=r"max_shapes names unknown field\(s\) \['img'\]; the sample's fields are "
                                          r"'image', 'meta.0', 'meta.1'"):
        MmapCachedDataset(cache_path, Images(), max_shapes={"img": (3, 32, 32)})


def test_max_shapes_is_recorded_and_checked_on_reopen(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Images(), max_shapes=MAX) as ds:
        ds[3]
    with MmapCachedDataset(cache_path, Images()) as ds:  # recorded: no need to repeat it
        assert sample_equal(ds[3], Images()[3]) and sample_equal(ds[4], Images()[4])
    with MmapCachedDataset(cache_path) as ds:
        assert sample_equal(ds[3], Images()[3])
    with pytest.raises(CacheMismatchError, match="max_shapes"):
        MmapCachedDataset(cache_path, Images(), max_shapes={"image": (3, 64, 64), "meta.0": (3, 4)})
    with MmapCachedDataset(cache_path, Images(), max_shapes={"image": (3, 64, 64), "meta.0": (3, 4)},
                           overwrite=True) as ds:
        assert ds._store.data[0].shape[1:] == (3, 64, 64)


@pytest.mark.parametrize("bad, message", [
    ({"image": (3, -1, 4)}, "max_shapes\\['image'\\] must be a tuple of non-negative ints"),
    ({"image": (3, 2.5, 4)}, "max_shapes\\['image'\\] must be a tuple of non-negative ints"),
    ([("image", (3, 4, 4))], "max_shapes must be a dict of field path -> shape"),
])
def test_bad_max_shapes(cache_path: str, bad: Any, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        MmapCachedDataset(cache_path, Images(), max_shapes=bad)


def test_variable_shapes_with_variants_and_a_partial_cache(cache_path: str) -> None:
    """Shape rows follow data rows (slot * K + v) when the features combine."""
    source = Sequences(12)
    with MmapCachedDataset(cache_path, source, max_shapes={"0": (8,)}, variants=2, cache_indices=[5, 0, 7, 2]) as ds:
        for epoch in range(4):
            ds.set_epoch(epoch)
            for _ in range(2):
                assert all(sample_equal(ds[i], source[i]) for i in range(12))
                assert all(sample_equal(s, source[i]) for i, s in enumerate(ds.__getitems__(list(range(12)))))
        assert ds.num_cached == 4  # the 4 cacheable samples' variants for the current epoch (8 rows in all)
        shapes = ds._store.shapes[0]
        for slot, index in enumerate([5, 0, 7, 2]):
            assert shapes[2 * slot].tolist() == shapes[2 * slot + 1].tolist() == [index % 6]


class _ImageAndTokens(Dataset):
    """A ``max_shapes`` image beside ragged token ids (top level and nested): a cache read one sample at a time."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> Any:
        ids = torch.arange(1 + index % 5) + 100 * index
        return {"img": torch.zeros(2, 3), "input_ids": ids, "meta": {"ids": ids + 1}}


def test_ragged_fields_beside_a_max_shapes_field_are_listed_by_default_collation(cache_path: str) -> None:
    """Found by review: with a ``max_shapes`` field, batches are read sample by sample, whose ragged tensors were not
    marked as a gathered batch's are, so default collation stacked them and failed ("stack expects each tensor to be
    equal size"), also with the guide's ``PadCollate(fields=[the max_shapes field])``. They come back as the list of
    their values, as the guide says a ragged field does."""
    source = _ImageAndTokens()
    with MmapCachedDataset(cache_path, source, max_shapes={"img": (2, 4)}) as ds:
        assert ds._ensure_open().variable
        for _state in ("cold", "warm"):
            for make in (lambda: DataLoader(ds, batch_size=7), lambda: ds.loader(batch_size=7),
                         lambda: ds.loader(batch_size=7, num_workers=2),
                         lambda: ds.loader(batch_size=7, collate_fn=PadCollate(0, fields=["img"]))):
                seen = []
                for batch in make():
                    ids, nested = batch["input_ids"], batch["meta"]["ids"]
                    assert isinstance(ids, list) and isinstance(nested, list)
                    first = [int(t[0]) // 100 for t in ids]
                    assert all(torch.equal(t, source[i]["input_ids"]) for t, i in zip(ids, first))
                    assert all(torch.equal(t, source[i]["meta"]["ids"]) for t, i in zip(nested, first))
                    seen += first
                assert sorted(seen) == list(range(20))
            ds.fill()


def test_a_ragged_field_under_a_dotted_key_beside_a_max_shapes_field_is_listed(cache_path: str) -> None:
    """Found by review: a dict key holding a dot (``"tok.ids"``) is named as ``{"tok": {"ids": ...}}`` is, and the
    marking of ragged values read one by one looked only for the nested form: stacked, and failed."""

    class Dotted(Dataset):
        def __len__(self) -> int:
            return 12

        def __getitem__(self, index: int) -> Any:
            return {"img": torch.zeros(2, 3), "tok.ids": torch.arange(1 + index % 4) + 10 * index}

    with MmapCachedDataset(cache_path, Dotted(), max_shapes={"img": (2, 4)}) as ds:
        ds.fill()
        for batch in ds.loader(batch_size=5):
            assert isinstance(batch["tok.ids"], list)
            assert all(torch.equal(t, Dotted()[int(t[0]) // 10]["tok.ids"]) for t in batch["tok.ids"])
