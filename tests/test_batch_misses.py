"""A batch's misses computed and checked together (``RowReader.fill_batch``): the exact bytes and order a
``DataLoader`` over the source returns, and, whenever one sample is unusual, the per-sample check's answer
(accepted, converted or refused naming its index), with the samples computed before a failure kept."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from mmapcache import MmapCachedDataset
from mmapcache.errors import LayoutError
from mmapcache.format.batch import stack_runs

N = 50


class Mixed(Dataset):
    """Every plain fixed-size kind in one dict: tensors (one bfloat16), an array, numpy and Python scalars."""

    def __init__(self, n: int = N, odd: dict[int, tuple[str, object]] | None = None) -> None:
        self.n, self.odd, self.calls = n, odd or {}, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, object]:
        self.calls += 1
        g = torch.Generator().manual_seed(i)
        sample: dict[str, object] = {
            "image": torch.randint(0, 256, (3, 5, 4), generator=g, dtype=torch.uint8),
            "x": torch.randn(6, generator=g),
            "half": torch.randn(2, 3, generator=g).to(torch.bfloat16),
            "mask": np.arange(8, dtype=np.int16).reshape(2, 4) * i,
            "weight": np.float32(i / 7),
            "label": i * 1_000_003,
            "score": i / 3,
            "flag": i % 2 == 0,
        }
        if i in self.odd:
            key, value = self.odd[i]
            if isinstance(value, Exception):
                raise value
            sample[key] = value
        return sample


def _equal(a: object, b: object) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(
            (a.view(torch.int16) == b.view(torch.int16)).all() if a.dtype == torch.bfloat16 else torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _epoch(data: Dataset, seed: int, batch_size: int = 8) -> list[object]:
    return list(DataLoader(data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("partial", [False, True])
def test_cold_batches_are_the_sources_bytes_in_its_order(cache_path: str, partial: bool) -> None:
    source = Mixed()
    # A partial cache: some positions of a batch are stored, the others only pass through.
    options = {"cache_indices": range(0, N, 3)} if partial else {}
    with MmapCachedDataset(cache_path, source, **options) as ds:  # type: ignore[arg-type]
        for seed in (0, 1):  # cold, then warm (or still partly cold)
            expected, got = _epoch(source, seed), _epoch(ds, seed)
            assert len(got) == len(expected) and all(_equal(a, b) for a, b in zip(expected, got))
        stored = range(0, N, 3) if partial else range(N)
        assert ds.num_cached == len(stored) and [i for i in range(N) if ds.is_cached(i)] == list(stored)
    # Another process's view: every stored row holds its own sample, bit for bit.
    with MmapCachedDataset(cache_path) as reader:
        for i in stored:
            got, want = reader[i], source[i]
            assert _equal(got["x"], want["x"]) and _equal(got["half"], want["half"]), i
            assert _equal(got["image"], want["image"]) and np.array_equal(got["mask"], want["mask"]), i
            assert got["weight"] == want["weight"] and got["label"] == want["label"], i
            assert got["score"] == want["score"] and got["flag"] is want["flag"], i


def test_batches_with_rows_stored_between_their_misses_are_the_sources(cache_path: str) -> None:
    # A batch whose misses come in runs between rows stored before (a cache's probes, ds[i], another process): each
    # run of misses is stacked straight into its slice of the batch (format.batch.stack_runs).
    source = Mixed()
    with MmapCachedDataset(cache_path, source) as ds:
        for i in [*range(0, N, 5), N - 1]:
            ds[i]
        expected, got = _epoch(source, 2, batch_size=16), _epoch(ds, 2, batch_size=16)
        assert len(got) == len(expected) and all(_equal(a, b) for a, b in zip(expected, got))
        assert ds.num_cached == N
    with MmapCachedDataset(cache_path) as reader:
        for i in range(N):
            got_i, want = reader[i], source[i]
            assert _equal(got_i["image"], want["image"]) and np.array_equal(got_i["mask"], want["mask"]), i
            assert _equal(got_i["x"], want["x"]) and got_i["label"] == want["label"], i


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_stack_runs_agrees_with_an_indexed_assignment(kind: str) -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        size = int(rng.integers(1, 40))
        positions = np.sort(rng.choice(size, int(rng.integers(1, size + 1)), replace=False)).astype(np.int64)
        values = [rng.integers(0, 255, (3, 2), dtype=np.uint8) for _ in positions]
        expected = np.zeros((size, 3, 2), np.uint8)
        expected[positions] = np.stack(values)
        out = np.zeros((size, 3, 2), np.uint8)
        if kind == "torch":
            stack_runs(torch.stack, [torch.from_numpy(v) for v in values], torch.from_numpy(out), positions)
        else:
            stack_runs(np.stack, values, out, positions)
        assert np.array_equal(out, expected), positions


def test_a_second_warm_epoch_calls_the_source_no_more(cache_path: str) -> None:
    source = Mixed()
    with MmapCachedDataset(cache_path, source) as ds:
        _epoch(ds, 0)
        calls = source.calls
        assert calls == N  # each index computed once, in batches
        _epoch(ds, 1)
        assert source.calls == calls


@pytest.mark.parametrize("value", [
    torch.arange(6.0, requires_grad=True),  # stored detached
    torch.arange(6.0).as_strided((6,), (1,)).neg()._neg_view(),  # a negative view: stored resolved
    torch.arange(12.0)[::2],  # not contiguous
])
def test_an_unusual_tensor_in_a_batch_is_stored_as_the_per_sample_check_stores_it(
        cache_path: str, value: torch.Tensor) -> None:
    source = Mixed(odd={13: ("x", value)})
    with MmapCachedDataset(cache_path, source) as ds:
        got = ds.__getitems__(list(range(8, 24)))
        expected = value.detach().resolve_neg().contiguous()
        assert torch.equal(got[13 - 8]["x"], expected) and not got[13 - 8]["x"].requires_grad
        assert torch.equal(got[12 - 8]["x"], source[12]["x"])
    with MmapCachedDataset(cache_path) as reader:
        assert torch.equal(reader[13]["x"], expected) and torch.equal(reader[12]["x"], source[12]["x"])


def test_a_conjugate_view_is_stored_resolved(cache_path: str) -> None:
    class Complex(Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor([1 + 2j * i, 3 - 1j], dtype=torch.complex64).conj()

    with MmapCachedDataset(cache_path, Complex()) as ds:
        batch = next(iter(DataLoader(ds, batch_size=16)))
        expected = torch.stack([torch.tensor([1 - 2j * i, 3 + 1j], dtype=torch.complex64) for i in range(16)])
        assert torch.equal(batch, expected)
        with MmapCachedDataset(cache_path) as reader:
            assert torch.equal(reader[5], expected[5])


@pytest.mark.parametrize(("key", "value", "match"), [
    ("x", torch.arange(6, dtype=torch.float64), r"sample 13.*'x'"),
    ("image", torch.zeros(3, 5, 5, dtype=torch.uint8), r"sample 13.*'image'"),
    ("label", 2**70, r"sample 13.*does not fit in int64"),
    ("flag", 1, r"sample 13.*'flag'"),
])
def test_a_bad_sample_in_a_batch_is_refused_naming_it_and_the_ones_before_are_kept(
        cache_path: str, key: str, value: object, match: str) -> None:
    source = Mixed(odd={13: (key, value)})
    with MmapCachedDataset(cache_path, source, ragged=None) as ds:  # no probes: the creator stores sample 0 only
        with pytest.raises(LayoutError, match=match):
            ds.__getitems__(list(range(8, 24)))
        cached = {i for i in range(N) if ds.is_cached(i)}
        # The ones before it are stored; the ones after were computed but never checked: not stored.
        assert cached == {0, *range(8, 13)}


def test_a_source_failing_mid_batch_keeps_the_samples_before_it(cache_path: str) -> None:
    source = Mixed(odd={13: ("x", OSError("disk on fire"))})
    with MmapCachedDataset(cache_path, source, ragged=None) as ds:  # no probes: the creator stores sample 0 only
        with pytest.raises(OSError, match="disk on fire") as info:
            ds.__getitems__(list(range(8, 24)))
        assert any("sample 13" in note for note in getattr(info.value, "__notes__", []))
        assert {i for i in range(N) if ds.is_cached(i)} == {0, *range(8, 13)}  # 0: the creator's first sample
        with MmapCachedDataset(cache_path) as reader:
            for i in range(8, 13):
                assert _equal(reader[i], ds[i]) and reader[i]["label"] == i * 1_000_003


def test_check_finite_refuses_the_sample_with_nan_naming_it(cache_path: str) -> None:
    source = Mixed(odd={13: ("x", torch.tensor([0.0, math.nan, 1, 2, 3, 4]))})
    with MmapCachedDataset(cache_path, source, check_finite=True, ragged=None) as ds:
        with pytest.raises(ValueError, match=r"sample 13, field 'x': contains NaN"):
            ds.__getitems__(list(range(8, 24)))
        assert {i for i in range(N) if ds.is_cached(i)} == {0, *range(8, 13)}
        # Without the NaN sample, a batch is stored as usual.
        assert len(ds.__getitems__(list(range(24, 40)))) == 16
        assert {i for i in range(N) if ds.is_cached(i)} == {0, *range(8, 13), *range(24, 40)}


class RefillsOneBuffer(Dataset):
    """A source that writes every sample into one output buffer and returns it (as some decoders do), fixed-size
    (``ragged=False``) or as a view of varying length (a ragged field). With ``shift``, the view starts at an offset
    that differs for every sample of a batch (a decoder writing into a preallocated ring): no two samples' arrays
    start at the same address, yet their memory overlaps."""

    def __init__(self, kind: str, ragged: bool = False, shift: bool = False) -> None:
        self.kind, self.ragged, self.shift = kind, ragged, shift
        self.buf = torch.zeros(32) if kind == "tensor" else np.zeros(32, np.float32)

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> dict[str, object]:
        self.buf[:] = i
        start = i % 16 if self.shift else 0
        return {"x": self.buf[start:start + (3 + i % 5 if self.ragged else 8)], "i": i}


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("kind", ["tensor", "ndarray"])
def test_a_source_refilling_one_buffer_stores_each_sample_its_own_value(
        cache_path: str, kind: str, ragged: bool, shift: bool) -> None:
    # Computing a whole batch before copying it would leave the last sample's bytes under every index; the cache
    # must store, and return, what ds[i] would.
    options = {"ragged": ["x"]} if ragged else {}
    source = RefillsOneBuffer(kind, ragged, shift)
    with MmapCachedDataset(cache_path, source, **options) as ds:  # type: ignore[arg-type]
        for batch in ds.loader(batch_size=8, collate_fn=lambda samples: samples) if ragged else ds.loader(
                batch_size=8):
            if not ragged:
                assert [float(v) for v in batch["x"][:, 0]] == [float(i) for i in batch["i"]]
            else:
                assert all(float(s["x"][0]) == s["i"] for s in batch)
    with MmapCachedDataset(cache_path) as reader:
        for i in range(24):
            value = np.asarray(reader[i]["x"])
            assert value.shape == ((3 + i % 5,) if ragged else (8,)) and (value == i).all(), (i, value)


@pytest.mark.parametrize("shift", [False, True])
def test_probes_of_a_refilling_source_are_each_stored_right(cache_path: str, shift: bool) -> None:
    # ragged="auto" computes 8 samples before it knows the layout, and stores them: each must be its own.
    with MmapCachedDataset(cache_path, RefillsOneBuffer("tensor", ragged=True, shift=shift), ragged="auto") as ds:
        stored = [i for i in range(24) if ds.is_cached(i)]
        assert len(stored) == 8
    with MmapCachedDataset(cache_path) as reader:
        assert all(bool((reader[i]["x"] == i).all()) and len(reader[i]["x"]) == 3 + i % 5 for i in stored)


class RefillsAndFails(RefillsOneBuffer):
    """``RefillsOneBuffer`` with a few unreadable records: computing one raises, after the samples before it in its
    batch were computed (into the same buffer)."""

    BAD = (5, 13)

    def __getitem__(self, i: int) -> dict[str, object]:
        if i in self.BAD:
            self.buf[:] = -1
            raise OSError(f"record {i} is corrupt")
        return super().__getitem__(i)


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("ragged", [False, True])
def test_a_batch_that_fails_midway_stores_no_sample_with_anothers_value(cache_path: str, ragged: bool,
                                                                         shift: bool) -> None:
    # The samples computed before the failure are stored (the work is kept), but not from the refilled buffer:
    # they would hold the value last written into it. (Ragged fields take the per-sample path, which copies each
    # value as it comes: the baseline the batched path must match.)
    options = {"ragged": ["x"]} if ragged else {"ragged": None}
    with MmapCachedDataset(cache_path, RefillsAndFails("tensor", ragged, shift), **options) as ds:  # type: ignore[arg-type]
        failed = 0
        for start in range(0, 24, 8):
            try:
                ds.__getitems__(list(range(start, start + 8)))
            except OSError:
                failed += 1
        assert failed == 2
        stored = [i for i in range(24) if ds.is_cached(i)]
    assert set(range(16, 24)) <= set(stored) and not set(RefillsAndFails.BAD) & set(stored)
    with MmapCachedDataset(cache_path) as reader:
        for i in stored:
            value = np.asarray(reader[i]["x"])
            assert value.shape == ((3 + i % 5,) if ragged else (8,)) and (value == i).all(), (i, value)


class Windows(Dataset):
    """Overlapping windows of one array that never changes (a time series): views whose memory overlaps on
    purpose. Not a refilled buffer, but the cache cannot tell: it must store every window as it is."""

    def __init__(self) -> None:
        self.series = np.arange(64, dtype=np.float32)

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> tuple[torch.Tensor, np.ndarray]:
        return torch.from_numpy(self.series[i:i + 8]), self.series[i + 8:i + 16]


def test_overlapping_windows_of_a_constant_array_are_stored_as_they_are(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Windows()) as ds:
        batches = list(ds.loader(batch_size=16))
    assert torch.equal(torch.cat([b[0] for b in batches]), torch.stack([torch.arange(i, i + 8.0) for i in range(48)]))
    with MmapCachedDataset(cache_path) as reader:
        for i in range(48):
            window, after = reader[i]
            assert window.tolist() == list(range(i, i + 8)) and after.tolist() == list(range(i + 8, i + 16)), i


class OneBufferForTwoFields(Dataset):
    """Both fields of a sample are views of one buffer the source refills: sample ``i``'s ``a`` lies where another
    sample's ``b`` lay. Start addresses differ across a batch; only the ranges overlap."""

    def __init__(self) -> None:
        self.buf = torch.zeros(64)

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = 3 * i % 29
        self.buf[start:start + 8] = i
        self.buf[start + 8:start + 12] = -i
        return {"a": self.buf[start:start + 8], "b": self.buf[start + 8:start + 12]}


