"""``store_as``: ragged fields stored narrower than the source gave them (token ids in int32 or uint16, floats in
float16) or, for a field of ones, as their shapes alone; read back exactly as the source's values by every path, in
the source's dtype; a value that does not fit refused naming it, nothing stored; the cache recorded as format 3."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from helpers.text_sources import Tokenized, expected_padded, same
from mmapcache import (
    CacheFormatError,
    CacheMismatchError,
    LayoutError,
    Mixture,
    MmapCachedDataset,
    TextCollate,
    describe,
    verify,
)

N = 40
NARROW = {"input_ids": "int32", "attention_mask": "ones"}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


class Mixed(torch.utils.data.Dataset):
    """Every kind store_as takes: int64 ids near int32's limits, uint16-sized ids as a numpy array, a list of
    numbers, float32 values exact in float16, and a 2-D int64 value of varying shape; an all-ones mask."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        length = 1 + (i * 7) % 13
        edge = np.iinfo(np.int32)
        ids = torch.tensor([edge.min if i % 2 else edge.max] + [i * 1000 + k for k in range(length - 1)])
        return {
            "ids": ids,
            "small": np.arange(length, dtype=np.int64) % 65536 + i,
            "listed": [i, -i, 3] * (1 + i % 3),
            "half": torch.arange(length, dtype=torch.float32) / 4 - 2,
            "boxes": torch.arange(2 * length, dtype=torch.int64).reshape(length, 2) - i,
            "mask": torch.ones(length, dtype=torch.int64),
            "empty": torch.ones(i % 2, dtype=torch.bool),
        }


MIXED_AS = {"ids": "int32", "small": "uint16", "listed": "int8", "half": "float16", "boxes": "int16",
            "mask": "ones", "empty": "ones"}


@pytest.mark.parametrize("workers", [0, 2])
def test_every_kind_reads_back_exactly_in_the_sources_dtype(cache_path: str, workers: int) -> None:
    source = Mixed()
    ds = MmapCachedDataset(cache_path, source, store_as=MIXED_AS)
    for i in range(N):  # cold: computed, checked, stored narrowed, returned as computed
        assert _equal(ds[i], source[i]), i
    fresh = MmapCachedDataset(cache_path, source)  # warm, in a process's other opener
    for i in range(N):
        assert _equal(fresh[i], source[i]), i
    seen = 0
    for batch in fresh.loader(batch_size=8, num_workers=workers, collate_fn=list):
        for sample in batch:
            assert _equal(sample, source[_index_of(sample)])
            seen += 1
    assert seen == N
    meta = _meta(cache_path)
    assert meta["format_version"] == 3
    stored = {f["name"]: f.get("stored") or f.get("ones") for f in meta["fields"]}
    assert stored == {"ids": "<i4", "small": "<u2", "listed": "|i1", "half": "<f2", "boxes": "<i2", "mask": True,
                      "empty": True}
    result = verify(cache_path, source)
    assert result.ok and result.compared == N, result
    ds.close()
    fresh.close()


def _meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def _index_of(sample: dict[str, Any]) -> int:
    return int(sample["listed"][0])  # (sample i's list starts with i)


def test_narrowed_values_take_their_width_in_the_heap_and_ones_take_none(tmp_path: Any) -> None:
    source = Tokenized(N, longest=60)
    wide = MmapCachedDataset(str(tmp_path / "wide"), source)
    narrow = MmapCachedDataset(str(tmp_path / "narrow"), source, store_as=NARROW)
    wide.fill()
    narrow.fill()
    tokens = int(source.lengths.sum())
    used = {name: {f["name"]: f["heap"]["used"] for f in describe(str(tmp_path / name))["fields"] if f["heap"]}
            for name in ("wide", "narrow")}
    assert used["wide"]["input_ids"] == 8 * tokens and used["wide"]["attention_mask"] == 8 * tokens
    assert used["narrow"]["input_ids"] == 4 * tokens and used["narrow"]["attention_mask"] == 0
    assert os.path.getsize(tmp_path / "narrow" / "attention_mask.heap") == 0
    elements = {f["name"]: f["elements"] for f in describe(str(tmp_path / "narrow"))["fields"] if f["heap"]}
    assert elements["input_ids"] == elements["attention_mask"] == tokens
    for i in range(N):
        assert same(narrow[i], source[i]), i
    wide.close()
    narrow.close()


