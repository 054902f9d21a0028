"""A batch's misses of a layout with ragged fields, checked together (``format.batch``'s ragged fillers: each field's
values copied once, back to back, into the batch's column) and stored from those columns: the source's values in
its order, whatever the batch holds; and wherever one sample is unusual, the per-sample check's answer (accepted,
converted or refused naming its index), with the samples computed before a refusal kept."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from mmapcache import MmapCachedDataset, PadCollate
from mmapcache.errors import LayoutError
from mmapcache.read.reader import RowReader

N = 48
RAGGED = ["ids", "boxes", "half", "pcm", "text", "blob"]


class Tokens(Dataset):
    """Every kind a ragged batch filler takes: int64 token ids, float32 boxes ``(n, 4)``, bfloat16 values, an int16
    numpy array, a str (not ASCII), bytes; empty values among them; and an int label."""

    def __init__(self, n: int = N, odd: dict[int, tuple[str, object]] | None = None) -> None:
        self.n, self.odd = n, odd or {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, object]:
        g = torch.Generator().manual_seed(i)
        sample: dict[str, object] = {
            "ids": torch.randint(0, 50_000, (i % 13,), generator=g),
            "boxes": torch.randn(i % 4, 4, generator=g),
            "half": torch.randn(1 + i % 5, generator=g).to(torch.bfloat16),
            "pcm": np.arange(i % 6, dtype=np.int16) * i,
            "text": "é" * (i % 3) + "x" * (i % 7),
            "blob": bytes(range(i % 9)),
            "label": i,
        }
        if i in self.odd:
            key, value = self.odd[i]
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
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The indices the per-sample check was asked about (a batch filled whole asks it about none)."""
    asked: list[int] = []
    real = RowReader.__init__

    def init(self: RowReader, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        check = self.check

        def counted(sample: Any, index: int) -> list[Any]:
            asked.append(index)
            return check(sample, index)
        self.check = counted
    monkeypatch.setattr(RowReader, "__init__", init)
    return asked


def _stored_as_the_source(path: str, source: Tokens, indices: range | list[int]) -> None:
    with MmapCachedDataset(path) as reader:
        for i in indices:
            assert reader.is_cached(i) and _equal(reader[i], source[i]), i


def test_cold_batches_are_checked_together_and_stored_as_the_source_gives_them(cache_path: str,
                                                                              checks: list[int]) -> None:
    source = Tokens()
    with MmapCachedDataset(cache_path, source, ragged=RAGGED) as ds:
        checks.clear()
        order = np.random.default_rng(0).permutation(N).tolist()
        for k in range(0, N, 16):
            batch = order[k:k + 16]
            got = ds.__getitems__(batch)
            assert len(got) == len(batch) and all(_equal(s, source[i]) for s, i in zip(got, batch))
        assert checks == []  # (every batch filled by the batch filler, none sample by sample)
        assert ds.num_cached == N
    _stored_as_the_source(cache_path, source, range(N))


def test_padded_cold_batches_equal_the_padding_of_the_sources_samples(cache_path: str) -> None:
    source = Tokens()
    pad = PadCollate(7, mask=True, fields=["ids", "half"])
    with MmapCachedDataset(cache_path, source, ragged=RAGGED) as ds:
        for batch in ds.loader(batch_size=10, collate_fn=pad, shuffle=True, seed=3):
            samples = [source[i] for i in batch["label"].tolist()]
            expected = pad([{k: s[k] for k in ("ids", "half", "text")} for s in samples])
            for field in ("ids", "half"):
                got, want = batch[field], expected[field]
                assert _equal(got.data, want.data) and torch.equal(got.lengths, want.lengths)
                assert torch.equal(got.mask, want.mask)
            assert batch["text"] == expected["text"]
            assert all(_equal(list(batch[k]), [s[k] for s in samples]) for k in ("boxes", "pcm", "blob"))
    _stored_as_the_source(cache_path, source, range(N))


def test_a_batch_around_stored_rows_and_with_an_index_twice_is_the_sources(cache_path: str,
                                                                          checks: list[int]) -> None:
    # Positions already stored are gathered; the misses between them are filled by the batch filler into their
    # positions; an index asked twice is stored once.
    source = Tokens()
    with MmapCachedDataset(cache_path, source, ragged=RAGGED) as ds:
        for i in (10, 13, 14, 20):
            ds[i]
        checks.clear()
        batch = [*range(9, 22), 12, 12]
        got = ds.__getitems__(batch)
        assert all(_equal(s, source[i]) for s, i in zip(got, batch))
        assert checks == []
    _stored_as_the_source(cache_path, source, range(9, 22))


@pytest.mark.parametrize(("key", "value"), [
    ("half", torch.arange(6.0).to(torch.bfloat16).requires_grad_()),  # stored detached
    ("ids", torch.arange(12)[::2]),  # not contiguous
    ("boxes", torch.arange(8.0).reshape(4, 2).t()),  # not contiguous, of 2 dimensions
])
def test_an_unusual_ragged_tensor_is_stored_as_the_per_sample_check_stores_it(cache_path: str, key: str,
                                                                              value: torch.Tensor) -> None:
    source = Tokens(odd={13: (key, value)})
    with MmapCachedDataset(cache_path, source, ragged=RAGGED) as ds:
        got = ds.__getitems__(list(range(8, 24)))
        expected = value.detach().contiguous()
        assert _equal(got[13 - 8][key], expected) and not got[13 - 8][key].requires_grad
        assert all(_equal(s, source[i]) for s, i in zip(got, range(8, 24)) if i != 13)
    with MmapCachedDataset(cache_path) as reader:
        assert _equal(reader[13][key], expected) and _equal(reader[12], source[12])


@pytest.mark.parametrize(("key", "value", "match"), [
    ("ids", torch.arange(6, dtype=torch.int32), r"sample 13.*'ids'"),
    ("boxes", torch.zeros(2, 4, dtype=torch.float64), r"sample 13.*'boxes'"),
    ("boxes", torch.zeros(8), r"sample 13.*'boxes'"),
    ("pcm", np.arange(3, dtype=np.int32), r"sample 13.*'pcm'"),
    ("text", b"bytes, not str", r"sample 13.*'text'"),
])
def test_a_bad_ragged_value_in_a_batch_is_refused_naming_it_and_the_ones_before_are_kept(
        cache_path: str, key: str, value: object, match: str) -> None:
    source = Tokens(odd={13: (key, value)})
    with MmapCachedDataset(cache_path, source, ragged=RAGGED) as ds:
        before = {i for i in range(N) if ds.is_cached(i)}  # (the creator's first sample)
        with pytest.raises(LayoutError, match=match):
            ds.__getitems__(list(range(8, 24)))
        # The ones before it are stored; the ones after were computed but never checked: not stored.
        assert {i for i in range(N) if ds.is_cached(i)} == before | set(range(8, 13))
    _stored_as_the_source(cache_path, source, range(8, 13))


def test_a_narrowed_value_that_does_not_fit_is_refused_naming_it(cache_path: str) -> None:
    source = Tokens(odd={13: ("ids", torch.tensor([5, 2**40, 7]))})
    with MmapCachedDataset(cache_path, source, ragged=RAGGED, store_as={"ids": "int32"}) as ds:
        with pytest.raises(LayoutError, match=r"sample 13, field 'ids': the value 1099511627776 does not fit int32"):
            ds.__getitems__(list(range(8, 24)))
        assert all(ds.is_cached(i) for i in range(8, 13)) and not any(ds.is_cached(i) for i in range(13, 24))
        got = ds.__getitems__(list(range(24, 40)))  # without it, a batch is stored as usual
        assert all(_equal(s, source[i]) for s, i in zip(got, range(24, 40)))
    _stored_as_the_source(cache_path, source, [*range(8, 13), *range(24, 40)])


def test_check_finite_refuses_a_ragged_value_with_nan_naming_it(cache_path: str) -> None:
    source = Tokens(odd={13: ("boxes", torch.tensor([[0.0, math.nan, 1, 2]]))})
    with MmapCachedDataset(cache_path, source, ragged=RAGGED, check_finite=True) as ds:
        with pytest.raises(ValueError, match=r"sample 13, field 'boxes': contains NaN"):
            ds.__getitems__(list(range(8, 24)))
        assert all(ds.is_cached(i) for i in range(8, 13)) and not any(ds.is_cached(i) for i in range(13, 24))
        assert len(ds.__getitems__(list(range(24, 40)))) == 16
        assert all(ds.is_cached(i) for i in range(24, 40))