def test_fields_of_different_samples_sharing_one_buffer_are_each_stored_right(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, OneBufferForTwoFields()) as ds:
        batch = ds.__getitems__(list(range(1, 16)))
        assert [(s["a"] == i).all().item() and (s["b"] == -i).all().item() for i, s in zip(range(1, 16), batch)] == [
            True] * 15
    with MmapCachedDataset(cache_path) as reader:
        assert all(bool((reader[i]["a"] == i).all() and (reader[i]["b"] == -i).all()) for i in range(16))


@pytest.mark.parametrize("ragged", [False, True])
def test_a_stream_read_from_a_refilling_source_serves_each_sample_its_own_value(cache_path: str,
                                                                                ragged: bool) -> None:
    # No producer: the reader computes every position, keeping each value in the batch's column until the batch is
    # built; a column must keep a copy, not a view of the source's buffer.
    options: dict[str, Any] = {"ragged": ["x"]} if ragged else {"max_shapes": {"x": (8,)}}
    with MmapCachedDataset(cache_path, RefillsOneBuffer("tensor", ragged=True, shift=True), stream=True,
                           **options) as ds:
        for batch in ds.loader(batch_size=8, collate_fn=lambda samples: samples):
            assert [float(s["x"][0]) for s in batch] == [float(s["i"]) for s in batch]
            assert all(bool((s["x"] == s["i"]).all()) for s in batch)


