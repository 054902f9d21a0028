"""Damaged caches: every kind of damage is detected on open (or on first write) with ``CacheFormatError`` naming
the file and the fix, never a crash or wrong data. Damage is done with plain file operations and numpy."""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest

from helpers import fault_workers as fw
from helpers.sources import ImageLabels, sample_equal
from mmapcache import CacheFormatError, MmapCachedDataset, SampleNotCachedError

N = 13  # not a multiple of 8: the bitmaps have spare bits past the last row


@pytest.fixture
def filled_cache(cache_path: str) -> str:
    """A closed cache with samples 0..5 filled (and no others: no layout probes)."""
    with MmapCachedDataset(cache_path, ImageLabels(N), ragged=None) as ds:
        ds.fill(range(6))
    return cache_path


def _file(path: str, name: str) -> str:
    return os.path.join(path, name)


def _open_fails(path: str, match: str) -> None:
    for source in (None, ImageLabels(N)):
        with pytest.raises(CacheFormatError, match=match):
            MmapCachedDataset(path, source)


def test_truncated_data_file(filled_cache: str) -> None:
    data = _file(filled_cache, "0.npy")
    os.truncate(data, os.path.getsize(data) - 100)
    _open_fails(filled_cache, r"0\.npy has \d+ bytes, expected \d+: it is truncated; .*mmapcache rm --force")


def test_data_file_with_a_garbled_header(filled_cache: str) -> None:
    with open(_file(filled_cache, "0.npy"), "r+b") as f:
        f.write(b"garbage!")
    _open_fails(filled_cache, r"0\.npy is not a valid \.npy file")


def test_data_file_of_another_shape(filled_cache: str) -> None:
    np.save(_file(filled_cache, "0.npy"), np.zeros((N, 3, 8, 9), np.uint8))
    _open_fails(filled_cache, r"0\.npy: found array uint8 \(13, 3, 8, 9\), expected \|u1 \(13, 3, 8, 8\)")


@pytest.mark.parametrize("name", ["filled.bits", "stale.bits", "seq.u32"])
def test_truncated_state_file(filled_cache: str, name: str) -> None:
    os.truncate(_file(filled_cache, name), os.path.getsize(_file(filled_cache, name)) - 1)
    _open_fails(filled_cache, rf"{name} has \d+ bytes, expected \d+; the file is truncated or damaged")


def test_filled_bits_for_rows_never_written(filled_cache: str) -> None:
    with open(_file(filled_cache, "filled.bits"), "r+b") as f:
        f.write(b"\xff")  # rows 0..7: rows 6 and 7 were never written (counter 0)
    _open_fails(filled_cache, r"filled\.bits: 2 row\(s\) \(first: 6\) are marked filled but were never written")


@pytest.mark.parametrize("name", ["filled.bits", "stale.bits"])
def test_bits_past_the_end(filled_cache: str, name: str) -> None:
    bits = np.fromfile(_file(filled_cache, name), np.uint8)
    bits[-1] |= 0x80  # row 15 of a 13-row cache
    bits.tofile(_file(filled_cache, name))
    _open_fails(filled_cache, rf"{name}: bits are set past row 13")


def test_garbled_meta(filled_cache: str) -> None:
    with open(_file(filled_cache, "meta.json"), "r+b") as f:
        f.seek(40)
        f.write(b"\x00{]")
    _open_fails(filled_cache, r"meta\.json is not valid JSON")


def test_meta_that_is_not_utf8(filled_cache: str) -> None:
    with open(_file(filled_cache, "meta.json"), "wb") as f:
        f.write(b"\xff\xfe{}")
    _open_fails(filled_cache, r"meta\.json cannot be read")


def test_missing_meta(filled_cache: str) -> None:
    os.unlink(_file(filled_cache, "meta.json"))
    _open_fails(filled_cache, r"is not an mmapcache cache \(it has no meta\.json\)")


def _edit_meta(path: str, **changes: object) -> None:
    with open(_file(path, "meta.json")) as f:
        meta = json.load(f)
    meta.update(changes)
    with open(_file(path, "meta.json"), "w") as f:
        json.dump(meta, f)


def test_future_format_version(filled_cache: str) -> None:
    _edit_meta(filled_cache, format_version=4)
    _open_fails(filled_cache, r"format version 4, this mmapcache reads versions 2 and 3; upgrade mmapcache")


