"""Bad input to ``MmapCachedDataset``: a clear error naming the problem, and nothing written to the file system."""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from helpers.sources import ImageLabels
from mmapcache import CacheFormatError, LayoutError, MmapCachedDataset, MmapCacheError

# --- path -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [5, None, b"/dev/shm/x", "", 3.5, ["a"]])
def test_path_of_a_wrong_type(untouched: Any, path: Any) -> None:
    untouched(TypeError, r"cache path must be a non-empty str or os\.PathLike, got",
              lambda: MmapCachedDataset(path, ImageLabels(4)))


@pytest.mark.parametrize("name", [".", ".."])
def test_bare_name_that_is_no_name(untouched: Any, name: str) -> None:
    untouched(ValueError, rf"cache name '{name}' is not a name", lambda: MmapCachedDataset(name, ImageLabels(4)))


def test_path_that_is_a_regular_file(untouched: Any, shm_dir: str) -> None:
    target = os.path.join(shm_dir, "notes.txt")
    with open(target, "w") as f:
        f.write("keep me")
    untouched(CacheFormatError, r"notes\.txt is a file, not a cache directory",
              lambda: MmapCachedDataset(target, ImageLabels(4)))
    untouched(CacheFormatError, r"is a file, not a cache directory", lambda: MmapCachedDataset(target))
    untouched(MmapCacheError, r"notes\.txt is a file; the parent of a cache must be a directory",
              lambda: MmapCachedDataset(os.path.join(target, "cache"), ImageLabels(4)))
    with open(target) as f:
        assert f.read() == "keep me"


@pytest.mark.parametrize("parent", ["/proc", "/sys/kernel"])
def test_path_on_a_file_system_that_cannot_hold_files(parent: str) -> None:
    # /proc and sysfs report no size and refuse new directories: the error must say so, not "not enough space".
    path = os.path.join(parent, "mmapcache-test-cache")
    with pytest.raises(MmapCacheError, match=rf"cannot create a cache in {parent} .*this file system cannot hold one"):
        MmapCachedDataset(path, ImageLabels(4))
    assert not os.path.exists(path)
    assert not [n for n in os.listdir(parent) if "mmapcache" in n]


def test_existing_directory_that_is_not_a_cache(untouched: Any, shm_dir: str) -> None:
    untouched(CacheFormatError, r"is not an mmapcache cache \(it has no meta\.json\)",
              lambda: MmapCachedDataset(shm_dir, ImageLabels(4)))


def test_no_cache_and_no_source(untouched: Any, cache_path: str) -> None:
    untouched(FileNotFoundError, r"no cache at .*create it by passing a source dataset",
              lambda: MmapCachedDataset(cache_path))


# --- dataset ----------------------------------------------------------------------------------------------------


class _NoLen(Dataset):
    def __getitem__(self, index: int) -> Any:
        return index


class _Stream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


@pytest.mark.parametrize("dataset, exc, match", [
    ([], ValueError, r"the dataset \(list\) is empty; there is nothing to cache"),
    (_NoLen(), TypeError, r"the dataset \(_NoLen\) has no __len__; .*map-style"),
    (_Stream(), TypeError, r"the dataset \(_Stream\) has no __len__; .*iterable dataset, materialise it"),
    (5, TypeError, r"the dataset \(int\) has no __len__"),
])
def test_unusable_dataset(untouched: Any, cache_path: str, dataset: Any, exc: type, match: str) -> None:
    untouched(exc, match, lambda: MmapCachedDataset(cache_path, dataset))


@pytest.mark.parametrize("sample, match", [
    ((None, 1), r"sample 0: field '0': unsupported leaf type builtins\.NoneType"),
    (np.array(["a", "b"]), r"numpy array of dtype <U1 cannot be cached|numpy array of dtype"),
    (np.array([object()]), r"numpy array of dtype object cannot be cached"),
    ({1: torch.zeros(2)}, r"dict key 1 is a int, expected str"),
    (torch.zeros(2, 2).to_sparse(), r"tensor cannot be cached; convert it with \.to_dense\(\)"),
    (2**70, r"int \d+ does not fit in int64"),
    (collections.UserDict({"ids": [1, 2]}), r"unsupported leaf type collections\.UserDict; return dict\(value\)"),
])
def test_sample_with_an_unsupported_leaf(untouched: Any, cache_path: str, sample: Any, match: str) -> None:
    untouched(LayoutError, match, lambda: MmapCachedDataset(cache_path, [sample, sample]))