def test_ranges_overlap_agrees_with_a_pairwise_check() -> None:
    from mmapcache.format.batch import ranges_overlap

    rng = np.random.default_rng(5)
    for _ in range(3000):
        n = int(rng.integers(0, 9))
        starts = rng.integers(0, 40, n)
        ends = starts + rng.integers(0, 12, n)
        owners = rng.integers(0, 3, n)
        pairwise = any(owners[a] != owners[b] and max(starts[a], starts[b]) < min(ends[a], ends[b])
                       for a in range(n) for b in range(a + 1, n))
        assert ranges_overlap(starts, ends, owners) == pairwise, (starts, ends, owners)


def test_check_finite_sees_infinities_in_types_numpy_lacks(cache_path: str) -> None:
    # bfloat16 is stored as uint16; its infinities must be refused all the same, in a batch and one by one.
    odd = {13: ("half", torch.tensor([[0.0, math.inf, 1], [2, 3, 4]]).to(torch.bfloat16))}
    with MmapCachedDataset(cache_path, Mixed(odd={**odd, 30: odd[13]}), check_finite=True) as ds:
        with pytest.raises(ValueError, match=r"sample 13, field 'half': contains NaN or infinite"):
            ds.__getitems__(list(range(8, 24)))
        with pytest.raises(ValueError, match=r"sample 30, field 'half': contains NaN or infinite"):
            ds[30]
        assert not ds.is_cached(13) and not ds.is_cached(30) and ds.is_cached(12)