def test_version_1_cache_is_refused_with_the_rebuild_command(filled_cache: str) -> None:
    _edit_meta(filled_cache, format_version=1)
    _open_fails(filled_cache, r"format version 1, written by an older mmapcache; this mmapcache reads versions 2 "
                              r"and 3\. A cache is derived data: rebuild it \(`mmapcache rm --force .*`, then open it "
                              r"with its source dataset or run `mmapcache build`\)")


@pytest.mark.parametrize("changes, match", [
    ({"mode": "ring"}, r"mode 'ring' is not one of \('cache', 'stream'\)"),
    ({"mode": "stream"}, r"stream must be \{seed\} or \{seed, split\}, found None"),
    ({"stream": {"seed": 1}}, r"stream settings in a cache of mode 'cache'"),
    ({"mode": "stream", "stream": {"seed": 1, "split": {"node": 2, "nodes": 2, "ranks": 1}}}, r"bad stream split"),
    ({"mode": "stream", "stream": {"seed": 1, "split": {"node": 0, "nodes": 1, "ranks": 1}}}, r"bad stream split"),
    ({"mode": "stream", "stream": {"seed": 1, "split": {"node": 0, "nodes": 2}}}, r"bad stream split"),
    ({"share": {"node": 0, "nodes": 2}}, r"share must be null or \{node, nodes, seed, rotate_every\}"),
    ({"share": {"node": 2, "nodes": 2, "seed": 0, "rotate_every": None}}, r"bad share"),
    ({"share": {"node": 0, "nodes": 2, "seed": 0, "rotate_every": None}}, r"a node share needs .* a slot index"),
])
def test_bad_modes_and_shares_are_damage_named(filled_cache: str, changes: dict, match: str) -> None:
    _edit_meta(filled_cache, **changes)
    _open_fails(filled_cache, match)


def test_wrong_magic(filled_cache: str) -> None:
    _edit_meta(filled_cache, magic="zarr")
    _open_fails(filled_cache, r"magic is 'zarr', expected 'mmapcache'")


@pytest.mark.parametrize("changes", [
    {"rows": 99}, {"length": -1}, {"fields": []}, {"slots": "13"}, {"structure": None},
    {"structure": {"tuple": [{"leaf": 0}, {"leaf": 7}]}},  # a leaf past the fields: would fail on every read
    {"structure": {"tuple": [{"leaf": 0}, {"leaf": 0}]}},
    {"structure": {"set": [{"leaf": 0}, {"leaf": 1}]}},
    {"structure": {"namedtuple": ["os", "P", ["a", "class"]], "items": [{"leaf": 0}, {"leaf": 1}]}},
    {"structure": {"dict": [[1, {"leaf": 0}], ["b", {"leaf": 1}]]}},
])
def test_inconsistent_meta(filled_cache: str, changes: dict) -> None:
    _edit_meta(filled_cache, **changes)
    _open_fails(filled_cache, r"meta\.json is malformed")


@pytest.mark.parametrize("changes, match", [
    ({"delete_on_close": "no"}, r"delete_on_close must be true or false, found 'no'"),  # truthy: a close removed it
    ({"delete_on_close": 1}, r"delete_on_close must be true or false"),
    ({"fingerprint": 3}, r"fingerprint must be null or a string, found 3"),
    ({"fingerprint": "<delete>"}, r"KeyError: 'fingerprint'"),
    ({"created": None}, r"created must be a string, found None"),
    ({"library_version": "<delete>"}, r"KeyError: 'library_version'"),
    ({"deterministic": "false"}, r"deterministic must be true or false"),
])
def test_every_key_of_meta_is_checked(filled_cache: str, changes: dict, match: str) -> None:
    # Each of these reached a reader or inspect as a raw exception, or changed what a close does.
    with open(_file(filled_cache, "meta.json")) as f:
        meta = json.load(f)
    meta.update({k: v for k, v in changes.items() if v != "<delete>"})
    for key in [k for k, v in changes.items() if v == "<delete>"]:
        del meta[key]
    with open(_file(filled_cache, "meta.json"), "w") as f:
        json.dump(meta, f)
    _open_fails(filled_cache, r"meta\.json is malformed \(.*" + match)