@pytest.mark.parametrize("state", ["warm", "cold"])
@pytest.mark.parametrize("flatten", [False, True])
def test_text_batches_from_a_narrowed_cache_equal_the_sources(cache_path: str, state: str, flatten: bool) -> None:
    """TextCollate's fused path widens as it copies (warm), its checked path from the gathered columns (cold); a
    mask stored as ones and padded as any field (attention_mask=None) too."""
    source = Tokenized(N)
    ds = MmapCachedDataset(cache_path, source, store_as=NARROW)
    if state == "warm":
        ds.fill()
    plain = TextCollate({"input_ids": 0}, flatten=flatten)
    for batch, reference in zip(ds.loader(batch_size=8, collate_fn=plain), torch.utils.data.DataLoader(
            source, batch_size=8, collate_fn=plain)):
        assert same(batch, reference)
        if not flatten:
            assert same(batch, expected_padded([source[int(r[0]) // 1000] for r in batch["input_ids"]]))
    as_stored = TextCollate({"input_ids": 0, "attention_mask": 0}, attention_mask=None)
    for batch, reference in zip(ds.loader(batch_size=8, collate_fn=as_stored), torch.utils.data.DataLoader(
            source, batch_size=8, collate_fn=as_stored)):
        assert same(batch, reference)
    ds.close()


def test_a_value_that_does_not_fit_is_refused_naming_it_and_nothing_is_stored(cache_path: str) -> None:
    class Wide(Tokenized):
        def __getitem__(self, i: int) -> dict[str, Any]:
            sample = super().__getitem__(i)
            if i == 5:
                sample["input_ids"][-1] = 2 ** 31  # one past int32
            if i == 6:
                sample["attention_mask"][0] = 0  # a padded mask: not all ones
            return sample

    source = Wide(N)
    ds = MmapCachedDataset(cache_path, source, store_as=NARROW)
    with pytest.raises(LayoutError, match=r"sample 5, field 'input_ids': the value 2147483648 does not fit int32 "
                                          r"\(store_as; -2147483648\.\.2147483647\): store the field as a wider type"):
        ds[5]
    with pytest.raises(LayoutError, match=r"sample 6, field 'attention_mask': store_as='ones' keeps only values "
                                          r"that are all ones, and this one holds 0 at position 0"):
        ds[6]
    with pytest.raises(LayoutError, match="sample 5"):
        ds.fill()
    assert not ds.is_cached(5) and not ds.is_cached(6)
    rest = [i for i in range(N) if i not in (5, 6)]
    ds.fill(rest)
    assert ds.num_cached == N - 2
    for i in rest:
        assert same(ds[i], source[i]), i
    ds.close()


def test_a_float_that_float16_would_round_is_refused(cache_path: str) -> None:
    class Halves(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"x": torch.tensor([0.5, 0.1 if i == 2 else 0.25, -2.0][: 1 + i % 3], dtype=torch.float32)}

    ds = MmapCachedDataset(cache_path, Halves(), store_as={"x": "float16"})
    assert _equal(ds[1], Halves()[1]) and _equal(ds[3], Halves()[3])
    with pytest.raises(LayoutError, match=r"sample 2, field 'x': the value 0\.1\d* is not exactly a float16 "
                                          r"\(store_as would round it\)"):
        ds[2]
    assert not ds.is_cached(2)
    ds.close()


def test_a_nan_is_stored_bit_for_bit_or_refused(cache_path: str) -> None:
    """Found by review: float32 -> float16 widened a NaN made by arithmetic (inf - inf: sign bit set) without its sign
    in ``ds[i]`` (torch's conversion; batches kept it), and a NaN whose payload float16 cannot hold was accepted
    (compared with equal_nan), then read back as another NaN, so that every reopen called the source changed."""
    class Nans(torch.utils.data.Dataset):
        def __init__(self, payload: bool) -> None:
            self.payload = payload

        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict[str, Any]:
            bits = [0x3F000000, 0x7FC00001 if self.payload and i == 3 else 0xFFC00000][: 1 + i % 2]
            return {"x": torch.from_numpy(np.array(bits, np.uint32).view(np.float32).copy())}

    def bits(t: torch.Tensor) -> list[int]:
        return t.numpy().view(np.uint32).tolist()

    source = Nans(False)
    with MmapCachedDataset(cache_path, source, store_as={"x": "float16"}) as ds:
        assert [bits(ds[i]["x"]) for i in range(4)] == [bits(source[i]["x"]) for i in range(4)]  # cold
        assert [bits(ds[i]["x"]) for i in range(4)] == [bits(source[i]["x"]) for i in range(4)]  # warm
        batch = next(iter(ds.loader(batch_size=4, collate_fn=TextCollate(fields=["x"]))))
        assert bits(batch["x"][1])[:2] == [0x3F000000, 0xFFC00000]
    assert verify(cache_path, source).ok
    MmapCachedDataset(cache_path, source).close()  # (the same source: not refused as changed)
    with MmapCachedDataset(cache_path + "-payload", Nans(True), store_as={"x": "float16"}) as ds:
        with pytest.raises(LayoutError, match=r"sample 3, field 'x': the NaN 0x7fc00001 \(its payload\) is not "
                                              r"exactly a float16"):
            ds[3]
        assert not ds.is_cached(3) and bits(ds[1]["x"]) == [0x3F000000, 0xFFC00000]


@pytest.mark.parametrize("store_as, message", [
    ({"nope": "int32"}, r"store_as names unknown field\(s\) \['nope'\]; the sample's fields are 'input_ids', "),
    ({"label": "int8"}, r"store_as names field 'label', of kind int: it narrows the values of tensors, arrays, "),
    ({"text": "int8"}, r"store_as names field 'text', of kind str"),
    ({"input_ids": "int64"}, r"field 'input_ids' holds int64, and int64 is not a narrower type of its kind"),
    ({"input_ids": "float16"}, r"and float16 is not a narrower type of its kind"),
    ({"input_ids": "tokens"}, r"store_as=\{'input_ids': 'tokens'\}: not a numpy dtype name"),
])
def test_options_it_cannot_honour_are_refused_before_anything_is_created(cache_path: str, store_as: dict[str, str],
                                                                         message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        MmapCachedDataset(cache_path, Tokenized(N), store_as=store_as)
    assert not os.path.exists(cache_path)


@pytest.mark.parametrize("options", [{"store_as": {"s": "int16"}}, {"store_as": {"s": "ones"}},
                                     {"ragged": ["s", "ids"]}])
def test_a_0_dim_tensor_is_refused_as_ragged_or_narrowed_before_anything_is_created(cache_path: str,
                                                                                    options: dict[str, Any]) -> None:
    """Found by review: a 0-dim tensor named in store_as (or ragged=) was accepted, and every read of it then said
    the cache was damaged."""
    samples = [{"s": torch.tensor(1), "ids": torch.arange(i + 1)} for i in range(4)]
    with pytest.raises(LayoutError, match=r"field 's' is a 0-dim tensor \(one number a sample\): only values with "
                                          r"dimensions are stored ragged or narrowed"):
        MmapCachedDataset(cache_path, samples, **options)
    assert not os.path.exists(cache_path)


def test_a_dtype_name_of_the_other_byte_order_is_stored_in_this_machines(cache_path: str) -> None:
    """Found by review: store_as={"input_ids": ">i4"} was stored as big-endian, and ds[i] then called the cache
    damaged (torch takes no other byte order)."""
    source = Tokenized(N)
    with MmapCachedDataset(cache_path, source, store_as={"input_ids": ">i4", "attention_mask": "ones"}) as ds:
        ds.fill()
        assert all(same(ds[i], source[i]) for i in range(N))
        assert describe(cache_path)["fields"][0]["stored"] == "int32"
    MmapCachedDataset(cache_path, source, store_as=NARROW).close()  # (the same storage: not refused)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_index_the_cache_never_stores_is_served_whatever_store_as_holds(cache_path: str, workers: int) -> None:
    """A partial cache (cache_indices): a value past the narrowed type at an index it never stores is served as the
    source gives it, in a batch as by ``ds[i]``; found by review, batches refused it as if it were to be stored."""
    class Wide(Tokenized):
        def __getitem__(self, i: int) -> dict[str, Any]:
            sample = super().__getitem__(i)
            if i % 2:
                sample["input_ids"][0] = 2 ** 40
            return sample

    source = Wide(16)
    with MmapCachedDataset(cache_path, source, store_as=NARROW, cache_indices=range(0, 16, 2)) as ds:
        assert same(ds[3], source[3])
        got = list(ds.loader(batch_size=4, num_workers=workers, collate_fn=TextCollate(0)))
        assert all(same(batch, TextCollate(0)([source[i] for i in range(k, k + 4)]))
                   for batch, k in zip(got, range(0, 16, 4)))
        assert same(ds.read_batch([1, 2, 3], pad=TextCollate(0)), TextCollate(0)([source[i] for i in (1, 2, 3)]))
        assert ds.num_cached == 8


def test_a_bfloat16_field_and_max_shapes_are_refused(cache_path: str) -> None:
    class Bf(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"x": torch.ones(1 + i, dtype=torch.bfloat16)}

    with pytest.raises(LayoutError, match="holds bfloat16, which numpy has no type for"):
        MmapCachedDataset(cache_path, Bf(), store_as={"x": "uint8"})
    # Found by a review: all ones were refused as "16256 at position 0" (1.0's bits); storing them as ones would have
    # read back 1 as bits (a tiny bfloat16), so it is refused as clearly as a narrower type.
    with pytest.raises(LayoutError, match=r"'ones'}: field 'x' holds bfloat16, which numpy has no type for"):
        MmapCachedDataset(cache_path, Bf(), store_as={"x": "ones"})
    assert not os.path.exists(cache_path)
    with pytest.raises(LayoutError, match=r"named in both max_shapes and store_as"):
        MmapCachedDataset(cache_path, Bf(), store_as={"x": "ones"}, max_shapes={"x": [3]})
    with pytest.raises(TypeError, match=r"store_as must be a dict of field path -> a narrower dtype name or 'ones'"):
        MmapCachedDataset(cache_path, Bf(), store_as=["x"])  # type: ignore[arg-type]


def test_an_opener_that_asks_for_another_storage_is_refused(cache_path: str) -> None:
    source = Tokenized(N)
    MmapCachedDataset(cache_path, source, store_as=NARROW).close()
    MmapCachedDataset(cache_path, source).close()  # without store_as: the cache's
    MmapCachedDataset(cache_path, source, store_as={"input_ids": "<i4", "attention_mask": "ones"}).close()
    with pytest.raises(CacheMismatchError, match=r"store_as \{'input_ids': 'int32', 'attention_mask': 'ones'\} in "
                                                  r"the cache, \{'input_ids': 'int16'\} given"):
        MmapCachedDataset(cache_path, source, store_as={"input_ids": "int16"})


def test_only_a_narrowed_cache_is_format_3_and_a_format_2_cache_that_claims_it_is_damaged(tmp_path: Any) -> None:
    source = Tokenized(N)
    plain, narrow = str(tmp_path / "plain"), str(tmp_path / "narrow")
    MmapCachedDataset(plain, source).close()
    MmapCachedDataset(narrow, source, store_as=NARROW).close()
    assert _meta(plain)["format_version"] == 2  # readers of 0.5 read it
    meta_path = os.path.join(narrow, "meta.json")
    meta = _meta(narrow)
    meta["format_version"] = 2
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(CacheFormatError, match=r"field 'input_ids' is stored narrowed \('stored'/'ones'\), which "
                                               r"format 3 introduced, in a cache of format 2"):
        MmapCachedDataset(narrow, source)


def test_verify_finds_an_index_row_of_a_ones_field_that_claims_bytes(cache_path: str) -> None:
    source = Tokenized(N)
    with MmapCachedDataset(cache_path, source, store_as=NARROW) as ds:
        ds.fill()
    index = np.load(os.path.join(cache_path, "attention_mask.index.npy"), mmap_mode="r+")
    index[3, 1] = 8
    index.flush()
    del index
    result = verify(cache_path, source)
    assert not result.ok
    assert any("row 3 holds [offset, extent, *shape]" in p for p in result.problems), result.problems


def test_verify_reports_a_source_value_that_the_narrowed_type_cannot_hold(cache_path: str) -> None:
    """Found by review: a source whose value no longer fits (2**32 + 17 would wrap to the stored 17's bits) was
    counted as differing but verify said ok (its differences grouped only changes of layout)."""
    class Changed(Tokenized):
        def __init__(self, n: int, index: int, field: str, value: int) -> None:
            super().__init__(n)
            self.index, self.field, self.value = index, field, value

        def __getitem__(self, i: int) -> dict[str, Any]:
            sample = super().__getitem__(i)
            if i == self.index:
                sample[self.field][-1] = self.value
            return sample

    with MmapCachedDataset(cache_path, Tokenized(N), store_as=NARROW) as ds:
        ds.fill()
    assert verify(cache_path, Tokenized(N)).ok
    for field, value, message in (("input_ids", 2 ** 32 + 17, r"the value 4294967313 does not fit int32"),
                                  ("attention_mask", 2, r"keeps only values that are all ones")):
        result = verify(cache_path, Changed(N, 17, field, value))
        assert not result.ok and result.differing == 1, (field, result)
        assert len(result.differences) == 1 and re.match(rf"sample 17, field '{field}': .*{message}",
                                                          result.differences[0]), result.differences


def test_rewrites_and_a_mixture_with_an_unnarrowed_source_read_the_same_values(tmp_path: Any) -> None:
    """A refresh rewrites rows in place (the owned-row path); a mixture joins a narrowed and a plain source's
    values into one batch."""
    source = Tokenized(N)
    narrow = str(tmp_path / "narrow")
    subprocess.run([sys.executable, "-m", "mmapcache", "build", narrow, "--dataset",
                    "helpers.text_sources:Tokenized", "--kwargs", json.dumps({"n": N}), "--workers", "2",
                    "--store-as", "input_ids=int32,attention_mask=ones"],
                   check=True, capture_output=True, cwd=os.path.dirname(__file__),
                   env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)})
    subprocess.run([sys.executable, "-m", "mmapcache", "build", narrow, "--dataset",
                    "helpers.text_sources:Tokenized", "--kwargs", json.dumps({"n": N}), "--refresh", "1"],
                   check=True, capture_output=True, cwd=os.path.dirname(__file__),
                   env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)})
    a = MmapCachedDataset(narrow, source, store_as=NARROW)
    assert a.num_cached == N
    for i in range(N):
        assert same(a[i], source[i])
    b = MmapCachedDataset(str(tmp_path / "plain"), Tokenized(N, seed=1))
    b.fill()
    mixture = Mixture([a, b], counts=[N, N], seed=3)
    for collate in (TextCollate({"input_ids": 0}), TextCollate(flatten=True)):  # (flat: each part widened at once)
        for batch, sources in mixture.loader(batch_size=16, collate_fn=collate, return_source=True):
            firsts = batch["input_ids"][:, 0] if not collate.flatten else batch["input_ids"][0, batch[
                "cu_seq_lens_q"][:-1].long()]
            samples = [(source if s == 0 else Tokenized(N, seed=1))[int(first) // 1000]
                       for first, s in zip(firsts, sources.tolist())]
            assert same(batch, collate(samples))
    a.close()
    b.close()


def test_inspect_and_the_cli_say_how_a_field_is_stored(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Tokenized(N), store_as=NARROW) as ds:
        ds.fill()
    out = subprocess.run([sys.executable, "-m", "mmapcache", "inspect", cache_path], capture_output=True, text=True,
                         check=True).stdout
    assert "input_ids: tensor int64 * (ragged: stored as int32; " in out
    assert "attention_mask: tensor int64 * (ragged: all ones, only shapes stored; " in out
    bad = subprocess.run([sys.executable, "-m", "mmapcache", "build", cache_path + "2", "--dataset",
                          "helpers.text_sources:Tokenized", "--store-as", "input_ids"], capture_output=True,
                         text=True, cwd=os.path.dirname(__file__))
    assert bad.returncode == 2 and "--store-as takes field=type pairs separated by commas" in bad.stderr


def test_a_stream_stores_narrowed_values_its_producers_computed(cache_path: str) -> None:
    source = Tokenized(120)
    ds = MmapCachedDataset(cache_path, source, stream=True, store_as=NARROW, max_bytes="1M")
    producer = ds.produce(workers=1)
    collate = TextCollate({"input_ids": 0})
    try:
        for epoch in range(2):
            ds.set_epoch(epoch)
            seen = []
            for batch in ds.loader(batch_size=16, collate_fn=collate):
                indices = [int(row[0]) // 1000 for row in batch["input_ids"]]
                assert same(batch, collate([source[i] for i in indices]))
                seen += indices
            assert sorted(seen) == list(range(120))
    finally:
        producer.stop()
        ds.close()


def test_a_mixture_reads_a_narrowed_sources_values_in_the_fields_dtype_whatever_the_batch_holds(
        tmp_path: Any) -> None:
    """Batches of lists (no padding): a batch holding only the narrowed source's part is split as the first,
    plain source's field, whose dtype it must come back in (its int32 values were once viewed as int64)."""
    plain_source, narrow_source = Tokenized(4), Tokenized(N, seed=2)
    plain = MmapCachedDataset(str(tmp_path / "plain"), plain_source)
    narrow = MmapCachedDataset(str(tmp_path / "narrow"), narrow_source, store_as=NARROW)
    plain.fill()
    narrow.fill()
    for warm in (True, False):
        if not warm:
            narrow.refresh(fraction=1.0)  # stale: read through the checked gather, computed again
        seen = 0
        for batch, sources in Mixture([plain, narrow], counts=[1, N], seed=5).loader(batch_size=3,
                                                                                    return_source=True):
            for k, s in enumerate(sources.tolist()):
                ids = batch["input_ids"][k]
                expected = (plain_source if s == 0 else narrow_source)[int(ids[0]) // 1000]["input_ids"]
                assert ids.dtype == torch.int64 and torch.equal(ids, expected)
                seen += 1
        assert seen == N + 1
    plain.close()
    narrow.close()


def test_a_first_sample_with_an_empty_list_of_ids_is_narrowed_as_its_probes_say(cache_path: str) -> None:
    """Hugging Face's default format gives token ids as lists; an empty one first has no dtype of its own (numpy
    makes it float64): store_as was refused as 'holds float64' before the probes were read."""

    class Lists(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 30

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": [i * 100 + k for k in range(i % 5)], "label": i}

    ds = MmapCachedDataset(cache_path, Lists(), store_as={"input_ids": "int32"})
    ds.fill()
    for i in range(30):
        assert ds[i] == Lists()[i]
    assert _meta(cache_path)["fields"][0]["stored"] == "<i4"
    ds.close()


def test_store_as_empty_asks_for_a_plain_cache(cache_path: str) -> None:
    """Without store_as an opener reads a narrowed cache as it is; with store_as={} it asks for no field narrowed:
    refused, or with overwrite=True made anew plain."""
    source = Tokenized(N)
    MmapCachedDataset(cache_path, source, store_as=NARROW).close()
    MmapCachedDataset(cache_path, source, overwrite=True).close()  # (kept: nothing asked of its storage)
    assert _meta(cache_path)["format_version"] == 3
    with pytest.raises(CacheMismatchError, match=r"store_as \{'input_ids': 'int32', 'attention_mask': 'ones'\} in "
                                                  r"the cache, \{\} given"):
        MmapCachedDataset(cache_path, source, store_as={})
    with MmapCachedDataset(cache_path, source, store_as={}, overwrite=True) as ds:
        assert _meta(cache_path)["format_version"] == 2
        assert same(ds[3], source[3])