class SharedBuffer(Dataset):
    """Writes every sample into one tensor in shared memory and returns it (``mode="refill"``), as a decoder with an
    output buffer does once torch has moved the dataset's tensors into shared memory for spawned workers (with
    ``share=True`` the source shares it itself, which fork workers then also all write into); or returns that one
    tensor, never written, for every sample (``"constant"``); or a buffer of its own per process (``"per_process"``).
    Each sample's ``x`` is ``i`` in every element (the constant's, 7)."""

    def __init__(self, mode: str, ragged: bool = False, share: bool = False, n: int = 96,
                 odd_fail: bool = False) -> None:
        self.mode, self.ragged, self.n, self.odd_fail = mode, ragged, n, odd_fail
        self.buf: torch.Tensor | None = None if mode == "per_process" else torch.full((64,), 7.0)
        if share and self.buf is not None:
            self.buf.share_memory_()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, object]:
        if self.odd_fail and i % 2:
            raise OSError(f"record {i} is unreadable")
        if self.buf is None:
            self.buf = torch.zeros(64)
        if self.mode != "constant":
            self.buf.fill_(i)
            sum(range(3000))  # some decoding, for the other worker to write meanwhile
        return {"x": self.buf[:5 + i % 7] if self.ragged else self.buf, "i": i}

    def value(self, i: int) -> float:
        return 7.0 if self.mode == "constant" else float(i)


