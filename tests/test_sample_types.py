"""Every sample a real dataset returns: str, bytes, ragged arrays found without options, Python lists of numbers,
tensor subclasses with their attributes; stored exactly, read alike on hits, misses and batches."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from helpers import tvlike
from helpers.processes import another_process
from mmapcache import (
    LayoutError,
    MmapCachedDataset,
    PadCollate,
    Padded,
    TextCollate,
    UncachedFieldWarning,
    describe,
    verify,
)
from mmapcache.format.layout import MAX_FIELDS

HERE = os.path.dirname(os.path.abspath(__file__))


class Texts(torch.utils.data.Dataset):
    """Captions (unicode, empty ones included), raw bytes, ragged token ids and a label."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng(i)
        length = int(rng.integers(16, 513))
        return {"caption": "é✓ 猫 " * (i % 4) + f"#{i}" if i % 9 else "", "raw": bytes(range(i % 7)) * 3,
                "input_ids": torch.from_numpy(rng.integers(0, 50_000, length)), "label": i}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def test_str_bytes_and_ragged_tokens_round_trip_on_miss_hit_and_batch(cache_path: str) -> None:
    n = 60
    src = Texts(n)
    ds = MmapCachedDataset(cache_path, src, ragged="auto")
    fields = {f.name: f for f in ds._store.layout.fields}
    assert fields["caption"].kind == "str" and fields["raw"].kind == "bytes"
    assert fields["input_ids"].ragged and fields["input_ids"].shape == (-1,)  # found by probing
    for i in range(n):  # misses (except the probes), then hits
        assert _equal(ds[i], src[i]), i
    for i in range(n):
        assert _equal(ds[i], src[i]), i
    batch = list(range(0, n, 3))
    assert all(_equal(s, src[i]) for s, i in zip(ds.__getitems__(batch), batch))
    loaded = next(iter(ds.loader(batch_size=n)))
    assert loaded["caption"] == [src[i]["caption"] for i in range(n)]
    assert loaded["raw"] == [src[i]["raw"] for i in range(n)]
    assert isinstance(loaded["input_ids"], list) and all(torch.equal(a, src[i]["input_ids"])
                                                         for i, a in enumerate(loaded["input_ids"]))
    assert torch.equal(loaded["label"], torch.arange(n))
    ds.close()


def test_ragged_batches_with_misses_are_exact(cache_path: str) -> None:
    """A batch mixing hits and misses: the misses are patched into the gathered ragged columns."""
    src = Texts(40)
    ds = MmapCachedDataset(cache_path, src, ragged=["input_ids"])
    for i in range(0, 40, 2):
        ds[i]
    indices = list(range(40))
    assert all(_equal(s, src[i]) for s, i in zip(ds.__getitems__(indices), indices))
    ds.refresh(indices=range(0, 40, 5))
    padded = ds.read_batch(indices, pad=PadCollate(-7, mask=True))["input_ids"]
    for k, i in enumerate(indices):
        tokens = src[i]["input_ids"]
        assert torch.equal(padded.data[k, : len(tokens)], tokens) and (padded.data[k, len(tokens):] == -7).all()
        assert padded.lengths[k] == len(tokens) and padded.mask[k].sum() == len(tokens)
    ds.close()


def test_pad_collate_fused_in_the_loader_equals_it_over_any_dataset(cache_path: str) -> None:
    src = Texts(50)
    ds = MmapCachedDataset(cache_path, src, ragged=["input_ids"])
    collate = PadCollate(0, mask=True)
    plain = DataLoader(src, batch_size=16, collate_fn=collate)
    for _ in range(2):  # cold, then warm
        for fused, reference in zip(ds.loader(batch_size=16, collate_fn=collate), plain):
            assert isinstance(fused["input_ids"], Padded)
            for name in ("data", "lengths", "mask"):
                assert torch.equal(getattr(fused["input_ids"], name), getattr(reference["input_ids"], name))
            assert fused["caption"] == reference["caption"] and torch.equal(fused["label"], reference["label"])
    ds.close()


