"""Opening an existing cache: mismatched length, fingerprint or layout is refused with the fix; overwrite=True
replaces a mismatched cache and keeps a matching one; a cache opened without a source serves only what is filled."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch

from helpers.sources import Counting, ImageLabels, sample_equal
from mmapcache import CacheMismatchError, CacheNotFoundError, MmapCachedDataset, SampleNotCachedError


def _fill(path: str, source: Any, **kwargs: Any) -> None:
    with MmapCachedDataset(path, source, **kwargs) as ds:
        ds.fill()


def _assert_fix_named(message: str, path: str) -> None:
    assert "overwrite=True" in message and f"mmapcache rm {path}" in message


class Relabelled(ImageLabels):
    """Same images as ``ImageLabels`` but a float label: the same field paths with another type."""

    def __getitem__(self, index: int) -> Any:
        image, label = super().__getitem__(index)
        return image, float(label)


class AsDict(ImageLabels):
    def __getitem__(self, index: int) -> Any:
        image, label = super().__getitem__(index)
        return {"image": image, "label": label}


def test_length_mismatch(cache_path: str) -> None:
    _fill(cache_path, ImageLabels(8))
    with pytest.raises(CacheMismatchError) as info:
        MmapCachedDataset(cache_path, ImageLabels(9))
    assert "length 8 in the cache, 9 in the dataset" in str(info.value)
    _assert_fix_named(str(info.value), cache_path)


def test_fingerprint_mismatch(cache_path: str) -> None:
    _fill(cache_path, ImageLabels(8), fingerprint="train-v1")
    with pytest.raises(CacheMismatchError) as info:
        MmapCachedDataset(cache_path, ImageLabels(8), fingerprint="train-v2")
    assert "fingerprint 'train-v1' in the cache, 'train-v2' given" in str(info.value)
    _assert_fix_named(str(info.value), cache_path)
    with MmapCachedDataset(cache_path, ImageLabels(8), fingerprint="train-v1") as ds:
        assert ds.num_cached == 8
    # A cache made without one (`mmapcache build` without --fingerprint, as a new user's trial did from the README):
    # the message says how to keep it, not only how to replace it.
    _fill(cache_path + "-none", ImageLabels(8))
    with pytest.raises(CacheMismatchError, match=r"fingerprint None in the cache, 'train-v1' given \(it was made "
                                                 r"without one, by `mmapcache build` without --fingerprint.*make it "
                                                 r"with this one, or open it without fingerprint=\)"):
        MmapCachedDataset(cache_path + "-none", ImageLabels(8), fingerprint="train-v1")


@pytest.mark.parametrize(
    ("other", "words"),
    [
        (ImageLabels(8, shape=(3, 4, 4)), ["field '0'", "(3, 8, 8)", "(3, 4, 4)"]),
        (Relabelled(8), ["field '1'", "int", "float"]),
        (AsDict(8), ["structure", "tuple", "dict"]),
    ],
    ids=["shape", "dtype", "structure"],
)
def test_layout_mismatch_names_what_differs(cache_path: str, other: Any, words: list[str]) -> None:
    _fill(cache_path, ImageLabels(8))
    with pytest.raises(CacheMismatchError) as info:
        MmapCachedDataset(cache_path, other)
    message = str(info.value)
    assert "layout differs" in message
    for word in words:
        assert word in message
    _assert_fix_named(message, cache_path)
    with MmapCachedDataset(cache_path) as ds:  # the refused open changed nothing
        assert ds.num_cached == 8 and sample_equal(ds[5], ImageLabels(8)[5])


@pytest.mark.parametrize(
    ("other", "kwargs"),
    [(ImageLabels(9), {}), (ImageLabels(8), {"fingerprint": "v2"}), (ImageLabels(8, shape=(2, 2)), {}),
     (AsDict(8), {})],
    ids=["length", "fingerprint", "shape", "structure"],
)
def test_overwrite_replaces_a_mismatched_cache(cache_path: str, other: Any, kwargs: dict[str, Any]) -> None:
    _fill(cache_path, ImageLabels(8), fingerprint="v1")
    with MmapCachedDataset(cache_path, other, overwrite=True, ragged=None, **kwargs) as ds:
        assert len(ds) == len(other) and ds.num_cached == 1  # a new cache: only its first sample is stored
        for i in range(len(other)):
            assert sample_equal(ds[i], other[i])
    with open(os.path.join(cache_path, "meta.json")) as f:
        meta = json.load(f)
    assert meta["length"] == len(other) and meta["fingerprint"] == kwargs.get("fingerprint")
    assert not [name for name in os.listdir(os.path.dirname(cache_path)) if name != "cache"]


def test_overwrite_keeps_a_matching_cache(cache_path: str, tmp_path: Any) -> None:
    _fill(cache_path, ImageLabels(8), fingerprint="v1")
    inode = os.stat(os.path.join(cache_path, "meta.json")).st_ino
    source = Counting(ImageLabels(8), str(tmp_path / "calls"))
    with MmapCachedDataset(cache_path, source, fingerprint="v1", overwrite=True) as ds:
        assert ds.num_cached == 8
        assert all(sample_equal(ds[i], ImageLabels(8)[i]) for i in range(8))
    assert os.stat(os.path.join(cache_path, "meta.json")).st_ino == inode
    assert source.calls() == []  # the matching fingerprint identifies the source: no probe, and every read a hit


def test_reader_of_a_replaced_cache_keeps_reading_its_own_data(cache_path: str) -> None:
    old = MmapCachedDataset(cache_path, ImageLabels(8))
    old.fill()
    new = MmapCachedDataset(cache_path, ImageLabels(8, shape=(5,)), overwrite=True)
    assert all(sample_equal(old[i], ImageLabels(8)[i]) for i in range(8))  # its maps outlive the removal
    assert sample_equal(new[3], ImageLabels(8, shape=(5,))[3])
    old.close()
    new.close()


def test_open_without_source_serves_filled_and_explains_unfilled(cache_path: str) -> None:
    source = ImageLabels(10)
    with MmapCachedDataset(cache_path, source, ragged=None) as ds:  # no probes: exactly what is filled below
        for i in (0, 2, 7):
            ds[i]
    with MmapCachedDataset(cache_path) as ro:
        assert ro.dataset is None and len(ro) == 10 and ro.num_cached == 3 and ro.path == cache_path
        assert [ro.is_cached(i) for i in range(10)] == [i in (0, 2, 7) for i in range(10)]
        assert sample_equal(ro[7], source[7]) and sample_equal(ro[-3], source[7])
        assert sample_equal(ro.__getitems__([2, 0]), [source[2], source[0]])
        with pytest.raises(SampleNotCachedError) as info:
            ro[4]
        message = str(info.value)
        assert message.startswith("sample 4 is not in the cache at " + cache_path)  # no KeyError quoting
        assert "MmapCachedDataset(path, dataset)" in message and f"mmapcache build {cache_path}" in message
        with pytest.raises(SampleNotCachedError, match="sample 5"):
            ro.__getitems__([0, 5])
        with pytest.raises(KeyError):  # SampleNotCachedError is also the builtin a caller would catch
            ro[9]
        assert ro.num_cached == 3  # nothing was written


def test_open_without_source_of_a_missing_cache(shm_dir: str) -> None:
    with pytest.raises(CacheNotFoundError) as info:
        MmapCachedDataset("absent")
    assert f"no cache at {shm_dir}/absent" in str(info.value) and "MmapCachedDataset(path, dataset)" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert not os.path.exists(f"{shm_dir}/absent")


def test_bare_name_and_paths(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with MmapCachedDataset("train-224", ImageLabels(4)) as ds:
        assert ds.path == os.path.join(shm_dir, "train-224")
    with MmapCachedDataset(f"{shm_dir}/sub/dir/c", ImageLabels(4)) as ds:
        assert ds.path == f"{shm_dir}/sub/dir/c" and os.path.isfile(f"{shm_dir}/sub/dir/c/meta.json")
    monkeypatch.chdir(shm_dir)
    with MmapCachedDataset("./relative", ImageLabels(4)) as ds:
        assert ds.path == os.path.join(shm_dir, "relative")
    monkeypatch.delenv("MMAPCACHE_DIR")
    from mmapcache.store.paths import resolve_path

    assert resolve_path("x") == "/dev/shm/mmapcache/x"  # the documented default, not created by this check


def test_context_manager_and_close(cache_path: str) -> None:
    ds = MmapCachedDataset(cache_path, ImageLabels(4))
    with ds as same:
        assert same is ds
    ds.close()  # idempotent
    assert sample_equal(ds[1], ImageLabels(4)[1])  # a closed dataset reopens on use, like a fresh worker copy
    ds.close()
    assert isinstance(ds[2][0], torch.Tensor) and np.array_equal(ds[2][0].numpy(), ImageLabels(4)[2][0].numpy())
    ds.close()