def _through_two_workers(path: str, source: SharedBuffer, context: str, ragged: bool,
                         batch_size: int | None = 8) -> list[dict[str, Any]]:
    """Every sample of a shuffled epoch through DataLoader(ds, num_workers=2), as a list (``batch_size=None``: the
    workers read ``ds[i]``)."""
    options: dict[str, Any] = {"ragged": ["x"]} if ragged else {}
    with MmapCachedDataset(path, source, **options) as ds:
        batches = iter(DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=2,
                                  multiprocessing_context=context, collate_fn=_as_list))
        try:
            return list(batches) if batch_size is None else [sample for batch in batches for sample in batch]
        finally:
            # Now, not when the iterator is collected: the traceback of a worker's error, which pytest keeps, holds
            # it, and its workers went on with the batches handed to them after the test had removed the cache (a
            # spawned worker then created it again, and the directory outlived the test).
            batches._shutdown_workers()  # type: ignore[attr-defined]


def _as_list(samples: list[Any]) -> list[Any]:
    return samples


@pytest.mark.parametrize(("context", "share", "ragged", "batch_size"), [
    ("spawn", False, False, 8), ("fork", True, False, 8), ("fork", True, True, 8), ("fork", True, False, 1),
    ("fork", True, False, None)])
def test_workers_refilling_one_shared_buffer_are_refused_and_nothing_wrong_is_stored(
        cache_path: str, context: str, share: bool, ragged: bool, batch_size: int | None) -> None:
    # Two workers writing into one buffer: a sample held another's bytes when it was stored (6 of 200 in one run),
    # and the cache kept them for good. Each worker now checks, on its first miss, whether its source writes every
    # sample into one tensor in shared memory (batches of fixed fields: the batch's samples overlap; ragged fields,
    # batches of one and ds[i]: the first sample holds a shared tensor), and refuses, naming the fix.
    source = SharedBuffer("refill", ragged, share)
    with pytest.raises(Exception, match=r"(?s)SourceError.*writes every sample into one tensor of its own, and that "
                                        r"tensor is in shared memory: its 2 DataLoader workers.*per process"):
        _through_two_workers(cache_path, source, context, ragged, batch_size)
    with MmapCachedDataset(cache_path) as reader:
        stored = [i for i in range(source.n) if reader.is_cached(i)]
        assert 0 < len(stored) <= 9  # the first sample and the layout's probes, stored at creation in this process
        assert all(bool((reader[i]["x"] == i).all()) for i in stored)