@pytest.mark.parametrize("samples, match", [
    ([torch.zeros(3), torch.zeros(4)], r"sample 1, field '<sample>': expected shape \(3,\), found \(4,\): .*"
                                       r"ragged='auto'.*ragged=\['<sample>'\].*max_shapes="),
    ([(torch.zeros(3), 1), (torch.zeros(3),)], r"sample 1 has a different structure .*expected tuple\(leaf, leaf\), "
                                                r"found tuple\(leaf\)"),
    ([{"a": 1}, {"b": 1}], r"sample 1 has a different structure .*expected dict\(a: leaf\), found dict\(b: leaf\)"),
    ([1, 2.5], r"sample 1, field '<sample>': expected int of dtype <i8, found float"),
    ([torch.zeros(3), torch.zeros(3, dtype=torch.float64)], r"sample 1, field '<sample>': expected tensor of dtype"),
])
def test_ragged_samples(cache_path: str, samples: list, match: str) -> None:
    # ragged=None: no probes at creation, the first sample's layout is the cache's (by default the varying shape of
    # the first case is found by the probes and stored ragged: test_varying_shapes.py).
    with MmapCachedDataset(cache_path, samples, ragged=None) as ds:
        with pytest.raises(LayoutError, match=match):
            ds[1]
        assert not ds.is_cached(1) and ds.num_cached == 1


# --- indices ----------------------------------------------------------------------------------------------------


@pytest.fixture
def ds(cache_path: str) -> Iterator[MmapCachedDataset]:
    with MmapCachedDataset(cache_path, ImageLabels(10)) as opened:
        yield opened


@pytest.mark.parametrize("index, exc, match", [
    (1.0, TypeError, r"cache indices must be integers, not float \(1\.0\)"),
    (np.float32(1), TypeError, r"cache indices must be integers, not float32"),
    (True, TypeError, r"cache indices must be integers, not bool \(True\)"),
    ("3", TypeError, r"cache indices must be integers, not str"),
    (None, TypeError, r"cache indices must be integers, not NoneType"),
    (slice(0, 2), TypeError, r"cache indices must be integers, not slice"),
    (10, IndexError, r"index 10 is out of range for the cache at .* of length 10"),
    (-11, IndexError, r"index -11 is out of range for the cache at .* of length 10"),
    (2**70, IndexError, r"out of range"),
])
def test_bad_index(ds: MmapCachedDataset, index: Any, exc: type, match: str) -> None:
    stored = ds.num_cached  # the samples the creator stored
    with pytest.raises(exc, match=match):
        ds[index]
    assert ds.num_cached == stored


@pytest.mark.parametrize("index, expected", [(-1, 9), (np.int64(2), 2), (np.uint8(3), 3), (torch.tensor(4), 4)])
def test_integer_like_indices_are_accepted(ds: MmapCachedDataset, index: Any, expected: int) -> None:
    assert ds[index][1] == ImageLabels(10)[expected][1]
    assert ds.is_cached(expected)


@pytest.mark.parametrize("indices, exc, match", [
    ([1, 10], IndexError, r"index 10 is out of range"),
    ([1.0], TypeError, r"cache indices must be integers, got an array of float64"),
    ([True], TypeError, r"cache indices must be integers, got an array of bool"),
    (["a"], TypeError, r"cache indices must be integers, got an array of <U1"),
])
def test_bad_batch_indices(ds: MmapCachedDataset, indices: Any, exc: type, match: str) -> None:
    stored = ds.num_cached
    with pytest.raises(exc, match=match):
        ds.__getitems__(indices)
    with pytest.raises(exc, match=match):
        ds.fill(indices)
    assert ds.num_cached == stored