@pytest.mark.parametrize("change", [{"dtype": "|O"}, {"kind": "pickle"}, {"shape": [3, -8, 8]}])
def test_meta_with_a_bad_field(filled_cache: str, change: dict) -> None:
    with open(_file(filled_cache, "meta.json")) as f:
        meta = json.load(f)
    meta["fields"][0].update(change)
    with open(_file(filled_cache, "meta.json"), "w") as f:
        json.dump(meta, f)
    _open_fails(filled_cache, r"meta\.json is malformed|found array")


@pytest.mark.parametrize("name", ["save", "no_such_thing"])  # torch.save exists, but is no dtype
def test_meta_with_a_torch_dtype_that_is_not_a_dtype(filled_cache: str, name: str) -> None:
    with open(_file(filled_cache, "meta.json")) as f:
        meta = json.load(f)
    meta["fields"][0]["torch_dtype"] = name
    with open(_file(filled_cache, "meta.json"), "w") as f:
        json.dump(meta, f)
    with pytest.raises(CacheFormatError, match=rf"torch_dtype '{name}' in meta\.json is not a torch dtype"):
        MmapCachedDataset(filled_cache)
    # With a source too: the cache is damaged whatever source opens it, so it says that (not "another source").
    with pytest.raises(CacheFormatError, match=rf"torch_dtype '{name}' in meta\.json is not a torch dtype"):
        MmapCachedDataset(filled_cache, ImageLabels(N))


