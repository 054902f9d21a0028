"""Sample round trips: every supported leaf type and nesting comes back exactly, with its type; unsupported leaves
and layout changes are refused with the field path; returned samples never alias the cache; indexing rules."""

from __future__ import annotations

import collections
import os
import pickle
from typing import Any

import numpy as np
import pytest
import torch

from helpers.core_workers import NUMPY_DTYPES, TORCH_DTYPES, AllLeaves, ChangesLayout, OddViews, Point, exact, resolved
from helpers.sources import Counting, ImageLabels, sample_equal
from mmapcache import LayoutError, MmapCachedDataset

Sample = collections.namedtuple("Sample", ["image", "target"])  # module level: importable, so hits rebuild it


def _filled(path: str, source: Any) -> MmapCachedDataset:
    """A cache with every sample of ``source`` stored, reopened without the source so every read is a hit."""
    with MmapCachedDataset(path, source) as ds:
        created = ds.num_cached  # the first sample and the probes, stored when the layout was learnt
        assert ds.fill() + created == len(source)
    return MmapCachedDataset(path)


def test_every_leaf_type_round_trips_exactly(cache_path: str) -> None:
    source = AllLeaves(6)
    with _filled(cache_path, source) as ds:
        assert ds.num_cached == 6
        for i in range(6):
            hit, expected = ds[i], source[i]
            assert exact(hit, expected), f"sample {i} differs from the source"


def test_hit_has_the_types_the_source_returned(cache_path: str) -> None:
    source = AllLeaves(3)
    with _filled(cache_path, source) as ds:
        hit = ds[1]
    assert type(hit) is dict and list(hit) == ["tensors", "arrays", "scalars", "deep", "empty_tensor",
                                               "scalar_tensor", "point"]
    assert [t.dtype for t in hit["tensors"].values()] == TORCH_DTYPES
    assert all(type(t) is torch.Tensor and not t.requires_grad for t in hit["tensors"].values())
    assert type(hit["arrays"]) is list
    assert [(type(a), a.dtype) for a in hit["arrays"]] == [(np.ndarray, dt) for dt in NUMPY_DTYPES]
    scalars = hit["scalars"]
    assert type(scalars) is tuple
    assert [type(s) for s in scalars[:4]] == [int, float, bool, float]
    assert scalars[0] == 1 * 7 - 3 and scalars[2] is False
    assert [type(s) for s in scalars[4:]] == [np.float32, np.int8, np.uint64, np.bool_, np.complex64, np.float16,
                                              np.int64]
    assert scalars[6] == np.uint64(2**64 - 2) and scalars[10] == np.int64(-(2**63) + 1)
    point, inner = hit["deep"]["a"][0]
    assert type(hit["deep"]["a"]) is list and type(hit["deep"]["a"][0]) is tuple
    assert type(point) is Point and point._fields == ("x", "y") and type(point.y) is int
    assert type(inner["b"][0]) is np.int16
    assert hit["empty_tensor"].shape == (0, 3) and hit["empty_tensor"].dtype == torch.float32
    assert hit["scalar_tensor"].shape == () and hit["scalar_tensor"].item() == 1
    assert type(hit["point"]) is Point and [type(v) for v in hit["point"].y] == [int, float, bool]


def test_nan_and_negative_zero_keep_their_bits(cache_path: str) -> None:
    with _filled(cache_path, AllLeaves(3)) as ds:
        assert np.isnan(ds[2]["scalars"][3])
        zero = ds[1]["scalars"][3]
        assert zero == 0.0 and np.copysign(1.0, zero) == -1.0


def test_common_shapes_of_samples(cache_path: str, shm_dir: str) -> None:
    """The forms real datasets return: a bare tensor, a bare int, a list pair, a dict of tensors."""
    forms = {
        "tensor": lambda i: torch.full((2, 2), i, dtype=torch.float16),
        "int": lambda i: i * 3,
        "list": lambda i: [torch.arange(3) + i, i],
        "dict": lambda i: {"x": np.full(3, i, np.float32), "y": {"z": torch.tensor([i], dtype=torch.bfloat16)}},
        "namedtuple": lambda i: Sample(torch.ones(2) * i, i % 2 == 1),
        "unsorted-keys": lambda i: {"z": i, "a": float(i), "m": [np.uint8(i)]},
        "deep": lambda i: _nest(30, torch.tensor([i, -i], dtype=torch.int16)),
    }
    for name, make in forms.items():
        source = [make(i) for i in range(5)]
        with _filled(f"{shm_dir}/{name}", source) as ds:
            for i in range(5):
                assert sample_equal(ds[i], source[i]), (name, i)
                assert type(ds[i]) is type(source[i])


