"""Findings of the second hostile test (aimed at heaps and free lists, producers, rotated shares, verify and the
identity check), each failing before its fix: damage is a ``CacheFormatError`` or a verify finding, never a write
outside what a heap reserved, a crash or a private exception; a rotated share reopens; a changed source is caught
beyond its sample 0; a random source's nature is recorded with the cache. (The batched-miss and producer findings
are in ``test_batch_misses.py`` and ``test_orphans.py``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from helpers.sources import ImageLabels, image_of, sample_equal
from mmapcache import (
    CacheFormatError,
    CacheMismatchError,
    MmapCachedDataset,
    StreamBypassWarning,
    build,
    describe,
    verify,
)
from mmapcache.cli import main

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
PAGE = 4096


class Texts(Dataset):
    """A ragged sample: token ids of varying length, a caption, a label. ``version`` 1 has longer values."""

    def __init__(self, n: int = 24, version: int = 0) -> None:
        self.n, self.version = n, version

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = torch.arange(i % 9 + 3 + 20 * self.version, dtype=torch.int64) * (i + 1)
        return {"ids": ids, "text": f"caption {i} " * (i % 4 + 1 + 10 * self.version), "label": i}


def _texts_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["ids"], b["ids"]) and a["text"] == b["text"] and a["label"] == b["label"]


@pytest.fixture
def ragged_cache(cache_path: str) -> str:
    """A closed cache of ``Texts`` with every row filled, a third of them rewritten with longer values and back
    (so values moved, and free lists hold extents)."""
    for version in (0, 1, 0):
        with MmapCachedDataset(cache_path, Texts(version=version), ragged=["ids"], deterministic=False) as ds:
            ds.refresh(indices=range(0, 24, 3))
            ds.fill()
    return cache_path


def _heap_files(path: str) -> dict[str, tuple[int, int]]:
    """Each heap's size and allocated bytes (tmpfs blocks): a write past the reserved size makes them differ."""
    out = {}
    for name in os.listdir(path):
        if name.endswith(".heap"):
            st = os.stat(os.path.join(path, name))
            out[name] = (st.st_size, st.st_blocks * 512)
    return out