def test_a_pad_value_that_does_not_fit_is_refused_and_bfloat16_pads_with_the_value(cache_path: str) -> None:
    rows = [{"pix": torch.arange(i + 1, dtype=torch.uint8), "w": torch.arange(i + 2, dtype=torch.bfloat16)}
            for i in range(6)]
    with MmapCachedDataset(cache_path, rows, ragged=["pix", "w"]) as ds:
        with pytest.raises(ValueError, match=r"PadCollate\(pad_value=-1\) does not fit the values' dtype uint8 "
                                             r"\(0\.\.255\)"):
            next(iter(ds.loader(batch_size=6, collate_fn=PadCollate(-1, fields=["pix"]))))
        with pytest.raises(ValueError, match="does not fit the values' dtype uint8"):
            next(iter(DataLoader(rows, batch_size=6, collate_fn=PadCollate(-1, fields=["pix"]))))
        with pytest.raises(ValueError, match=r"pad_value=1\.5\) does not fit the values' dtype uint8"):
            next(iter(ds.loader(batch_size=6, collate_fn=PadCollate(1.5))))  # never silently rounded
        pad = PadCollate(1.5, fields=["w"])
        for loader in (ds.loader(batch_size=6, collate_fn=pad), DataLoader(
                [{"w": r["w"]} for r in rows], batch_size=6, collate_fn=pad)):
            w = next(iter(loader))["w"].data
            assert w.dtype == torch.bfloat16 and w[0, 2:].tolist() == [1.5] * 5  # the value, not its bits


@pytest.mark.parametrize("sample, name, what", [
    ({"txt": "abc", "n": 1}, "txt", "a str always stored packed"), ({"txt": "abc", "n": 1}, "n", "an int of no shape"),
])
def test_max_shapes_on_a_field_without_a_shape_is_refused(untouched: Any, cache_path: str, sample, name,
                                                          what) -> None:
    untouched(LayoutError, rf"max_shapes names field '{name}', {what}.*remove it from max_shapes",
              lambda: MmapCachedDataset(cache_path, [sample] * 3, max_shapes={name: (10,)}))


def test_pad_collate_over_python_lists_with_empty_ones_keeps_ints_and_every_value() -> None:
    pad = PadCollate(0, mask=True)
    for batch in ([{"ids": [5, 6]}, {"ids": []}], [{"ids": []}, {"ids": [5, 6]}]):
        ids = pad(batch)["ids"]
        assert ids.data.dtype == torch.int64 and sorted(ids.lengths.tolist()) == [0, 2]
        assert ids.data.tolist() in ([[5, 6], [0, 0]], [[0, 0], [5, 6]])
    assert pad([[], [5, 6]]).data.tolist() == [[0, 0], [5, 6]]
    # Found by a review: a batch of empty lists only was refused as "names ['ids'], which the samples do not have".
    ids = PadCollate(0, mask=True, fields=["ids"])([{"ids": []}, {"ids": []}])["ids"]
    assert ids.data.shape == (2, 0) and ids.data.dtype == torch.int64 and ids.lengths.tolist() == [0, 0]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float16, torch.float64])
def test_pad_collate_pads_every_row_as_pad_sequence_does_short_long_and_empty(dtype: torch.dtype) -> None:
    """Against ``pad_sequence`` and a mask of lengths, value by value: batches of short values (one scatter), long
    ones (copied row by row), empty ones among them, one sample, none longer than 0."""
    rng = np.random.default_rng(7)
    pad_value = 0 if dtype == torch.bool else 7
    collate = PadCollate(pad_value, mask=True, fields=["ids"])
    for longest in (0, 1, 5, 40, 700):
        for size in (1, 3, 16):
            lengths = rng.integers(0, longest + 1, size)
            values = [torch.from_numpy(rng.integers(0, 2 if dtype == torch.bool else 100, n)).to(dtype)
                      for n in lengths]
            got = collate([{"ids": v} for v in values])["ids"]
            wanted = torch.nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=pad_value)
            assert got.data.dtype == dtype and torch.equal(got.data, wanted), (longest, size)
            assert torch.equal(got.lengths, torch.from_numpy(lengths))
            assert torch.equal(got.mask, torch.arange(wanted.shape[1]) < got.lengths[:, None])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float32, torch.bfloat16])