def _nest(depth: int, leaf: Any) -> Any:
    """A leaf inside ``depth`` alternating list/tuple/dict levels."""
    for level in range(depth):
        leaf = [leaf] if level % 3 == 0 else (leaf, level) if level % 3 == 1 else {f"k{level}": leaf}
    return leaf


def test_dict_key_that_is_not_a_str_is_refused(cache_path: str) -> None:
    with pytest.raises(LayoutError, match=r"field 'x': dict key 3 is a int, expected str"):
        MmapCachedDataset(cache_path, [{"x": {3: torch.zeros(1)}}] * 2)


def test_views_and_grad_tensors_are_stored_by_value(cache_path: str) -> None:
    source = OddViews(5)
    with _filled(cache_path, source) as ds:
        for i in range(5):
            hit = ds[i]
            assert sample_equal(hit, resolved(source[i])), f"sample {i}"
            assert not hit["grad"].requires_grad and not hit["conj"].is_conj() and not hit["neg"].is_neg()
            assert torch.equal(hit["conj"], source[i]["conj"])  # same values as the conj view


def test_getitems_equals_per_sample_reads(cache_path: str) -> None:
    source = AllLeaves(6)
    with _filled(cache_path, source) as ds:
        order = [5, 0, 3, 3, -1, 2]
        batch = ds.__getitems__(order)
        assert len(batch) == len(order)
        for index, got in zip(order, batch):
            assert exact(got, ds[index]) and exact(got, source[index % 6])
    # a batch mixing hits and misses (misses computed and stored on the way)
    with MmapCachedDataset(f"{cache_path}-cold", ImageLabels(100)) as ds:
        probed = ds.num_cached  # sample 0 and the creator's probes (14, 28, ...): not 1, 4 or 7
        ds[4]
        batch = ds.__getitems__([4, 7, 1, 4])
        assert all(sample_equal(got, ImageLabels(100)[i]) for i, got in zip([4, 7, 1, 4], batch))
        assert all(type(got) is tuple and type(got[1]) is int for got in batch)
        assert [ds.is_cached(i) for i in (0, 1, 4, 7)] == [True, True, True, True] and ds.num_cached == probed + 3


def test_in_place_edits_of_returned_samples_do_not_reach_the_cache(cache_path: str) -> None:
    source = AllLeaves(4)
    with _filled(cache_path, source) as ds:
        sample = ds[1]
        for t in sample["tensors"].values():
            t.view(torch.uint8).fill_(0x5A)
        for a in sample["arrays"]:
            a.view(np.uint8)[...] = 0x5A
        sample["deep"]["a"][0][0].x.add_(1)
        for got in ds.__getitems__([1, 2, 1]):
            for t in got["tensors"].values():
                t.view(torch.uint8).fill_(0xA5)
            for a in got["arrays"]:
                a.view(np.uint8)[...] = 0xA5
        for i in range(4):
            assert exact(ds[i], source[i]), f"an edit reached sample {i} in the cache"
        assert exact(ds.__getitems__([1, 2]), [source[1], source[2]])


def test_in_place_edits_through_a_dataloader_do_not_reach_the_cache(cache_path: str) -> None:
    source = ImageLabels(12)
    with _filled(cache_path, source) as ds:
        for batch_size in (None, 4):
            for batch in torch.utils.data.DataLoader(ds, batch_size=batch_size):
                batch[0].fill_(7)
        for i in range(12):
            assert sample_equal(ds[i], source[i])


def test_transform_is_applied_after_the_cache_and_never_stored(cache_path: str) -> None:
    source = ImageLabels(6)

    def flip(sample: Any) -> Any:
        image, label = sample
        return image.flip(-1), label + 100

    with MmapCachedDataset(cache_path, source, transform=flip) as ds:
        first = [ds[i] for i in range(6)]  # misses
        second = ds.__getitems__(list(range(6)))  # hits
        for i in range(6):
            assert sample_equal(first[i], flip(source[i])) and sample_equal(second[i], flip(source[i]))
    with MmapCachedDataset(cache_path) as raw:
        assert all(sample_equal(raw[i], source[i]) for i in range(6))


def test_negative_and_out_of_range_indices(cache_path: str) -> None:
    source = ImageLabels(7)
    with MmapCachedDataset(cache_path, source) as ds:
        assert len(ds) == 7
        assert sample_equal(ds[-1], source[6]) and sample_equal(ds[-7], source[0])
        assert ds.is_cached(6) and ds.is_cached(-1)
        assert sample_equal(ds[np.int64(3)], source[3]) and sample_equal(ds[torch.tensor(2)], source[2])
        for bad in (7, -8, 100, -100):
            with pytest.raises(IndexError, match=f"index {bad} is out of range .* of length 7"):
                ds[bad]
            with pytest.raises(IndexError, match=f"index {bad} is out of range"):
                ds.__getitems__([0, bad])
            with pytest.raises(IndexError):
                ds.is_cached(bad)
        for bad in (1.0, "3", None, True):
            with pytest.raises(TypeError, match="integers"):
                ds[bad]
        assert sample_equal(ds.__getitems__([-2, -7]), [source[5], source[0]])
        assert len(list(ds)) == 7  # iteration stops at the IndexError, like a list