@pytest.mark.parametrize("mode", ["constant", "per_process"])
def test_a_constant_shared_tensor_or_a_buffer_per_worker_is_cached(cache_path: str, mode: str) -> None:
    # What the check must let through: one shared tensor that no sample writes into, and a buffer each worker
    # makes for itself.
    source = SharedBuffer(mode, share=True)
    served = _through_two_workers(cache_path, source, "fork", ragged=False)
    assert sorted(s["i"] for s in served) == list(range(source.n))
    assert all(bool((s["x"] == source.value(s["i"])).all()) for s in served)
    with MmapCachedDataset(cache_path) as reader:
        assert reader.num_cached == source.n
        assert all(bool((reader[i]["x"] == source.value(i)).all()) for i in range(source.n))


def test_the_shared_buffer_check_never_fails_the_sample_asked_for(cache_path: str) -> None:
    # The check computes the next sample's index too: one the source fails on must not fail the sample asked for
    # (ds[i] in workers, batch_size=None, over the even indices of a source failing on every odd one).
    source = SharedBuffer("constant", share=True, odd_fail=True)
    with MmapCachedDataset(cache_path, source, ragged=None) as ds:
        loader = DataLoader(ds, batch_size=None, sampler=list(range(0, source.n, 2)), num_workers=2,
                            multiprocessing_context="fork", collate_fn=_as_list)
        served = list(loader)
    assert sorted(s["i"] for s in served) == list(range(0, source.n, 2))
    assert all(bool((s["x"] == 7.0).all()) for s in served)


class _FastThenSlow(Dataset):
    """400 small rows: the first 16 computed at once, each later one in 5 ms."""

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> torch.Tensor:
        if i >= 16:
            import time

            time.sleep(0.005)
        return torch.full((4,), float(i))


def test_fill_stores_in_batches_that_grow_at_most_twofold_and_shrink_with_the_source(cache_path: str) -> None:
    """A batch is stored at its end, and a peer's prefill watches the rows fill: fill() starts with 8 samples, then
    takes about half a second of the source a batch, growing at most twofold. A review found a batch of 1,024 slow
    samples after 8 fast ones (no row stored for 3.7 s: a live peer taken for dead), and, before, 1,024 at once."""
    with MmapCachedDataset(cache_path, _FastThenSlow(), fingerprint="fast-then-slow") as ds:
        sizes: list[int] = []
        store_batch = ds._misses.store_batch

        def recorded(idx: Any, rows: Any) -> int:
            sizes.append(len(idx))
            return store_batch(idx, rows)

        ds._misses.store_batch = recorded  # type: ignore[method-assign]  # (observed, not replaced)
        ds.fill()
        assert ds.num_cached == 400 and not len(ds.missing_indices())
        assert sizes[0] == 8 and all(b <= 2 * a for a, b in itertools.pairwise(sizes)), sizes
        assert max(sizes) <= 200, sizes  # (5 ms samples: about 100 to the half second, never 1,024)
        assert all(torch.equal(ds[i], torch.full((4,), float(i))) for i in range(0, 400, 37))