def test_a_built_mask_is_ones_for_each_value_then_zeros_at_any_width(dtype: torch.dtype) -> None:
    """``TextCollate``'s built mask (``heap_batch.mask_of``: rows of ones copied from one kept array) against a
    comparison of lengths: empty values, widths rounded up past the longest, and widths past the kept array's first
    size (4,096), which grow it between batches."""
    rng = np.random.default_rng(3)
    for longest, multiple in ((0, None), (1, None), (9, 8), (700, None), (5000, 64), (300, None), (9000, None)):
        lengths = np.append(rng.integers(0, longest + 1, 5), [0, longest])
        collate = TextCollate(0, mask_dtype=dtype, build_mask=True, pad_to_multiple_of=multiple)
        batch = collate([{"input_ids": torch.arange(n)} for n in lengths])
        width = batch["input_ids"].shape[1]
        assert width == (-(-longest // multiple) * multiple if multiple else longest)
        wanted = (torch.arange(width) < torch.from_numpy(lengths)[:, None]).to(dtype)
        assert batch["attention_mask"].dtype == dtype and torch.equal(batch["attention_mask"], wanted), longest


def test_pad_collate_fields_are_checked(cache_path: str) -> None:
    with pytest.raises(TypeError, match=r"write fields=\['ids'\]"):
        PadCollate(0, fields="ids")
    with pytest.raises(ValueError, match=r"names \['nope'\], which the samples do not have; their fields are "
                                         r"\['ids', 'y'\]"):
        PadCollate(0, fields=["nope"])([{"ids": [1], "y": 1}])
    with MmapCachedDataset(cache_path, [{"ids": [1] * (i + 1), "y": i} for i in range(4)]) as ds:
        assert ds.fields == ["ids", "y"]
        with pytest.raises(ValueError, match=r"names \['nope'\]"):
            ds.loader(batch_size=2, collate_fn=PadCollate(0, fields=["nope"]))


def test_a_list_of_numbers_is_a_list_of_its_values_in_every_batch(cache_path: str) -> None:
    """1-D lists are always stored ragged, and ``ds.loader`` batches them as a list of the samples' lists, whatever
    their lengths in the batch. ``default_collate`` transposes lists of one length (a list of L tensors of B
    numbers): for token ids, a batch of one sample, or of lengths equal by chance, would change the batch's
    structure silently (a loop over ``batch["ids"]`` taking each token for a sample)."""
    rows = [{"emb": [float(i), 0.5, -1.0], "ids": list(range(i % 3 + 1)), "label": i} for i in range(9)]
    with MmapCachedDataset(cache_path, rows) as ds:
        for _ in range(2):  # misses, then hits
            for size in (1, 3, 4):  # (3: each batch's ids 1, 2 and 3 long; 4: a last batch of one sample)
                batches = list(ds.loader(batch_size=size))
                got = [(batch["emb"], batch["ids"], batch["label"].tolist()) for batch in batches]
                starts = range(0, 9, size)
                assert got == [([rows[i]["emb"] for i in range(k, min(k + size, 9))],
                                [rows[i]["ids"] for i in range(k, min(k + size, 9))],
                                list(range(k, min(k + size, 9)))) for k in starts], size


def test_any_str_comes_back_exactly_lone_surrogates_included(cache_path: str) -> None:
    names = [os.fsdecode(b"img_\xff.jpg"), "a\ud800b", "plain \u00e9", ""]
    with MmapCachedDataset(cache_path, [{"path": n, "i": k} for k, n in enumerate(names)]) as ds:
        for _ in range(2):
            assert [ds[k]["path"] for k in range(4)] == names
        assert [s["path"] for s in ds.__getitems__([3, 2, 1, 0])] == names[::-1]
        assert next(iter(ds.loader(batch_size=4)))["path"] == names


def test_a_ragged_field_that_changes_its_number_of_dimensions_says_so(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, [torch.zeros((2,) * (1 + i % 2)) for i in range(4)], ragged=["<sample>"]) as ds:
        with pytest.raises(LayoutError, match=r"sample 1, field '<sample>': 2 dimensions \(2, 2\), where the "
                                              r"field has 1; a ragged field may vary in size but not in number of "
                                              r"dimensions"):
            ds[1]


def test_a_full_heap_is_reported_by_build_counts_and_prefill(cache_path: str) -> None:
    # The largest values come first: the cacheable prefix, planned from the mean of 9 probes, does not fit.
    rows = [{"ids": torch.arange(10 + 40 * (199 - i), dtype=torch.int32)} for i in range(200)]
    with pytest.warns(UncachedFieldWarning):
        ds = MmapCachedDataset(cache_path, rows, ragged=["ids"], max_bytes="64K")
        stored = ds.fill()
    assert 0 < stored < ds.num_cacheable - 1 and ds.num_cached == stored + 1
    assert ds.uncached_by_heap > 0
    heap = describe(cache_path)["fields"][0]["heap"]  # (what `mmapcache inspect` prints: times, not samples)
    assert heap["uncached"] == ds.uncached_by_heap and f"no room for a value {heap['uncached']} times" in heap["text"]
    start = time.monotonic()
    ds.prefill(rank=0, world_size=1)  # must not wait out its patience for rows that cannot be stored
    assert time.monotonic() - start < 10
    ds.refresh(indices=range(200))
    assert ds.num_cached == 0  # stale rows are misses with stale="recompute", and not counted as cached
    ds.close()


def test_a_shape_varying_only_in_rare_samples_says_to_declare_it_ragged(cache_path: str) -> None:
    class Rare(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 100

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.zeros(5 if i == 3 else 4)

    ds = MmapCachedDataset(cache_path, Rare(), ragged="auto")
    with pytest.raises(LayoutError, match=r"'<sample>': expected shape \(4,\), found \(5,\).*ragged=\['<sample>'\]"):
        ds[3]
    ds.close()
    with MmapCachedDataset(cache_path, Rare(), ragged=["<sample>"], overwrite=True) as fixed:
        assert fixed[3].shape == (5,) and fixed[4].shape == (4,)


def test_ragged_heap_is_compact(cache_path: str) -> None:
    """Token ids of lengths 16..512, no max_shapes: the heap holds the values' bytes plus growth slack."""
    src = Texts(2000)
    with MmapCachedDataset(cache_path, src, ragged=["input_ids"]) as ds:
        ds.fill()
        values = sum(src[i]["input_ids"].numel() * 8 for i in range(len(src)))
        number = [f.name for f in ds._store.layout.ragged].index("input_ids")
        end, capacity, abandoned, uncached, free = (int(x) for x in ds._store.heap_counters[number][:5])
        assert end == values and abandoned == 0 and uncached == 0 and free == 0
        assert os.path.getsize(os.path.join(cache_path, "input_ids.heap")) == capacity
        assert capacity <= 1.15 * values


def _extents(ds: MmapCachedDataset, number: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The heap extents of ragged field ``number`` used by filled rows, and those on its free lists (walked as
    the format describes them: each free extent starts with [next offset + 1, size])."""
    store = ds._store
    field = [n for n, f in enumerate(store.layout.fields) if f.ragged][number]
    index, heap = store.index[field], store.heaps[field]
    filled = np.flatnonzero(store.state.filled_mask())
    used = [(int(index[r, 0]), int(index[r, 1])) for r in filled if index[r, 1]]
    free = []
    counters = store.heap_counters[number]
    buf = heap.covering(int(counters[0]))
    for cls in range(len(counters) - 8):
        at = int(counters[8 + cls])
        while at:
            following, size = (int(x) for x in buf[at - 1:at - 1 + 16].view("<u8"))
            free.append((at - 1, size))
            at = following
    return used, free


def _disjoint(extents: list[tuple[int, int]]) -> bool:
    ordered = sorted(extents)
    return all(a + n <= b for (a, n), (b, _) in itertools.pairwise(ordered))


class _Resized(torch.utils.data.Dataset):
    """200 samples ``i`` of 4..300 int64s (a new size drawn at every computation), all equal to ``i``."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((int(self.rng.integers(4, 300)),), i, dtype=torch.int64)


def _rewrite_rounds(ds: MmapCachedDataset, rounds: int) -> list[tuple[int, ...]]:
    """Refreshes half of the rows and fills them again, ``rounds`` times, checking after each that every heap byte
    is accounted for and no byte is used twice; returns each round's heap counters."""
    counters = []
    for _ in range(rounds):
        ds.refresh(fraction=0.5)
        ds.fill()
        end, capacity, abandoned, uncached, free = (int(x) for x in ds._store.heap_counters[0][:5])
        used, free_extents = _extents(ds, 0)
        assert end == sum(n for _, n in used) + free + abandoned  # every byte accounted for
        assert sum(n for _, n in free_extents) == free
        assert _disjoint(used + free_extents)
        counters.append((end, capacity, abandoned, uncached, free))
    assert all(bool((ds[i] == i).all()) for i in range(len(ds)))
    return counters


def test_rewrites_reuse_freed_space_so_fragmentation_stays_bounded(cache_path: str) -> None:
    """refresh + fill rewrite values of new sizes, over and over: a value that fits is written in place, a
    larger one moves and its old extent goes to the free lists, where later values find room. The heap stops
    growing, and no byte is ever used by two rows or by a row and a free list."""
    with MmapCachedDataset(cache_path, _Resized(), deterministic=False, ragged=["<sample>"]) as ds:
        ds.fill()
        ends = [end for end, *_ in _rewrite_rounds(ds, 40)]
    # 200 values of 4..300 int64s: 242 KB live on average. Appending every moved value would add ~120 KB per
    # round (~5 MB after 40); reuse keeps the heap within a small multiple of the live data, and flat.
    assert ends[-1] <= 2.5 * 200 * 300 * 8 // 2, ends
    assert ends[-1] <= 1.1 * ends[19], ends


def test_rewrites_under_a_heap_budget_find_room_in_the_space_moved_values_left(cache_path: str) -> None:
    """As above, under a heap budget 1.35x the live values: the heap cannot grow past it, and the free extents
    moved values left were of every size, none on the lists a growing value looks in. A value that finds no room
    is now cut from a larger free extent, or the free lists are rebuilt from what rows own (adjacent free bytes
    joined): 140 values went uncached over the 30 rounds before."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncachedFieldWarning)
        with MmapCachedDataset(cache_path, _Resized(), deterministic=False, ragged=["<sample>"],
                               max_bytes=330_000) as ds:
            ds.fill()
            _, capacity, _, uncached, _ = _rewrite_rounds(ds, 30)[-1]
            assert capacity <= 330_000
            assert uncached <= 25, uncached  # (before: 140)
            assert verify(cache_path).ok


def test_a_writer_that_died_mid_write_never_leaves_an_extent_to_two_rows(cache_path: str) -> None:
    """A row whose counter is odd (its writer was killed) may point at an extent the dead writer already freed;
    the next writer must not free or reuse it a second time."""
    src = Texts(50)
    with MmapCachedDataset(cache_path, src, ragged=["input_ids"], deterministic=False) as ds:
        ds.fill()
        state = ds._store.state
        number = [f.name for f in ds._store.layout.ragged].index("input_ids")
        index, heap = ds._store.index[2], ds._store.heaps[2]  # input_ids is field 2 (caption, raw, input_ids)
        assert ds._store.layout.fields[2].name == "input_ids"
        with state.lock:
            for row in range(0, 50, 2):
                # What a writer killed between freeing the row's old extent and writing its index row leaves:
                # an odd counter, and an index row pointing at an extent that is on a free list.
                state.seq[row] |= 1
                heap.allocate(int(index[row, 2]) * 8, 8, None)
                heap.free(int(index[row, 0]), int(index[row, 1]))
        ds.refresh(indices=range(50))
        ds.fill()
        used, free = _extents(ds, number)
        assert _disjoint(used + free)
        assert all(_equal(ds[i], src[i]) for i in range(50))


def test_a_full_heap_budget_serves_samples_uncached_and_warns_once(cache_path: str) -> None:
    src = Texts(300)
    with pytest.warns(UncachedFieldWarning, match=r"no room left in the cache's heap budget .* field "):
        ds = MmapCachedDataset(cache_path, src, max_bytes=200_000, ragged="auto")
        got = [ds[i] for i in range(len(src))]
    assert all(_equal(g, src[i]) for i, g in enumerate(got))
    uncached = int(ds._store.heap_counters[:, 3].sum())  # [end, capacity, abandoned, uncached, free, ...]
    assert uncached > 0 and ds.num_cached + uncached == ds.num_cacheable
    assert ds.num_cached > ds.num_cacheable // 2  # the budget went to the heap that needed it
    assert sum(os.path.getsize(os.path.join(cache_path, f)) for f in os.listdir(cache_path)) <= 200_000 + 64_000
    ds.close()


def test_heap_growth_seen_by_a_reader_that_mapped_it_small(cache_path: str) -> None:
    """A reader opened while the heap was small meets values stored past its mapping and maps again."""
    src = Texts(400)
    reader = MmapCachedDataset(cache_path, src, ragged=["input_ids"])
    first_size = reader._store.heaps[[f.name for f in reader._store.layout.fields].index("input_ids")].size
    with MmapCachedDataset(cache_path, src, ragged=["input_ids"]) as writer:
        writer.fill()
    assert os.path.getsize(os.path.join(cache_path, "input_ids.heap")) > first_size
    assert all(_equal(reader[i], src[i]) for i in range(len(src)))
    assert all(_equal(s, src[i]) for i, s in enumerate(reader.__getitems__(list(range(len(src))))))
    reader.close()


# --- Python lists (Hugging Face's default format) --------------------------------------------------------------


def test_python_lists_of_numbers_are_one_field_returned_as_lists(cache_path: str) -> None:
    rows = [{"pixels": [[[(i + y + x) % 256 for _ in range(3)] for x in range(32)] for y in range(32)],
             "scores": [0.5 * i, 1.0], "flags": [True, i % 2 == 0], "tokens": list(range(i % 9 + 1)), "label": i}
            for i in range(20)]
    ds = MmapCachedDataset(cache_path, rows)
    layout = ds._store.layout
    assert len(layout.fields) == 5 and {f.kind for f in layout.fields} == {"pylist", "int"}
    assert len(os.listdir(cache_path)) < 20
    for _ in range(2):
        for i, row in enumerate(rows):
            assert ds[i] == row and type(ds[i]["scores"][0]) is float and type(ds[i]["flags"][0]) is bool
    assert ds.__getitems__([3, 1]) == [rows[3], rows[1]]
    ds.close()


def test_an_empty_first_list_takes_its_element_type_from_the_probes(cache_path: str) -> None:
    # Token lists where sample 0's happens to be empty: the element type comes from the other probed samples.
    tokens = [[] if i == 0 else list(range(i % 7 + 1)) for i in range(20)]
    with MmapCachedDataset(cache_path, [{"ids": t} for t in tokens], ragged="auto") as ds:
        assert [ds[i]["ids"] for i in range(20)] == tokens
        assert all(type(x) is int for x in ds[3]["ids"])
    # Without probes the type cannot be known (float64), and a later int list says why and what to do.
    with MmapCachedDataset(cache_path + "-plain", [{"ids": t} for t in tokens], delete_on_close=True,
                           ragged=None) as ds:
        with pytest.raises(LayoutError, match=r"field 'ids': expected pylist of dtype <f8, found pylist of dtype "
                                              r"<i8.*empty.*ragged='auto'"):
            ds[1]


def test_too_many_fields_is_refused_before_anything_is_created(untouched: Any, cache_path: str) -> None:
    sample = [torch.zeros(2) for _ in range(MAX_FIELDS + 1)]
    untouched(LayoutError, r"the sample has 257 fields \(the limit is 256.*with_format\('torch'\)",
              lambda: MmapCachedDataset(cache_path, [sample]))


def test_running_out_of_file_descriptors_leaves_nothing_behind(shm_dir: str) -> None:
    """EMFILE during creation (many fields under a low open-file limit) cleans up its scratch directory."""
    script = textwrap.dedent(f"""
        import resource, torch
        from mmapcache import MmapCachedDataset
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        sample = {{f"f{{k}}": torch.zeros(2) for k in range(200)}}
        try:
            MmapCachedDataset({os.path.join(shm_dir, "c")!r}, [sample, sample])
        except OSError as exc:
            print("EMFILE" if exc.errno == 24 else exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "EMFILE" in out.stdout, out.stdout + out.stderr
    assert os.listdir(shm_dir) == []


# --- tensor subclasses (torchvision's tv_tensors) --------------------------------------------------------------


def test_tensor_subclasses_keep_class_and_metadata_on_every_path(cache_path: str) -> None:
    src = tvlike.Detection(30)
    ds = MmapCachedDataset(cache_path, src, ragged=["boxes"])
    first = ds[0]  # stored by the creator
    assert type(first["boxes"]) is tvlike.BoundingBoxes and first["boxes"].format is tvlike.BoundingBoxFormat.XYWH
    for _ in range(2):  # misses, then hits
        for i in range(len(src)):
            assert tvlike.same_tv(ds[i], src[i]), i
    assert all(tvlike.same_tv(s, src[i]) for i, s in enumerate(ds.__getitems__(list(range(len(src))))))
    ds.close()


def test_tensor_subclasses_of_a_cache_read_sample_by_sample_keep_only_their_metadata(cache_path: str) -> None:
    """A ``max_shapes`` field makes batches read sample by sample, whose plain ragged tensors are marked for
    default collation (``read.ragged.mark_ragged``); a tensor subclass's attributes are its metadata, which the
    sample carries: it is left unmarked, its attributes the source's."""
    src = tvlike.Detection(12)
    with MmapCachedDataset(cache_path, src, ragged=["boxes"], max_shapes={"image": (3, 16, 16)}) as ds:
        assert ds._ensure_open().variable
        for _ in range(2):  # misses, then hits
            assert all(tvlike.same_tv(s, src[i]) for i, s in enumerate(ds.__getitems__(list(range(len(src))))))


def test_tensor_subclasses_in_spawned_dataloader_workers(cache_path: str) -> None:
    src = tvlike.Detection(24)
    ds = MmapCachedDataset(cache_path, src, ragged="auto")
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    for i, sample in enumerate(loader):
        assert tvlike.same_tv(sample, src[i]), i
    ds.close()


def test_metadata_that_json_cannot_hold_is_refused_naming_the_attribute(untouched: Any, cache_path: str) -> None:
    bad = tvlike.image(torch.zeros(2))
    bad.origin = object()
    untouched(LayoutError, r"attribute 'origin' of the Image tensor is a builtins.object.*nothing is pickled",
              lambda: MmapCachedDataset(cache_path, [bad, bad]))


def test_a_class_not_loaded_in_the_reader_is_a_clear_error(cache_path: str) -> None:
    MmapCachedDataset(cache_path, tvlike.Detection(4), ragged=["boxes"]).close()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {HERE!r})
        from mmapcache import MmapCachedDataset, LayoutError
        try:
            MmapCachedDataset({cache_path!r})
        except LayoutError as exc:
            print("REFUSED", exc)
        import helpers.tvlike
        print(type(MmapCachedDataset({cache_path!r})[0]["image"]).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "REFUSED field 'image' holds helpers.tvlike.Image tensors, and that class is not loaded" in out.stdout, \
        out.stdout + out.stderr
    assert "import helpers" in out.stdout and out.stdout.strip().endswith("Image")


def test_meta_json_records_the_class_and_ragged_shape(cache_path: str) -> None:
    MmapCachedDataset(cache_path, tvlike.Detection(10), ragged="auto").close()
    with open(os.path.join(cache_path, "meta.json")) as f:
        fields = {f["name"]: f for f in json.load(f)["fields"]}
    assert fields["boxes"]["class"] == ["helpers.tvlike", "BoundingBoxes"] and fields["boxes"]["shape"] == [-1, 4]
    assert fields["boxes"]["ragged"] and fields[fields["boxes"]["metadata"] and "boxes#meta"]["kind"] == "json"


def test_transform_receives_the_typed_sample(cache_path: str) -> None:
    """A v2-style transform sees BoundingBoxes with their format on a hit too (flipping boxes needs it)."""
    seen = []

    def transform(sample: dict[str, Any]) -> dict[str, Any]:
        seen.append((type(sample["boxes"]), sample["boxes"].format, sample["boxes"].canvas_size))
        return sample

    src = tvlike.Detection(6)
    with MmapCachedDataset(cache_path, src, transform=transform, ragged=["boxes"]) as ds:
        for i in [0, 1, 0, 1]:
            ds[i]
    assert seen == [(tvlike.BoundingBoxes, src[i]["boxes"].format, src[i]["boxes"].canvas_size) for i in [0, 1, 0, 1]]


def test_concurrent_ragged_rewrites_never_show_a_torn_value(cache_path: str) -> None:
    """Two processes rewrite ragged values of changing lengths (in place and appended) while two read them; every
    value encodes its (index, version) in every element and its length, so a torn read shows."""
    from helpers.ragged_workers import RaggedVersioned, ragged_check_loop, ragged_rewrite_loop

    n = 6
    with MmapCachedDataset(cache_path, RaggedVersioned(n), stale="serve", deterministic=False,
                           ragged=["values"]) as ds:
        ds.fill()
    ctx = another_process()
    results = ctx.Queue()
    procs = [ctx.Process(target=ragged_rewrite_loop, args=(cache_path, n, w, 4.0, results)) for w in range(2)]
    procs += [ctx.Process(target=ragged_check_loop, args=(cache_path, n, r, 4.0, results)) for r in range(2)]
    for p in procs:
        p.start()
    reports = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    writers = [r for r in reports if r[0] == "writer"]
    readers = [r for r in reports if r[0] == "reader"]
    assert all(stored > 20 for _, stored, _ in writers), writers
    assert all(checks > 500 for _, checks, _ in readers), readers
    assert sum(torn for _, _, torn in readers) == 0, readers