@pytest.mark.parametrize(
    ("leaf", "path", "words"),
    [
        (None, "meta.name", ["NoneType", "None"]),
        (np.array(["a", "b"], dtype=object), "meta.name", ["dtype object", "numeric"]),
        (np.array(["ab"]), "meta.name", ["<U2", "numeric"]),
        (2**70, "meta.name", ["int64"]),
        (torch.sparse_coo_tensor([[0]], [1.0], (2,), check_invariants=True), "meta.name", ["sparse", "to_dense"]),
    ],
    ids=["None", "object-array", "unicode-array", "huge-int", "sparse-tensor"],
)
def test_unsupported_leaf_names_field_path_type_and_hint(cache_path: str, leaf: Any, path: str,
                                                         words: list[str]) -> None:
    source = [(torch.zeros(2), {"meta": {"id": 1, "name": leaf}})] * 3
    with pytest.raises(LayoutError) as info:
        MmapCachedDataset(cache_path, source)
    message = str(info.value)
    assert "'1.meta.name'" in message
    for word in words:
        assert word in message
    assert not os.path.exists(cache_path)  # nothing was created


def test_pil_image_leaf_is_refused_with_a_conversion_hint(cache_path: str) -> None:
    image_module = pytest.importorskip("PIL.Image")
    source = [{"img": image_module.new("RGB", (4, 4)), "y": 0}] * 2
    with pytest.raises(LayoutError, match=r"'img'.*Image.*PILToTensor"):
        MmapCachedDataset(cache_path, source)


def test_later_sample_with_a_different_layout_is_refused_and_not_stored(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, ChangesLayout(8, bad=5)) as ds:
        for i in range(5):
            ds[i]
        before = ds.num_cached
        with pytest.raises(LayoutError) as info:
            ds[5]
        message = str(info.value)
        assert "sample 5" in message and "'0'" in message and "uint8" in message and "float32" in message
        assert not ds.is_cached(5) and ds.num_cached == before
        with pytest.raises(LayoutError, match="sample 5"):
            ds.__getitems__([6, 5])
        assert not ds.is_cached(5)
        assert sample_equal(ds[6], ImageLabels(8)[6])


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda s: (s[0][:2], s[1]), ["field '0'", "shape", "max_shapes"]),
        (lambda s: (s[0], float(s[1])), ["field '1'", "int", "float"]),
        (lambda s: [s[0], s[1]], ["structure", "tuple", "list"]),
        (lambda s: (s[0], s[1], 0), ["structure"]),
        (lambda s: {"image": s[0], "label": s[1]}, ["structure", "dict"]),
    ],
    ids=["shape", "scalar-type", "tuple-to-list", "extra-field", "to-dict"],
)
def test_layout_changes_name_index_and_what_differs(cache_path: str, change: Any, words: list[str]) -> None:
    base = ImageLabels(20)
    source = [base[i] for i in range(20)]
    source[3] = change(base[3])  # not among the samples the creator probes (0, 2, 5, 8, ...)
    with MmapCachedDataset(cache_path, source) as ds:
        probed = ds.num_cached
        ds[1]
        with pytest.raises(LayoutError) as info:
            ds[3]
        assert "sample 3" in str(info.value)
        for word in words:
            assert word in str(info.value)
        assert not ds.is_cached(3) and ds.num_cached == probed + 1


def test_dataset_pickle_carries_no_mapped_data(cache_path: str) -> None:
    source = ImageLabels(64, shape=(3, 64, 64))  # about 800 KB of samples
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        blob = pickle.dumps(ds)
        assert len(blob) < 2000, f"pickled dataset is {len(blob)} bytes"
        copy = pickle.loads(blob)
        assert copy.path == ds.path and sample_equal(copy[9], source[9])
        copy.close()
    with MmapCachedDataset(cache_path) as ro:
        ro[3]
        assert len(pickle.dumps(ro)) < 2000  # path, options, the shared epoch cell: never the 800 KB of samples
        again = pickle.loads(pickle.dumps(ro))
        assert sample_equal(again[3], source[3])
        again.close()


def test_miss_calls_source_once_and_hits_never(cache_path: str, tmp_path: Any) -> None:
    source = Counting(ImageLabels(10), str(tmp_path / "calls"))
    with MmapCachedDataset(cache_path, source) as ds:
        for _ in range(3):
            for i in range(10):
                ds[i]
            ds.__getitems__(list(range(10)))
    assert sorted(source.calls()) == list(range(10))
