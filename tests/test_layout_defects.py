"""Layout defects: samples the layout must refuse clearly, and values that must come back as the types a hit gives.

Each test here failed before its fix (see the commit that added it).
"""

from __future__ import annotations

import collections
import enum
import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from helpers.sources import sample_equal
from mmapcache import CacheFormatError, LayoutError, MmapCachedDataset
from mmapcache.format.layout import MAX_DEPTH, Layout, describe_structure, fold
from mmapcache.read.reader import RowReader
from mmapcache.store.store import Store


class Samples(Dataset):
    """A map-style dataset over ``make(index)``; picklable only when ``make`` is (tests here stay in-process)."""

    def __init__(self, make: Callable[[int], Any], n: int = 8) -> None:
        self.make, self.n = make, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return self.make(index)




def _nest(levels: int, inner: Any) -> Any:
    for _ in range(levels):
        inner = [inner]
    return inner


# --- samples without fields --------------------------------------------------------------------------------------


@pytest.mark.parametrize("sample", [{}, (), [], {"a": ()}, ((), {})], ids=repr)
def test_sample_without_fields_is_refused_as_a_layout_error(untouched: Any, cache_path: str, sample: Any) -> None:
    # Before: a CacheFormatError about the meta.json of a temporary directory ("no fields").
    untouched(LayoutError, r"sample 0: a sample needs at least one field .*return at least one value",
              lambda: MmapCachedDataset(cache_path, Samples(lambda i: sample)))


def test_empty_containers_beside_a_field_are_kept(cache_path: str) -> None:
    sample = {"x": torch.arange(3), "none": (), "nothing": {}}
    with MmapCachedDataset(cache_path, Samples(lambda i: sample)) as ds:
        ds[0]
        assert sample_equal(ds[0], sample)


# --- nesting depth -----------------------------------------------------------------------------------------------


def test_nesting_at_the_limit_round_trips(cache_path: str) -> None:
    sample = _nest(MAX_DEPTH, torch.tensor([1, 2], dtype=torch.int16))
    with MmapCachedDataset(cache_path, Samples(lambda i: sample)) as ds:
        ds[0]
        assert sample_equal(ds[0], sample)


@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 600, 5000])
def test_nesting_deeper_than_the_limit_is_refused(untouched: Any, cache_path: str, levels: int) -> None:
    # Before: RecursionError (600 levels and more), or a cache whose structure meta.json could not describe.
    untouched(LayoutError, rf"sample 0: field '0[.0]*': containers nested deeper than {MAX_DEPTH} levels",
              lambda: MmapCachedDataset(cache_path, Samples(lambda i: _nest(levels, 1))))


def test_a_list_that_contains_itself_is_refused(untouched: Any, cache_path: str) -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    untouched(LayoutError, rf"nested deeper than {MAX_DEPTH} levels",
              lambda: MmapCachedDataset(cache_path, Samples(lambda i: loop)))


def test_a_later_sample_nested_too_deep_names_its_index(cache_path: str) -> None:
    # The compiled checker meets a list where a leaf was; the slow path must refuse, not overflow the stack.
    with MmapCachedDataset(cache_path, Samples(lambda i: (1, _nest(2000, 1) if i == 3 else 2))) as ds:
        ds[0]
        deeper = rf"sample 3: field '1\.0\.0[.0]*': containers nested deeper than {MAX_DEPTH}"
        with pytest.raises(LayoutError, match=deeper):
            ds[3]