def test_meta_cannot_make_a_reader_import_a_module(filled_cache: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The namedtuple of a sample is looked up among imported modules only: a meta.json naming a module must not
    # make the reader import (run) it. `this` prints the Zen of Python when imported.
    with open(_file(filled_cache, "meta.json")) as f:
        meta = json.load(f)
    meta["structure"] = {"namedtuple": ["this", "Pair", ["image", "label"]], "items": meta["structure"]["tuple"]}
    with open(_file(filled_cache, "meta.json"), "w") as f:
        json.dump(meta, f)
    sys.modules.pop("this", None)
    with MmapCachedDataset(filled_cache) as ds:
        sample = ds[1]
    assert "this" not in sys.modules, "opening the cache imported the module named in meta.json"
    assert type(sample).__name__ == "Pair" and sample._fields == ("image", "label")
    assert capsys.readouterr().out == ""


def test_meta_naming_a_file_outside_the_cache(filled_cache: str) -> None:
    with open(_file(filled_cache, "meta.json")) as f:
        meta = json.load(f)
    meta["fields"][0]["file"] = "../../etc/passwd"
    with open(_file(filled_cache, "meta.json"), "w") as f:
        json.dump(meta, f)
    _open_fails(filled_cache, r"bad file name '\.\./\.\./etc/passwd'")


@pytest.mark.parametrize("name", ["0.npy", "filled.bits", "seq.u32", "meta.json"])
def test_file_replaced_by_a_directory(filled_cache: str, name: str) -> None:
    os.unlink(_file(filled_cache, name))
    os.mkdir(_file(filled_cache, name))
    _open_fails(filled_cache, r"is a directory|cannot be read")


@pytest.mark.parametrize("name", ["0.npy", "1.npy", "stale.bits"])
def test_missing_file(filled_cache: str, name: str) -> None:
    os.unlink(_file(filled_cache, name))
    _open_fails(filled_cache, rf"{name} is missing")


def test_missing_users_file(filled_cache: str) -> None:
    os.unlink(_file(filled_cache, "users"))
    _open_fails(filled_cache, r"users is missing")


def test_lock_file_removed_while_in_use(filled_cache: str) -> None:
    ds = MmapCachedDataset(filled_cache, ImageLabels(N))
    ds[6]  # a write: this process has the lock file open
    os.unlink(_file(filled_cache, "lock"))
    assert sample_equal(ds[1], ImageLabels(N)[1])  # reads need no lock
    with pytest.raises(CacheFormatError, match=r"lock was removed or replaced while the cache is in use"):
        ds[7]
    assert not ds.is_cached(7)
    ds.close()


def test_lock_file_replaced_while_in_use(filled_cache: str) -> None:
    ds = MmapCachedDataset(filled_cache, ImageLabels(N))
    ds[6]
    os.unlink(_file(filled_cache, "lock"))
    open(_file(filled_cache, "lock"), "w").close()  # a fresh lock file others would lock instead
    with pytest.raises(CacheFormatError, match=r"removed or replaced"):
        ds[7]
    ds.close()


def test_lock_file_missing_before_first_write(filled_cache: str) -> None:
    os.unlink(_file(filled_cache, "lock"))
    ds = MmapCachedDataset(filled_cache, ImageLabels(N))
    assert sample_equal(ds[2], ImageLabels(N)[2])
    with pytest.raises(CacheFormatError, match=r"removed or replaced"):
        ds[8]
    ds.close()


def test_lock_replaced_by_a_directory(filled_cache: str) -> None:
    os.unlink(_file(filled_cache, "lock"))
    os.mkdir(_file(filled_cache, "lock"))
    ds = MmapCachedDataset(filled_cache, ImageLabels(N))
    with pytest.raises(CacheFormatError, match=r"lock is a directory, expected a regular file"):
        ds[8]
    ds.close()


def test_odd_counter_with_filled_bit_is_a_miss_and_is_recomputed(filled_cache: str) -> None:
    # A writer killed mid-write during a rewrite leaves the filled bit set and an odd counter, and the cache-wide
    # counter odd (it dies inside the change).
    seq = np.memmap(_file(filled_cache, "seq.u32"), dtype="<u4", mode="r+")
    changes = np.memmap(_file(filled_cache, "changes.u64"), dtype="<u8", mode="r+")
    data = np.load(_file(filled_cache, "0.npy"), mmap_mode="r+")
    assert seq[3] == 2
    seq[3] = 3
    changes[0] |= 1
    data[3] = 0xAA  # the half-written bytes
    seq.flush()
    changes.flush()
    data.flush()
    del seq, changes, data
    with MmapCachedDataset(filled_cache) as ds:
        assert not ds.is_cached(3)
        with pytest.raises(SampleNotCachedError, match="sample 3 is not in the cache"):
            ds[3]
        with pytest.raises(SampleNotCachedError):
            ds.__getitems__([2, 3])
        assert sample_equal(ds[2], ImageLabels(N)[2])
    with MmapCachedDataset(filled_cache, ImageLabels(N)) as ds:
        assert sample_equal(ds[3], ImageLabels(N)[3])
        assert ds.is_cached(3)
    _, filled, seq = fw.raw_rows(filled_cache)
    assert filled[3] and seq[3] == 4
    data = np.load(_file(filled_cache, "0.npy"), mmap_mode="r")
    assert np.array_equal(data[3], ImageLabels(N)[3][0].numpy())


def test_odd_counter_is_refilled_by_fill(filled_cache: str) -> None:
    seq = np.memmap(_file(filled_cache, "seq.u32"), dtype="<u4", mode="r+")
    changes = np.memmap(_file(filled_cache, "changes.u64"), dtype="<u8", mode="r+")
    seq[4] = 5
    changes[0] |= 1  # the writer died inside its change
    seq.flush()
    changes.flush()
    del seq, changes
    with MmapCachedDataset(filled_cache, ImageLabels(N)) as ds:
        assert ds.fill(range(6)) == 1
    _, _, seq = fw.raw_rows(filled_cache)
    assert seq[4] == 6


def test_not_a_cache_directory_is_left_alone(shm_dir: str) -> None:
    other = os.path.join(shm_dir, "photos")
    os.mkdir(other)
    open(os.path.join(other, "a.jpg"), "w").close()
    _open_fails(other, r"photos is not an mmapcache cache \(it has no meta\.json\)")
    assert os.listdir(other) == ["a.jpg"]


def test_damage_never_leaves_a_half_open_cache(filled_cache: str) -> None:
    # After a failed open, repairing the damage (here: restoring the file) makes the cache usable again.
    backup = filled_cache + "-seq"
    shutil.copy(_file(filled_cache, "seq.u32"), backup)
    os.truncate(_file(filled_cache, "seq.u32"), 0)
    _open_fails(filled_cache, "seq.u32 has 0 bytes")
    shutil.copy(backup, _file(filled_cache, "seq.u32"))
    os.unlink(backup)
    with MmapCachedDataset(filled_cache) as ds:
        assert all(sample_equal(ds[i], ImageLabels(N)[i]) for i in range(6))
