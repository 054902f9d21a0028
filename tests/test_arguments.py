"""Odd creation arguments: numpy integers accepted wherever a count or size is taken, bools refused, and sizes
read only as what they unambiguously say.

Each refusal test here failed before its fix (see the commit that added it).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from helpers.sources import ImageLabels
from mmapcache import MmapCachedDataset, build
from mmapcache.format.sizes import parse_size

GIB = 1024**3


# --- max_shapes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [16, np.int64(16)], ids=["int", "numpy-int"])
def test_max_shape_given_as_an_int_says_how_to_write_it(cache_path: str, shape: Any) -> None:
    message = (r"max_shapes\['0'\] must be a tuple of non-negative ints, got (np\.int64\()?16\)? .*"
               r"for a 1-D field write max_shapes=\{'0': \(16,\)\}")
    with pytest.raises(ValueError, match=message):
        MmapCachedDataset(cache_path, ImageLabels(4), max_shapes={"0": shape})
    assert not os.path.exists(cache_path)


@pytest.mark.parametrize("shape", [(3, True, 8), (True,), (3, np.bool_(True), 8), "abc", (3, 8.0, 8)])
def test_max_shape_of_bools_or_non_integers_is_refused(cache_path: str, shape: Any) -> None:
    with pytest.raises(ValueError, match=r"max_shapes\['0'\] must be a tuple of non-negative ints, got .*give one "
                                         r"maximum per dimension"):
        MmapCachedDataset(cache_path, ImageLabels(4), max_shapes={"0": shape})


def test_max_shapes_key_that_is_not_a_path(cache_path: str) -> None:
    with pytest.raises(ValueError, match=r"max_shapes key 0 is a int; keys are field paths \(str\)"):
        MmapCachedDataset(cache_path, ImageLabels(4), max_shapes={0: (3, 8, 8)})


@pytest.mark.parametrize("shape", [(np.int64(3), np.int32(8), np.uint8(8)), np.array([3, 8, 8]), [3, 8, 8]],
                         ids=["numpy-ints", "ndarray", "list"])
def test_max_shape_of_numpy_integers_is_accepted(cache_path: str, shape: Any) -> None:
    with MmapCachedDataset(cache_path, ImageLabels(4), max_shapes={"0": shape}) as ds:
        assert ds[2][0].shape == (3, 8, 8)


# --- counts and sizes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_bytes", [np.int64(64 * 1024), np.uint32(64 * 1024), np.int16(30000)])
def test_max_bytes_as_a_numpy_integer(cache_path: str, max_bytes: Any) -> None:
    # Before: "max_bytes must be a byte count or a size like '8G', got int64", while variants took numpy ints.
    with MmapCachedDataset(cache_path, ImageLabels(8), max_bytes=max_bytes, variants=np.int8(2)) as ds:
        assert ds.variants == 2
        ds[0]


def test_build_takes_numpy_integers(cache_path: str) -> None:
    report = build(cache_path, ImageLabels, kwargs={"n": 8}, max_bytes=np.int64(1 << 20), variants=np.int64(1),
                   workers=1)
    assert report.ok
    with MmapCachedDataset(cache_path) as ds:
        assert len(ds) == 8


@pytest.mark.parametrize("kwargs, match", [
    ({"max_bytes": np.bool_(True)}, r"max_bytes must be a byte count or a size like '8G', got (np\.)?True"),
    ({"variants": np.bool_(True)}, r"variants must be an integer >= 1, got .*True"),
    ({"variants": True}, r"variants must be an integer >= 1, got True"),
    ({"max_bytes": np.float64(4096.0)}, r"max_bytes must be a byte count or a size like '8G', got float64"),
])
def test_bools_and_floats_are_not_counts(cache_path: str, kwargs: dict, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        MmapCachedDataset(cache_path, ImageLabels(4), **kwargs)
    assert not os.path.exists(cache_path)


# --- size strings --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, size", [
    ("8G", 8 * GIB), ("8GB", 8 * GIB), ("8GiB", 8 * GIB), ("8g", 8 * GIB), ("8 G", 8 * GIB), ("1.5GiB", 3 * GIB // 2),
    ("512M", 512 * 1024**2), ("100B", 100), ("1000000", 1000000), (" 2 k ", 2048), ("1T", 1024**4),
])
def test_sizes_that_say_bytes(text: str, size: int) -> None:
    assert parse_size(text, "max_bytes") == size


@pytest.mark.parametrize("text, meant", [("8Gb", "8G"), ("8gb", "8G"), ("8Gib", "8G"), ("512mb", "512M"),
                                         ("100b", "100")])
def test_a_lower_case_b_is_refused(text: str, meant: str) -> None:
    # Before: '8Gb' was read as 8 GiB, though to many it says 8 gigabits.
    with pytest.raises(ValueError, match=rf"max_bytes='{text}': a lower-case 'b' means bits to some and bytes to "
                                         rf"others; for bytes write '{meant}' or '{meant}B'"):
        parse_size(text, "max_bytes")


@pytest.mark.parametrize("text", ["١٠٠٠", "१०००", "１０００", "8١G", "1.٥G"], ids=["arabic", "devanagari", "fullwidth",
                                                                                  "mixed", "fraction"])
def test_only_ascii_digits_are_digits(text: str) -> None:
    # Before: '١٠٠٠' (Arabic-Indic digits) was read as 1000: \d matches any Unicode digit.
    with pytest.raises(ValueError, match=r"is not a size; .*ASCII digits"):
        parse_size(text, "max_bytes")


@pytest.mark.parametrize("text", ["8iB", "G", "", "8 GG", "-5G", "0", "0.0001"])
def test_malformed_sizes(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a size"):
        parse_size(text, "max_bytes")


def test_a_lower_case_b_is_refused_when_creating_a_cache(cache_path: str) -> None:
    with pytest.raises(ValueError, match=r"max_bytes='8Gb': a lower-case 'b'"):
        MmapCachedDataset(cache_path, ImageLabels(4), max_bytes="8Gb")
    assert not os.path.exists(cache_path)


# --- what is passed as the dataset, and loader arguments ---------------------------------------------------------


def test_a_dataset_class_instead_of_an_instance_is_named(cache_path: str) -> None:
    with pytest.raises(TypeError, match=r"the dataset is the class ImageLabels, not a dataset: pass an instance, "
                                        r"ImageLabels\(\.\.\.\)"):
        MmapCachedDataset(cache_path, ImageLabels)
    assert not os.path.exists(cache_path)


@pytest.mark.parametrize("batch_size", [0, -3, 2.5, True, "4"])
def test_a_loader_batch_size_that_is_not_a_positive_int_is_refused_when_made(cache_path: str,
                                                                             batch_size: Any) -> None:
    # As DataLoader refuses it, in its words: before, 0 passed and the first epoch raised ZeroDivisionError.
    with MmapCachedDataset(cache_path, ImageLabels(8)) as ds:
        with pytest.raises(ValueError, match=r"batch_size should be a positive integer value, but got batch_size="):
            ds.loader(batch_size=batch_size)
        assert [len(b[1]) for b in ds.loader(batch_size=np.int64(3))] == [3, 3, 2]