def test_meta_json_nesting_deeper_than_the_limit_is_a_format_error(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Samples(lambda i: torch.zeros(2))) as ds:
        ds[0]
    meta_path = os.path.join(cache_path, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["structure"] = _nest_structure(MAX_DEPTH + 1, meta["structure"])
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(CacheFormatError, match=rf"malformed .*deeper than {MAX_DEPTH} levels"):
        MmapCachedDataset(cache_path)


def _nest_structure(levels: int, node: Any) -> Any:
    for _ in range(levels):
        node = {"list": [node]}
    return node


# --- quantized and sparse tensors --------------------------------------------------------------------------------


def test_quantized_tensor_is_told_to_dequantize(untouched: Any, cache_path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates creating quantized tensors; the user's source still may
        quantized = torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.quint8)
    # Before: "torch.strided tensor cannot be cached; convert it with .to_dense()" (which keeps it quantized).
    untouched(LayoutError, r"field '<sample>': quantized \(torch\.quint8\) tensor cannot be cached; convert it with "
                           r"\.dequantize\(\)", lambda: MmapCachedDataset(cache_path, [quantized]))


def test_sparse_tensor_is_still_told_to_densify(untouched: Any, cache_path: str) -> None:
    untouched(LayoutError, r"torch\.sparse_coo tensor cannot be cached; convert it with \.to_dense\(\)",
              lambda: MmapCachedDataset(cache_path, [torch.zeros(2, 2).to_sparse()]))


# --- two leaves with one field path ------------------------------------------------------------------------------


@pytest.mark.parametrize("sample, first, second", [
    ({"a.b": torch.zeros(2), "a": {"b": torch.zeros(3)}}, r"sample\['a\.b'\]", r"sample\['a'\]\['b'\]"),
    ({"a": {"b": torch.zeros(3)}, "a.b": torch.zeros(2)}, r"sample\['a'\]\['b'\]", r"sample\['a\.b'\]"),
    ({"x": [torch.zeros(1), "b"], "x.1": 3}, r"sample\['x'\]\[1\]", r"sample\['x\.1'\]"),
    ((1, {"0.a": 2, "0": {"a": 3}}), r"sample\[1\]\['0\.a'\]", r"sample\[1\]\['0'\]\['a'\]"),
], ids=["key-first", "nested-first", "list-position", "inside-a-tuple"])
def test_two_fields_with_one_path_are_refused(untouched: Any, cache_path: str, sample: Any, first: str,
                                              second: str) -> None:
    # Before: both fields were named alike, and max_shapes could only ever reach the first of them.
    untouched(LayoutError, rf"two fields have the same path '.*': {first} and {second} .*rename a key",
              lambda: MmapCachedDataset(cache_path, Samples(lambda i: sample)))


def test_a_dotted_key_without_a_collision_round_trips(cache_path: str) -> None:
    sample = {"a.b": torch.zeros(2), "a": {"c": torch.ones(3)}}
    with MmapCachedDataset(cache_path, Samples(lambda i: sample), max_shapes={"a.b": (4,)}) as ds:
        ds[0]
        assert sample_equal(ds[0], sample)


# --- 0-d arrays through __getitems__ -----------------------------------------------------------------------------


def test_zero_dim_ndarray_comes_back_as_an_ndarray_from_a_batch(cache_path: str) -> None:
    source = Samples(lambda i: (np.array(i * 0.5), np.float32(i), i))
    with MmapCachedDataset(cache_path, source) as ds:
        for i in range(len(ds)):
            ds[i]
        expected = [ds[i] for i in range(4)]
        assert type(expected[1][0]) is np.ndarray and expected[1][0].ndim == 0
        # Before: numpy.float64 scalars in place of the 0-d arrays.
        got = ds.__getitems__([0, 1, 2, 3])
        assert all(sample_equal(g, e) for g, e in zip(got, expected))
        batches = list(DataLoader(ds, batch_size=4, collate_fn=list))  # the fetcher that calls __getitems__
        assert all(sample_equal(g, e) for g, e in zip(batches[0], expected))


# --- an unsupported leaf at a later index ------------------------------------------------------------------------


@pytest.mark.parametrize("bad, name", [(None, "NoneType"), ({1, 2}, "set")])
def test_unsupported_leaf_at_a_later_index_names_the_index(cache_path: str, bad: Any, name: str) -> None:
    with MmapCachedDataset(cache_path, Samples(lambda i: (torch.zeros(2) if i != 5 else bad, i))) as ds:
        ds[0]
        # Before: "field '0': unsupported leaf type ..." without the index.
        with pytest.raises(LayoutError, match=rf"^sample 5: field '0': unsupported leaf type builtins\.{name}"):
            ds[5]


def test_check_names_the_index_of_an_unsupported_leaf() -> None:
    layout = Layout.from_sample({"x": 1})
    with pytest.raises(LayoutError, match=r"^sample 7: field 'x': unsupported leaf type builtins\.object"):
        layout.check({"x": object()}, 7)


# --- a miss returns what a hit returns ---------------------------------------------------------------------------


class Label(enum.IntEnum):
    CAT = 3
    DOG = 4


Record = collections.namedtuple("Record", ["weight", "grad", "label", "flag", "score", "plain", "half", "cell"])


def _record(index: int) -> Record:
    return Record(
        weight=torch.nn.Parameter(torch.full((2, 3), float(index))),
        grad=torch.arange(4.0, requires_grad=True) * index,
        label=Label.CAT if index % 2 else Label.DOG,
        flag=bool(index % 3),
        score=np.float64(index / 4),
        plain=torch.arange(5, dtype=torch.int32) + index,
        half=torch.full((3,), index / 8, dtype=torch.bfloat16),
        cell=np.array(index, dtype=np.int16),
    )


def test_sample_from_values_returns_what_a_hit_returns(cache_path: str) -> None:
    source = Samples(_record)
    with MmapCachedDataset(cache_path, source) as ds:
        hits = {i: (ds[i], ds[i])[1] for i in range(4)}  # the second access reads the stored row
    store = Store(cache_path, writable=False)
    try:
        reader = RowReader(store, recompute_stale=True)
        for i, hit in hits.items():
            sample = source[i]
            miss = reader.sample_from_values(reader.check(sample, i))
            assert sample_equal(miss, hit), (i, miss, hit)
            assert type(miss) is Record
            assert type(miss.weight) is torch.Tensor and not miss.weight.requires_grad
            assert type(miss.grad) is torch.Tensor and not miss.grad.requires_grad
            assert type(miss.label) is int and type(miss.flag) is bool and type(miss.score) is np.float64
            assert type(miss.cell) is np.ndarray and miss.cell.ndim == 0
            assert miss.half.dtype == torch.bfloat16
            # Cheap: a plain tensor is not copied (the hit's converter shares its buffer the same way).
            assert miss.plain.data_ptr() == sample.plain.data_ptr()
    finally:
        store.close()


@pytest.mark.parametrize("sample", [
    (torch.arange(3.0, requires_grad=True), Label.DOG),
    {"p": torch.nn.Parameter(torch.ones(2)), "n": np.int64(7), "f": 1.5, "a": np.arange(3).view(np.matrix)},
    torch.nn.Parameter(torch.zeros(1)),
    Label.CAT,
], ids=["pair", "dict", "bare-parameter", "bare-intenum"])
def test_sample_from_values_for_other_structures(cache_path: str, sample: Any) -> None:
    with MmapCachedDataset(cache_path, Samples(lambda i: sample)) as ds:
        ds[0]
        hit = ds[0]
    store = Store(cache_path, writable=False)
    try:
        reader = RowReader(store, recompute_stale=True)
        assert sample_equal(reader.sample_from_values(reader.check(sample, 0)), hit)
    finally:
        store.close()


# --- the one walker ----------------------------------------------------------------------------------------------


def test_fold_visits_every_kind_of_node_in_field_order() -> None:
    sample = {"a": (1, [2.0, np.int8(3)]), "b": Record(*range(8))}
    layout = Layout.from_sample(sample)
    numbers = fold(layout.structure, leaf=lambda n: [n],
                   sequence=lambda kind, parts, children: [x for p in parts for x in p],
                   mapping=lambda keys, parts, children: [x for p in parts for x in p],
                   record=lambda spec, parts, children: [x for p in parts for x in p])
    assert numbers == list(range(len(layout.fields)))
    assert describe_structure(layout.structure) == (
        "dict(a: tuple(leaf, list(leaf, leaf)), b: Record(weight, grad, label, flag, score, plain, half, cell))")