# --- options ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, exc, match", [
    ({"max_bytes": -1}, ValueError, r"max_bytes must be positive, got -1"),
    ({"max_bytes": 0}, ValueError, r"max_bytes must be positive, got 0"),
    ({"max_bytes": 1.5}, TypeError, r"max_bytes must be a byte count or a size like '8G', got float"),
    ({"max_bytes": True}, TypeError, r"max_bytes must be a byte count or a size like '8G', got True"),
    ({"max_bytes": "lots"}, ValueError, r"max_bytes='lots' is not a size; .*\(e\.g\. '8G'\)"),
    ({"max_bytes": 10}, ValueError, r"max_bytes=10 is smaller than one sample \(212 bytes with 1 variant\(s\)\)"),
    ({"variants": 0}, ValueError, r"variants must be an integer >= 1, got 0"),
    ({"variants": 2.0}, ValueError, r"variants must be an integer >= 1, got 2\.0"),
    ({"variants": True}, ValueError, r"variants must be an integer >= 1, got True"),
    ({"variants": "2"}, ValueError, r"variants must be an integer >= 1, got '2'"),
    ({"stale": "never"}, ValueError, r"stale must be one of 'recompute', 'serve', got 'never'"),
    ({"stale": None}, ValueError, r"stale must be one of"),
    ({"variant_choice": "shuffle"}, ValueError, r"variant_choice must be one of 'epoch', 'random', got 'shuffle'"),
    ({"max_shapes": [(3, 8, 8)]}, TypeError, r"max_shapes must be a dict of field path -> shape, got list"),
    ({"max_shapes": {"0": (3, -1, 8)}}, ValueError, r"max_shapes\['0'\] must be a tuple of non-negative ints"),
    ({"max_shapes": {"0": 5}}, ValueError, r"max_shapes\['0'\] must be a tuple of non-negative ints, got 5"),
    ({"max_shapes": {"image": (3, 9, 9)}}, LayoutError, r"max_shapes names unknown field\(s\) \['image'\]; the "
                                                       r"sample's fields are '0', '1'"),
    ({"max_shapes": {"0": (3, 4, 4)}}, LayoutError, r"field '0': shape \(3, 8, 8\) does not fit the declared maximum"),
    ({"max_shapes": {"0": (3, 8)}}, LayoutError, r"does not fit the declared maximum shape \(3, 8\)"),
    ({"cache_indices": [1, 1]}, ValueError, r"cache_indices contains duplicates"),
    ({"cache_indices": [1.0]}, TypeError, r"cache_indices must be a 1-D sequence of integers"),
    ({"cache_indices": [True]}, TypeError, r"cache_indices must be a 1-D sequence of integers"),
    ({"cache_indices": [[1]]}, TypeError, r"cache_indices must be a 1-D sequence of integers"),
    ({"cache_indices": 3}, TypeError, r"cache_indices must be a 1-D sequence of integers"),
    ({"cache_indices": []}, ValueError, r"cache_indices is empty; pass None to cache every sample"),
    ({"cache_indices": [1, 9]}, IndexError, r"cache_indices has values outside \[0, 4\)"),
    ({"cache_indices": [-1]}, IndexError, r"cache_indices has values outside \[0, 4\)"),
    ({"fingerprint": 5}, TypeError, r"fingerprint must be a str or None, got int"),
    ({"fingerprint": b"abc"}, TypeError, r"fingerprint must be a str or None, got bytes"),
    ({"transform": "flip"}, TypeError, r"transform must be callable, got str"),
    ({"seed": 1.5}, TypeError, r"seed must be an int, got float"),
    ({"seed": None}, TypeError, r"seed must be an int, got NoneType"),
    ({"overwrite": "no"}, TypeError, r"overwrite must be True or False, got str \('no'\)"),
    ({"delete_on_close": 1}, TypeError, r"delete_on_close must be True or False, got int"),
    ({"check_finite": "yes"}, TypeError, r"check_finite must be True or False, got str"),
])
def test_bad_option(untouched: Any, cache_path: str, options: dict, exc: type, match: str) -> None:
    untouched(exc, match, lambda: MmapCachedDataset(cache_path, ImageLabels(4), **options))


def test_overwrite_must_be_a_bool_before_it_replaces_anything(cache_path: str) -> None:
    # overwrite="no" would be truthy: it must not replace a cache made from another source.
    MmapCachedDataset(cache_path, ImageLabels(4)).close()
    inode = os.stat(os.path.join(cache_path, "meta.json")).st_ino
    with pytest.raises(TypeError, match="overwrite must be True or False"):
        MmapCachedDataset(cache_path, ImageLabels(5), overwrite="no")
    assert os.stat(os.path.join(cache_path, "meta.json")).st_ino == inode


@pytest.mark.parametrize("call, exc, match", [
    (lambda ds: ds.refresh(), TypeError, r"refresh\(\) takes exactly one of fraction= or indices="),
    (lambda ds: ds.refresh(fraction=1.5), ValueError, r"fraction must be a number in \[0, 1\], got 1\.5"),
    (lambda ds: ds.refresh(fraction=True), ValueError, r"fraction must be a number in \[0, 1\], got True"),
    (lambda ds: ds.refresh(fraction=0.5, indices=[1]), TypeError, r"exactly one of"),
    (lambda ds: ds.set_epoch(1.5), TypeError, r"integer"),
])
def test_bad_method_arguments(ds: MmapCachedDataset, call: Callable, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        call(ds)