def _not_sparse(files: dict[str, tuple[int, int]]) -> bool:
    return all(blocks >= size // PAGE * PAGE for size, blocks in files.values())


def _set_index_row(path: str, field: str, row: int, offset: int, extent: int) -> None:
    index = np.load(os.path.join(path, f"{field}.index.npy"), mmap_mode="r+")
    index[row, 0], index[row, 1] = offset, extent
    index.flush()


# --- 3. a damaged heap index, extent or free list is damage, never a write, a growth or a crash ---------------------


@pytest.mark.parametrize("offset", ["past", "negative", "huge"])
def test_an_index_row_outside_the_heap_is_damage_and_nothing_is_written(ragged_cache: str, offset: str) -> None:
    heap_size = os.path.getsize(os.path.join(ragged_cache, "ids.heap"))
    at = {"past": heap_size + 2**30, "negative": -4096, "huge": 2**63 - 8}[offset]
    _set_index_row(ragged_cache, "ids", 5, at, 2**20)
    before = _heap_files(ragged_cache)
    with MmapCachedDataset(ragged_cache, Texts(), ragged=["ids"]) as ds:
        with pytest.raises(CacheFormatError, match=r"row 5, field 'ids'.*cannot be read.*mmapcache rm --force"):
            ds[5]
        with pytest.raises(CacheFormatError, match="row 5"):
            ds.__getitems__(list(range(24)))  # the batch path, with the cache-wide fast check
        ds.refresh(indices=[5])  # a rewrite would write into the recorded extent
        with pytest.raises(CacheFormatError, match=r"row 5's index records the extent .* the cache is damaged"):
            ds[5]
        assert all(_texts_equal(ds[i], Texts()[i]) for i in range(24) if i != 5)  # the rest is served
    after = _heap_files(ragged_cache)
    assert after == before and _not_sparse(after)
    result = verify(ragged_cache)
    assert not result.ok and any("ids.index.npy: row 5" in p for p in result.problems)


@pytest.mark.parametrize("how", ["stale", "unmarked"])
def test_the_extent_of_a_row_that_is_not_complete_is_checked_by_verify_as_writers_check_it(ragged_cache: str,
                                                                                          how: str) -> None:
    # Found by a black-box recheck: a row whose filled bit is cleared (with the count of complete rows to match)
    # keeps its extent for its next value; a writer refuses a damaged one, yet verify, which checked filled rows
    # only, said ok to a cache the dataset then refused to fill. A stale row's was already checked.
    with MmapCachedDataset(ragged_cache, Texts(), ragged=["ids"]) as ds:
        if how == "stale":
            ds.refresh(indices=[5])
    heap_size = os.path.getsize(os.path.join(ragged_cache, "ids.heap"))
    _set_index_row(ragged_cache, "ids", 5, heap_size + 2**30, 2**20)
    if how == "unmarked":
        bits = np.memmap(os.path.join(ragged_cache, "filled.bits"), np.uint8, mode="r+")
        bits[0] &= ~np.uint8(1 << 5)
        changes = np.memmap(os.path.join(ragged_cache, "changes.u64"), "<u8", mode="r+")
        changes[1] -= 1
        bits.flush()
        changes.flush()
        del bits, changes
    with MmapCachedDataset(ragged_cache, Texts(), ragged=["ids"]) as ds:
        with pytest.raises(CacheFormatError, match=r"row 5's index records the extent .* the cache is damaged"):
            ds[5]
    found = verify(ragged_cache).problems
    # (a stale row is still filled: verify checks its value's whole index row, as a complete one's)
    expected = "ids.index.npy: row 5 holds" if how == "stale" else (
        f"ids.index.npy: row 5 (not complete, its extent kept for its next value) records the extent "
        f"[{heap_size + 2**30}, {2**20}]")
    assert any(expected in p for p in found), found
    cli = subprocess.run([sys.executable, "-m", "mmapcache", "verify", ragged_cache], capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 1, cli.stdout + cli.stderr


def test_a_free_list_head_past_the_heap_is_damage_for_writers_and_verify(ragged_cache: str,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    counters = np.memmap(os.path.join(ragged_cache, "heaps.u64"), "<u8", mode="r+").reshape(2, -1)
    heads = np.flatnonzero(counters[0, 8:])
    assert len(heads), "the fixture's rewrites left free extents"
    counters[0, 8 + heads] = os.path.getsize(os.path.join(ragged_cache, "ids.heap")) + 2**20
    counters.flush()
    del counters
    before = _heap_files(ragged_cache)
    code = main(["verify", ragged_cache])
    assert code == 1 and "points at offset" in capsys.readouterr().err
    with MmapCachedDataset(ragged_cache, Texts(version=1), ragged=["ids"]) as ds:
        ds.refresh(fraction=1.0)
        with pytest.raises(CacheFormatError, match=r"free list of size class .* outside the heap"):
            ds.fill()  # longer values move, to extents of the lists freed by the fixture
    assert _heap_files(ragged_cache) == before


def test_heap_counters_past_the_file_are_damage(ragged_cache: str) -> None:
    counters = np.memmap(os.path.join(ragged_cache, "heaps.u64"), "<u8", mode="r+").reshape(2, -1)
    counters[0, 1] = 2**40  # capacity: a writer trusting it would write past the reserved bytes
    counters.flush()
    del counters
    with pytest.raises(CacheFormatError, match=r"ids\.heap: its counters in heaps\.u64 say"):
        MmapCachedDataset(ragged_cache, Texts(), ragged=["ids"])
    result = verify(ragged_cache)
    assert not result.ok and "its counters in heaps.u64" in result.problems[0]


# --- 4. a rotated share reopens, and verify compares each row with its key's sample -----------------------------


def test_a_rotated_share_reopens_and_verifies(cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    n, options = 30, {"node_share": (1, 3), "rotate_every": 1}
    with MmapCachedDataset(cache_path, ImageLabels(n), **options) as ds:  # type: ignore[arg-type]
        ds.set_epoch(1)
        ds.fill()  # generation 1's share, over generation 0's rows
    for _ in range(3):  # the identity check picks other stored samples each time
        with MmapCachedDataset(cache_path, ImageLabels(n), **options) as ds:  # type: ignore[arg-type]
            ds.set_epoch(1)
            assert all(sample_equal(ds[i], ImageLabels(n)[i]) for i in ds.cacheable_indices().tolist())
    result = verify(cache_path, ImageLabels(n), samples=None)
    assert result.ok and result.compared == 10, (result.problems, result.differences)
    spec = os.path.join(TESTS, "helpers", "cli_sources.py")
    assert main(["verify", cache_path, "--source", f"{spec}:images", "--kwargs", json.dumps({"n": n}), "--all"]) == 0
    assert "10 compared with the source" in capsys.readouterr().out


# --- 5. verify reports truncated or resized state files as damage (exit 1) --------------------------------------


@pytest.mark.parametrize("name", ["ring.u64", "heaps.u64", "changes.u64", "keys.i64"])
@pytest.mark.parametrize("how", ["truncate", "extend"])
def test_verify_reports_a_resized_state_file_as_damage(shm_dir: str, name: str, how: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = os.path.join(shm_dir, "c")
    source = Texts()
    with MmapCachedDataset(path, source, ragged=["ids"], stream=name == "ring.u64") as ds:
        if ds.stream:
            for _ in ds.loader(batch_size=4):
                break
        else:
            ds.fill()
    file = os.path.join(path, name)
    os.truncate(file, 8 if how == "truncate" else os.path.getsize(file) + 8)
    assert main(["verify", path]) == 1
    err = capsys.readouterr().err
    assert f"{name} has" in err and "damage" in err


def test_a_wrong_count_of_complete_rows_is_damage_never_served_as_zeros(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, ImageLabels(16), ragged=None) as ds:  # no probes: exactly 8 filled
        ds.fill(range(8))
    changes = np.memmap(os.path.join(cache_path, "changes.u64"), "<u8", mode="r+")
    changes[1] = 16  # "every row complete": the warm path would skip its per-row checks
    changes.flush()
    del changes
    with pytest.raises(CacheFormatError, match=r"changes\.u64: it counts 16 complete rows, but 8"):
        MmapCachedDataset(cache_path, ImageLabels(16))
    result = verify(cache_path)
    assert not result.ok and "it counts 16 complete rows" in result.problems[0]


def _stream_with_ring_words(path: str, *words: tuple[int | slice, int]) -> None:
    """A stream of ``Texts`` that one reader has read a batch of, with words of its ``ring.u64`` then set (damage)."""
    with MmapCachedDataset(path, Texts(), ragged=["ids"], stream=True) as ds:
        for _ in ds.loader(batch_size=4):
            break
    ring = np.memmap(os.path.join(path, "ring.u64"), "<u8", mode="r+")
    for at, value in words:
        ring[at] = value
    ring.flush()
    del ring


def test_damaged_reader_cursors_are_a_verify_finding(cache_path: str) -> None:
    # rank 0's cursor: no position of the epoch its progress names; rank 7 never read, yet has a cursor
    _stream_with_ring_words(cache_path, (8, 10**9), (8 + 2 * 7, 5))
    result = verify(cache_path)
    assert any("rank 0's cursor" in p for p in result.problems)
    assert any("rank 7 has a cursor" in p for p in result.problems)


class Boxes(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"boxes": torch.full((i % 4, 4), float(i)), "i": i}


def test_an_empty_values_shape_no_array_can_have_is_damage(cache_path: str) -> None:
    # Found by the damage fuzzer (seed 777002, case 595): a shape of (0, 2**63 - 1) holds no bytes, so it passed
    # the extent checks, and numpy's "array is too big" ValueError reached the reader of a batch.
    # (a fingerprint: an opener without one compares 3 stored rows chosen at random, and may meet row 5 first)
    with MmapCachedDataset(cache_path, Boxes(), ragged=["boxes"], fingerprint="boxes") as ds:
        ds.fill()
    index = np.load(os.path.join(cache_path, "boxes.index.npy"), mmap_mode="r+")
    index[5, 2:] = [0, 2**63 - 1]
    index.flush()
    del index
    with MmapCachedDataset(cache_path, Boxes(), ragged=["boxes"], fingerprint="boxes") as ds:
        with pytest.raises(CacheFormatError, match=r"row 5, field 'boxes'"):
            ds[5]
        with pytest.raises(CacheFormatError, match="row 5"):
            ds.__getitems__(list(range(12)))
    assert any("boxes.index.npy: row 5" in p for p in verify(cache_path).problems)


def test_an_empty_values_offset_past_the_heap_is_a_verify_finding(cache_path: str) -> None:
    # Found by a review: readers refuse an offset past the heap's used bytes even for an empty value (as writers
    # do, Heap.check_extent), while verify checked offsets only of extents that hold bytes, and said ok.
    with MmapCachedDataset(cache_path, Boxes(), ragged=["boxes"]) as ds:
        ds.fill()
    index = np.load(os.path.join(cache_path, "boxes.index.npy"), mmap_mode="r+")
    assert index[4, 1] == 0 and list(index[4, 2:]) == [0, 4]  # an empty value: no bytes
    index[4, 0] = 2**40
    index.flush()
    del index
    with pytest.raises(CacheFormatError, match="row 4, field 'boxes'"):
        with MmapCachedDataset(cache_path, Boxes(), ragged=["boxes"]) as ds:  # (the opener may compare row 4)
            ds[4]
    assert any("boxes.index.npy: row 4" in p for p in verify(cache_path).problems)


def test_a_recorded_fixed_dimension_its_rows_contradict_is_damage_on_a_miss(cache_path: str) -> None:
    # Found by the damage fuzzer (seed 777004, case 319): meta.json's ragged field (*, 4) edited to (0, *); the
    # stored rows of shape (k, 4) contradict it, yet the next miss (and an opener comparing stored samples) blamed
    # the source with a LayoutError that told the user to make a new cache with other options.
    with MmapCachedDataset(cache_path, Boxes(), fingerprint="boxes") as ds:
        ds.fill(range(8))
    meta_path = os.path.join(cache_path, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    [field] = [f for f in meta["fields"] if f["name"] == "boxes"]
    assert field["shape"] == [-1, 4]  # varying shapes found by the creator's probes: 4 columns always
    field["shape"] = [0, -1]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    damage = r"meta.json records field 'boxes' with the shape \(0, '\*'\) \(\* varies\), but row \d+ stores a value"
    with MmapCachedDataset(cache_path, Boxes(), fingerprint="boxes") as ds:
        for i in range(8):  # the stored values are still the source's
            assert torch.equal(ds[i]["boxes"], Boxes()[i]["boxes"])
        missing = [int(i) for i in ds.missing_indices() if i % 4]  # misses whose boxes have rows
        assert missing
        with pytest.raises(CacheFormatError, match=damage):
            ds[missing[0]]
        with pytest.raises(CacheFormatError, match=damage):
            ds.__getitems__(list(range(12)))
    with pytest.raises(CacheFormatError, match=damage):
        MmapCachedDataset(cache_path, Boxes())  # no fingerprint: the opener's comparisons meet it first
    report = build(cache_path, Boxes, fingerprint="boxes", workers=1)  # build workers check samples too
    assert report.failed and all("CacheFormatError" in f.error and "meta.json records field 'boxes'" in f.error
                                 for f in report.failed), report.failed
    assert any("boxes.index.npy" in p for p in verify(cache_path).problems)


def test_a_reader_cursor_past_the_last_epoch_is_damage_for_inspect(cache_path: str) -> None:
    # Found by the damage fuzzer (seed 777002, case 64): describe overflowed int64 counting what is ready ahead of
    # it, and closing the ring then raised BufferError over that error.
    _stream_with_ring_words(cache_path, (8, 0xFFFFFFFF80000000))  # rank 0's cursor
    with pytest.raises(CacheFormatError, match=r"a reader's cursor \(\d+\) is past the last epoch"):
        describe(cache_path)
    assert any("rank 0's cursor" in p for p in verify(cache_path).problems)


def test_a_ring_counter_no_run_could_reach_is_a_verify_finding_and_readers_go_on(cache_path: str) -> None:
    # Found by the damage fuzzer (seed 777004, case 346): 'produced' set to 2**64 - 1 made the next producer's
    # count raise numpy's overflow RuntimeWarning (an error where warnings are errors) from inside the library.
    _stream_with_ring_words(cache_path, (slice(1, 6), 2**64 - 1))  # produced, served, computed, waited_ns, skipped
    found = verify(cache_path).problems
    for name in ("produced", "served", "computed", "waited_ns", "skipped"):
        assert any(f"the counter '{name}' holds {2**64 - 1}" in p for p in found), found
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with MmapCachedDataset(cache_path, Texts(), ragged=["ids"], stream=True) as ds:
            batches = [batch for _, batch in zip(range(3), ds.loader(batch_size=4))]  # counts what it computed
    assert [len(batch["label"]) for batch in batches] == [4, 4, 4]


@pytest.mark.parametrize("word", [2**64 - 1, (5 << 32) | 10**6])
def test_a_reader_progress_past_the_stream_is_damage(cache_path: str, word: int) -> None:
    # Found by the damage fuzzer (seed 777001): an epoch past what a progress word can hold made the next reader's
    # cursor overflow (a raw OverflowError); a position past the epoch was read as "the epoch is done".
    _stream_with_ring_words(cache_path, (9, word))  # rank 0's progress
    with MmapCachedDataset(cache_path, Texts(), ragged=["ids"], stream=True) as ds:
        with pytest.raises(CacheFormatError, match=r"rank 0's progress .* describes no place in the stream of 24"):
            next(iter(ds.loader(batch_size=4)))
    assert any("rank 0's cursor" in p for p in verify(cache_path).problems)


def test_a_stream_state_past_the_last_epoch_is_refused(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Texts(), ragged=["ids"], stream=True) as ds:
        loader = ds.loader(batch_size=4)
        state = loader.state_dict()
        with pytest.raises(ValueError, match=r"state key 'epoch': 4294967296, expected an int from 0 to \d+"):
            loader.load_state_dict({**state, "epoch": 2**32})


# --- 6. no private exception reaches a user -----------------------------------------------------------------------


class TwoTexts(Dataset):
    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"a": "x" * (1000 + i), "b": "y" * (500 + i), "i": i}


def test_a_small_ragged_stream_shares_its_budget_between_fields(shm_dir: str) -> None:
    # With two ragged fields and a budget of about one sample, the first field's heap took the whole budget in one
    # growth step, and the first sample (stored at creation) failed with the private NoRoom.
    for max_bytes in (2000, 5000):
        path = os.path.join(shm_dir, f"s{max_bytes}")
        with MmapCachedDataset(path, TwoTexts(), stream=True, max_bytes=max_bytes) as ds:
            with pytest.warns(StreamBypassWarning, match="fewer than the 2 batches"):  # a ring of a sample or two
                loader = ds.loader(batch_size=4, collate_fn=lambda samples: samples)
            for batch in loader:
                assert all(s["a"] == "x" * (1000 + s["i"]) and s["b"] == "y" * (500 + s["i"]) for s in batch)
            assert ds.uncached_by_heap == 0


def test_a_stream_too_small_for_one_sample_is_a_clear_error(shm_dir: str) -> None:
    with pytest.raises(ValueError, match=r"max_bytes=1200 is smaller than one sample \(\d+ bytes\)"):
        MmapCachedDataset(os.path.join(shm_dir, "s"), TwoTexts(), stream=True, max_bytes=1200)


# --- 7. a changed source is caught when its sample 0 did not change -----------------------------------------------


class ScaledButZeroFirst(Dataset):
    """Samples scaled by ``scale``, but sample 0 is all zeros (a padding sample): the same for every scale."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return image_of(i).float() * self.scale * (i != 0)


def test_a_changed_source_whose_first_sample_is_unchanged_is_refused(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, ScaledButZeroFirst(1.0)) as ds:
        ds.fill()
    for _ in range(3):  # whichever 3 other samples an open compares, they changed
        with pytest.raises(CacheMismatchError, match=r"sample [1-9]\d* computed now differs from the stored copy"):
            MmapCachedDataset(cache_path, ScaledButZeroFirst(2.0))
    MmapCachedDataset(cache_path, ScaledButZeroFirst(1.0)).close()  # the same source still opens


# --- 8. whether a source is deterministic is recorded with the cache ---------------------------------------------


def test_a_random_source_is_recorded_and_later_openers_do_not_compare(cache_path: str) -> None:
    from helpers.sources import Scaled

    with MmapCachedDataset(cache_path, Scaled(16), deterministic=False) as ds:
        ds.fill()
    with open(os.path.join(cache_path, "meta.json")) as f:
        assert json.load(f)["deterministic"] is False
    # Another scale: a random source's samples differ on every call; only the layout is compared.
    MmapCachedDataset(cache_path, Scaled(16, scale=3.0)).close()
    result = verify(cache_path, Scaled(16, scale=3.0))
    assert result.ok and result.compared == 0 and "not deterministic" in (result.uncomparable or "")


def test_the_refresh_recipe_runs_next_to_a_random_source(shm_dir: str) -> None:
    # The README's recipe: training reads with stale="serve" while `mmapcache build --follow` refreshes rows. The
    # command line, which cannot say deterministic=False, must open the cache the trainer created.
    path = os.path.join(shm_dir, "c")
    spec = os.path.join(TESTS, "helpers", "cli_sources.py") + ":noisy"
    build = [sys.executable, "-m", "mmapcache", "build", path, "--dataset", spec, "--workers", "1"]
    created = subprocess.run([*build, "--no-deterministic"], env=ENV, capture_output=True, text=True, timeout=120)
    assert created.returncode == 0, created.stderr
    with open(os.path.join(path, "meta.json")) as f:
        assert json.load(f)["deterministic"] is False
    again = subprocess.run([*build, "--refresh", "0.5"], env=ENV, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "filled 8" in again.stdout, again.stdout + again.stderr
