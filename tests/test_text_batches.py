"""``TextCollate``: batches a model takes as they come, padded or padding-free, equal to the source's values whatever
path made them (straight from the heaps of a warm cache, from a checked gather of a cold or partial one, from the
samples of any dataset), under workers, ranks, streams, mixtures and a resume at every step; and taken as they come
by a Hugging Face model and its ``Trainer``."""

from __future__ import annotations

import collections
import itertools
import os
from typing import Any

import numpy as np
import pytest
import torch

from helpers import trainer_recipe
from helpers.text_sources import Tokenized, expected_padded, same
from mmapcache import LayoutError, Mixture, MmapCachedDataset, PadCollate, TextCollate

N = 37


def _samples(source: Any, indices: list[int]) -> list[dict[str, Any]]:
    return [source[i] for i in indices]


def _indices(batch: dict[str, Any]) -> list[int]:
    return [int(row[0]) // 1000 for row in batch["input_ids"]]


def _kept(batch: dict[str, Any], columns: list[str] | None) -> dict[str, Any]:
    """``batch`` less the sample fields ``columns`` leaves out (the built mask stays)."""
    return {k: v for k, v in batch.items() if columns is None or k in columns or k in ("attention_mask", "labels")}


@pytest.mark.parametrize("state", ["warm", "cold", "partial"])
@pytest.mark.parametrize("workers", [0, 2])
def test_padded_batches_equal_the_source_whatever_path_made_them(cache_path: str, state: str, workers: int) -> None:
    """Warm: copied from the heaps; cold: computed, stored and gathered with checks; partial (max_bytes): the
    uncached samples from the source: every batch is the plain padding of the source's samples, in order."""
    source = Tokenized(N)
    ds = MmapCachedDataset(cache_path, source, max_bytes=6000 if state == "partial" else None)
    if state == "warm":
        ds.fill()
    collate = TextCollate({"input_ids": 0})
    seen = []
    for batch in ds.loader(batch_size=8, shuffle=True, collate_fn=collate, num_workers=workers):
        indices = _indices(batch)
        assert same(batch, expected_padded(_samples(source, indices))), indices
        seen += indices
    assert sorted(seen) == list(range(N))
    ds.close()


@pytest.mark.parametrize("state", ["warm", "cold", "partial"])
@pytest.mark.parametrize("workers", [0, 2])
def test_columns_keep_only_the_fields_named_whatever_path_made_the_batch(cache_path: str, state: str,
                                                                          workers: int) -> None:
    """``columns`` leaves the other fields out of every batch (the warm path does not read them); a stored mask left
    out is built from the lengths, so the batch is what ``model(**batch)`` takes; padded and flattened batches hold
    the same values as without ``columns``, less the fields left out."""
    source = Tokenized(N)
    ds = MmapCachedDataset(cache_path, source, max_bytes=6000 if state == "partial" else None)
    if state == "warm":
        ds.fill()
    seen = []
    for batch in ds.loader(batch_size=8, shuffle=True, num_workers=workers,
                           collate_fn=TextCollate(columns=["input_ids", "label"])):
        indices = _indices(batch)
        expected = expected_padded(_samples(source, indices))
        del expected["text"]
        assert same(batch, expected), indices
        seen += indices
    assert sorted(seen) == list(range(N))
    flat, flat_all = TextCollate(flatten=True, columns=["input_ids"]), TextCollate(flatten=True)
    for batch in ds.loader(batch_size=8, shuffle=True, num_workers=workers, collate_fn=flat):
        indices = [int(i) for i in torch.unique_consecutive(batch["input_ids"][0] // 1000)]
        expected = flat_all(_samples(source, indices))
        del expected["text"], expected["label"]
        assert same(batch, expected), indices
    ds.close()


def test_columns_name_fields_the_samples_have_and_keep_what_the_collate_pads(cache_path: str) -> None:
    samples = [Tokenized(N)[i] for i in range(4)]
    assert sorted(TextCollate(columns=["input_ids", "attention_mask"], build_mask=False)(samples)) == [
        "attention_mask", "input_ids"]  # (the samples' own mask, padded)
    assert sorted(TextCollate(columns=["text"], fields=[])(samples)) == ["attention_mask", "text"]  # (the mask stays)
    assert sorted(TextCollate(columns=["text"], fields=[], attention_mask=None)(samples)) == ["text"]
    padded = [PrePadded()[i] for i in range(4)]  # (a tokenizer's padding: zeros in the mask, which columns keeps)
    batch = TextCollate(columns=["input_ids"])(padded)
    assert sorted(batch) == ["attention_mask", "input_ids"]
    assert batch["attention_mask"].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert sorted(TextCollate(columns=["input_ids"], attention_mask=None)(samples)) == ["input_ids"]
    with MmapCachedDataset(cache_path, Tokenized(N)) as ds:
        with pytest.raises(ValueError, match=r"TextCollate names \['input_idz'\], which the samples do not have"):
            ds.loader(batch_size=4, collate_fn=TextCollate(columns=["input_idz"]))
        with pytest.raises(ValueError, match=r"names \['input_ids'\] to pad or copy, which its columns=\['text'\] "
                                             "leave out: add them to columns"):
            ds.loader(batch_size=4, collate_fn=TextCollate(columns=["text"], labels="input_ids"))
    with pytest.raises(TypeError, match=r"columns must be a list of field names, got the str 'text'"):
        TextCollate(columns="text")  # type: ignore[arg-type]


def test_a_collate_over_any_dataset_gives_the_same_batches(cache_path: str) -> None:
    source = Tokenized(N)
    collate = TextCollate({"input_ids": 0})
    plain = torch.utils.data.DataLoader(source, batch_size=8, collate_fn=collate)
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        cached = ds.loader(batch_size=8, collate_fn=collate)
        for a, b in zip(plain, cached):
            assert same(a, b)
        for a, b in zip(plain, torch.utils.data.DataLoader(ds, batch_size=8, collate_fn=collate)):
            assert same(a, b)


def test_pad_values_labels_and_a_multiple(cache_path: str) -> None:
    source = Tokenized(N, mask=False)
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        collate = TextCollate({"input_ids": 7}, labels="input_ids", pad_to_multiple_of=8)
        for batch in ds.loader(batch_size=5, collate_fn=collate):
            samples = _samples(source, _indices(batch))
            expected = expected_padded(samples, pad=7, labels=True)
            width = batch["input_ids"].shape[1]
            assert width % 8 == 0 and width - expected["input_ids"].shape[1] < 8
            for key in ("input_ids", "attention_mask", "labels"):
                cut = batch[key][:, :expected[key].shape[1]]
                assert torch.equal(cut, expected[key]), key
                assert bool((batch[key][:, expected[key].shape[1]:] == {"input_ids": 7, "attention_mask": 0,
                                                                          "labels": -100}[key]).all())


def test_a_stored_mask_is_the_batchs_and_build_mask_builds_one(cache_path: str) -> None:
    """The samples' own mask is padded with 0 (its zeros kept: a tokenizer's padding); build_mask=True builds it
    from input_ids' lengths instead (an all-ones stored mask, not read)."""
    source = Tokenized(N)
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        stored = next(iter(ds.loader(batch_size=9, collate_fn=TextCollate())))
        built = next(iter(ds.loader(batch_size=9, collate_fn=TextCollate(build_mask=True))))
        assert torch.equal(built["attention_mask"], stored["attention_mask"])
        assert torch.equal(built["input_ids"], stored["input_ids"])


class PrePadded(torch.utils.data.Dataset):
    """Samples a tokenizer padded in a batched ``map``: ids with pad tokens (0), a mask with zeros on them, seq2seq
    ``labels`` of other lengths, and the labels column first (as when targets are tokenized first)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, Any]:
        real, padded = 1 + i % 4, 4 + (i // 4) * 2
        ids = torch.zeros(padded, dtype=torch.int64)
        ids[:real] = torch.arange(real) + 1000 * i + 1
        mask = torch.zeros(padded, dtype=torch.int64)
        mask[:real] = 1
        return {"labels": torch.full((2 + i % 7,), i), "input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("cached", [False, True])
def test_the_mask_is_the_samples_own_and_each_field_pads_to_its_own_longest(cache_path: str, cached: bool) -> None:
    """A stored mask with zeros keeps them (it was rebuilt from input_ids' lengths: pad tokens attended), a
    ``labels`` column first does not make the mask (it was built from the first padded field), and labels longer
    than input_ids are padded to their own longest with -100 (input_ids were padded to the labels' width)."""
    source = PrePadded()
    collate = TextCollate(pad={"input_ids": 0})
    if cached:
        ds = MmapCachedDataset(cache_path, source, ragged=["labels", "input_ids", "attention_mask"])
        ds.fill()
        batches = list(ds.loader(batch_size=6, collate_fn=collate))
        ds.close()
    else:
        batches = list(torch.utils.data.DataLoader(source, batch_size=6, collate_fn=collate))
    for k, batch in enumerate(batches):
        samples = [source[i] for i in range(6 * k, 6 * k + 6)]
        ids_width = max(len(x["input_ids"]) for x in samples)
        assert batch["input_ids"].shape == batch["attention_mask"].shape == (6, ids_width)
        for row, x in enumerate(samples):
            assert torch.equal(batch["attention_mask"][row, :len(x["attention_mask"])], x["attention_mask"])
            assert not batch["attention_mask"][row, len(x["attention_mask"]):].any()
            assert torch.equal(batch["labels"][row, :len(x["labels"])], x["labels"])
            assert (batch["labels"][row, len(x["labels"]):] == -100).all()
        assert batch["labels"].shape[1] == max(len(x["labels"]) for x in samples)


@pytest.mark.parametrize("state", ["samples", "warm", "cold"])
@pytest.mark.parametrize("fields", [None, ["input_ids", "labels"]])
def test_the_samples_mask_is_padded_with_0_whatever_the_pad_id(cache_path: str, state: str,
                                                                fields: list[str] | None) -> None:
    """``pad=`` a tokenizer's pad id (an int: every field's) pads the ids, never the samples' mask: it was padded
    with the pad id (a mask of 7s, or of 50256s, attends to the padding), and with ``fields`` that left the mask
    out, it was not padded at all (a list on the cache paths, a stack error over samples)."""
    source = PrePadded()
    collate = TextCollate(pad=7, fields=fields)
    if state == "samples":
        batches = list(torch.utils.data.DataLoader(source, batch_size=6, collate_fn=collate))
    else:
        ds = MmapCachedDataset(cache_path, source, ragged=["labels", "input_ids", "attention_mask"])
        if state == "warm":
            ds.fill()
        batches = list(ds.loader(batch_size=6, collate_fn=collate))
        ds.close()
    for k, batch in enumerate(batches):
        samples = [source[i] for i in range(6 * k, 6 * k + 6)]
        mask = batch["attention_mask"]
        assert type(mask) is torch.Tensor and mask.shape == batch["input_ids"].shape
        for row, x in enumerate(samples):
            n = len(x["input_ids"])
            assert torch.equal(mask[row, :n], x["attention_mask"]) and not mask[row, n:].any()
            assert torch.equal(batch["input_ids"][row, :n], x["input_ids"]) and (batch["input_ids"][row, n:] == 7).all()
            assert (batch["labels"][row, len(x["labels"]):] == -100).all()


@pytest.mark.parametrize("name", ["label", "label_ids"])
def test_token_and_multi_hot_labels_come_back_as_labels_padded_with_the_ignore_index(cache_path: str,
                                                                                     name: str) -> None:
    """A ragged ``label``/``label_ids`` (token labels) is padded with -100, not 0 (a class), and a multi-hot
    ``label`` (a vector per sample) is left as it is; both come back as ``labels``, which a model takes."""
    transformers = pytest.importorskip("transformers")
    tokens = [{"input_ids": torch.arange(1 + i % 4) + 1, name: torch.arange(1 + i % 4) % 3} for i in range(8)]
    for batch in (TextCollate()(tokens[:4]), _cached_batch(cache_path + "-tokens", tokens)):
        assert sorted(batch) == ["attention_mask", "input_ids", "labels"]
        assert batch["labels"].tolist() == [[0, -100, -100, -100], [0, 1, -100, -100], [0, 1, 2, -100], [0, 1, 2, 0]]
    hot = [{"input_ids": torch.arange(2 + i) + 1, name: [float(i % 2), 1.0, 0.0]} for i in range(8)]
    for batch in (TextCollate()(hot[:4]), _cached_batch(cache_path + "-hot", hot)):
        assert batch["labels"].tolist() == [[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]] * 2
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16,
                                     vocab_size=64, num_labels=3, problem_type="multi_label_classification")
    batch["labels"] = batch["labels"].float()
    assert torch.isfinite(transformers.BertForSequenceClassification(config)(**batch).loss)


def _cached_batch(path: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The first batch of 4 of ``samples`` read from a filled cache (straight from its heaps)."""
    with MmapCachedDataset(path, samples) as ds:
        ds.fill()
        return next(iter(ds.loader(batch_size=4, collate_fn=TextCollate())))


def test_labels_from_a_field_do_not_replace_the_samples_own(cache_path: str) -> None:
    """Also where ``columns=`` leaves the samples' labels out (the guide's recipe on SFT samples: found by review,
    the prompt tokens were silently trained on), over the samples and from a cache, cold and warm, flat or not."""
    own = [{"input_ids": torch.tensor([5, 6, 7, 8]), "labels": torch.tensor([-100, -100, 7, 8])},
           {"input_ids": torch.tensor([9, 10, 11]), "labels": torch.tensor([-100, 10, 11])}]
    refused = r"labels='input_ids'\) would replace the samples' own 'labels' field.*leave labels= out"
    with MmapCachedDataset(cache_path, own) as ds:
        for flatten, columns in itertools.product((False, True), (None, ["input_ids"])):
            collate = TextCollate(labels="input_ids", columns=columns, flatten=flatten)
            with pytest.raises(ValueError, match=refused):
                collate(own)
            for _state in ("cold", "warm"):
                with pytest.raises(ValueError, match=refused):
                    next(iter(ds.loader(batch_size=2, collate_fn=collate)))
                ds.fill()
    batch = TextCollate(pad=0)(own)  # (their labels padded with -100, not the pad id)
    assert batch["labels"].tolist() == [[-100, -100, 7, 8], [-100, 10, 11, -100]]


@pytest.mark.parametrize("form", ["tensors", "lists", "one length"])
def test_every_batch_has_the_same_keys_whatever_its_lengths(form: str) -> None:
    """What is padded is decided by the fields' types, not by whether a batch's lengths differ: a batch of one
    sample, or of samples of one length, is padded as any other (it was stacked, or lists were transposed, or
    labels= was refused at an epoch's last batch of one sample)."""
    def sample(n: int) -> dict[str, Any]:
        ids = list(range(1, n + 1)) if form == "lists" else torch.arange(1, n + 1)
        return {"input_ids": ids, "label": n}

    collate = TextCollate(labels="input_ids")
    lengths = {"one length": [3, 3, 3], "tensors": [3, 1, 2], "lists": [2, 3, 1]}[form]
    for batch_samples in ([sample(n) for n in lengths], [sample(lengths[0])]):
        batch = collate(batch_samples)
        assert set(batch) == {"input_ids", "attention_mask", "labels", "label"}
        assert batch["input_ids"].shape == (len(batch_samples), max(len(x["input_ids"]) for x in batch_samples))
        assert batch["input_ids"].dtype == torch.int64 and batch["attention_mask"].sum() == sum(
            len(x["input_ids"]) for x in batch_samples)


def test_fixed_length_blocks_are_padded_and_labelled_as_any_tokens(cache_path: str) -> None:
    """run_clm's blocks (every sample 16 tokens, a tensor: stored in fixed rows, not ragged) give labels too."""

    class Blocks(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 20

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": torch.arange(16) + 100 * i, "attention_mask": torch.ones(16, dtype=torch.int64)}

    with MmapCachedDataset(cache_path, Blocks()) as ds:
        ds.fill()
        collate = TextCollate(labels="input_ids")
        for batch in ds.loader(batch_size=8, collate_fn=collate):
            first = batch["input_ids"][:, 0] // 100
            expected = collate([Blocks()[int(i)] for i in first])
            assert same(batch, expected)
            assert torch.equal(batch["labels"], batch["input_ids"]) and batch["attention_mask"].all()


def test_an_empty_list_of_ids_takes_the_batchs_dtype() -> None:
    batch = TextCollate()([{"input_ids": []}, {"input_ids": [5, 6, 7]}])
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].tolist() == [[0, 0, 0], [5, 6, 7]]
    assert batch["attention_mask"].tolist() == [[0, 0, 0], [1, 1, 1]]


def test_flattened_batches_match_hugging_faces_flattening_collator(cache_path: str) -> None:
    transformers = pytest.importorskip("transformers")
    source = Tokenized(N, mask=False)
    reference = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        for workers in (0, 2):
            loader = ds.loader(batch_size=6, shuffle=True, num_workers=workers,
                               collate_fn=TextCollate(flatten=True, labels="input_ids", fields=["input_ids"]))
            for batch in loader:
                indices = [int(i) for i in torch.unique_consecutive(batch["input_ids"][0] // 1000)]
                theirs = reference([{"input_ids": source[i]["input_ids"].tolist()} for i in indices])
                for key, value in theirs.items():
                    assert (torch.equal(batch[key], value) if isinstance(value, torch.Tensor) else
                            batch[key] == value), key
                assert batch["text"] == [source[i]["text"] for i in indices]
                assert torch.equal(batch["label"], torch.tensor([source[i]["label"] for i in indices]))


def test_a_flattened_batch_leaves_empty_samples_out_of_its_boundaries_as_hugging_faces() -> None:
    transformers = pytest.importorskip("transformers")
    samples = [{"input_ids": [5, 6]}, {"input_ids": []}, {"input_ids": [7, 8, 9]}, {"input_ids": []}]
    ours = TextCollate(flatten=True, labels="input_ids")(samples)
    theirs = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(samples)
    for key, value in theirs.items():
        assert (torch.equal(ours[key], value) if isinstance(value, torch.Tensor) else ours[key] == value), key
    own = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    assert TextCollate(flatten=True)(own)["labels"].tolist() == [[-100, 6, 7, -100, 9]]  # each first token masked
    with pytest.raises(ValueError, match="pad_to_multiple_of rounds up padded rows; a flattened batch has no "
                                         "padding"):
        TextCollate(flatten=True, pad_to_multiple_of=8)


def test_a_flattened_batch_starts_positions_where_asked(cache_path: str) -> None:
    """``position_ids_start`` as Hugging Face's flattening collator takes it (RoBERTa-like models: 2), over samples
    and from a cache, cold and warm, with two workers (the positions are shifted in the worker's shared memory)."""
    transformers = pytest.importorskip("transformers")
    samples = [{"input_ids": torch.arange(2 + i) + 5} for i in range(4)]
    theirs = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, position_ids_start=2)(samples)
    collate = TextCollate(flatten=True, labels="input_ids", position_ids_start=2)
    with MmapCachedDataset(cache_path, samples) as ds:
        for _state in ("cold", "warm"):
            for ours in (collate(samples), next(iter(ds.loader(batch_size=4, collate_fn=collate))),
                         next(iter(ds.loader(batch_size=4, collate_fn=collate, num_workers=2)))):
                for key in ("input_ids", "position_ids", "labels", "cu_seq_lens_q"):
                    assert torch.equal(ours[key], theirs[key]), key
            ds.fill()
    with pytest.raises(ValueError, match="position_ids_start is where a flattened batch's positions start"):
        TextCollate(position_ids_start=2)


@pytest.mark.parametrize("flatten", [False, True])
def test_an_empty_tensor_takes_the_other_values_dtype(flatten: bool) -> None:
    """``torch.tensor([])`` is float32: first in a batch of int64 ids it made the batch's ids float32 (review; a
    model's embedding then refuses them). An empty value has no dtype of its own to give."""
    samples = [{"input_ids": torch.tensor([])}, {"input_ids": torch.tensor([5, 6, 7])}]
    ids = TextCollate(flatten=flatten)(samples)["input_ids"]
    assert ids.dtype == torch.int64 and ids.tolist() == ([[5, 6, 7]] if flatten else [[0, 0, 0], [5, 6, 7]])
    ids = TextCollate(flatten=flatten)([samples[0], {"input_ids": [2 ** 60 + 1]}])["input_ids"]  # (a list after it)
    assert ids.dtype == torch.int64 and ids.tolist()[-1][-1] == 2 ** 60 + 1
    padded = PadCollate(0)([samples[0], {"input_ids": torch.tensor([2 ** 60 + 1])}])["input_ids"].data
    assert padded.dtype == torch.int64 and padded.tolist() == [[0], [2 ** 60 + 1]]  # (PadCollate alike)
    empty = TextCollate()([{"score": np.zeros(0, np.float32)}, {"score": np.zeros(0, np.float32)}])["score"]
    assert empty.dtype == torch.float32 and empty.shape == (2, 0)  # (none holds a value: their own dtype)


MIXED_DTYPES = {  # a field whose values differ in dtype: what torch.cat makes of them, the values exact
    "uint8 and int8": ([torch.tensor([200], dtype=torch.uint8), torch.tensor([], dtype=torch.int8),
                        torch.tensor([-1, 5], dtype=torch.int8)], torch.int16),
    "bfloat16 and float16": ([torch.tensor([1.5, 2.0], dtype=torch.bfloat16),
                              torch.tensor([3.25], dtype=torch.float16)], torch.float32),
    "int32 and int64": ([torch.tensor([1], dtype=torch.int32), torch.tensor([2 ** 40 + 1])], torch.int64),
    "int64 and float32": ([torch.tensor([7]), torch.tensor([0.5])], torch.float32),
    "arrays int32 and int64": ([np.array([1], np.int32), np.array([2 ** 40 + 1])], torch.int64),
    "list and int8 array": ([[300, 1], np.array([-1], np.int8)], torch.int64),
    # (review: arrays of the other byte order, as np.load gives a foreign file's, failed in torch after the above)
    "big-endian int32 arrays": ([np.array([1, 2], ">i4"), np.array([-3], ">i4")], torch.int32),
    "big-endian and native": ([np.array([2 ** 20], ">i4"), np.array([-3], np.int16)], torch.int32),
}


@pytest.mark.parametrize("case", sorted(MIXED_DTYPES))
def test_values_of_different_dtypes_are_promoted_as_torch_cat_promotes_them(case: str) -> None:
    """Found by review: a field's values were all given the first one's dtype, so int8's -1 came back as 255 after a
    uint8 value, 2**40 as 0 after an int32 one, 0.5 as 0 after an int64, and float16 values as bfloat16 bits
    (garbage). ``pad_sequence`` wraps the same way; ``torch.cat`` promotes. A cache refuses such a source (one dtype
    a field): this is over samples, as a ``ConcatDataset`` of two tokenized sets gives them."""
    values, promoted = MIXED_DTYPES[case]
    expected = torch.cat([torch.as_tensor(v.astype(v.dtype.newbyteorder("=")) if isinstance(v, np.ndarray) else v)
                          for v in values])  # (torch takes arrays of this machine's byte order only)
    assert expected.dtype == promoted
    lengths = [len(v) for v in values]
    samples = [{"input_ids": v} for v in values]
    padded = TextCollate(0)(samples)["input_ids"]
    assert padded.dtype == promoted
    assert torch.equal(torch.cat([row[:n] for row, n in zip(padded, lengths)]), expected)
    flat = TextCollate(flatten=True)(samples)["input_ids"]
    assert flat.dtype == promoted and torch.equal(flat[0], expected)
    ours = PadCollate(0, fields=["input_ids"])(samples)["input_ids"]
    assert ours.data.dtype == promoted and ours.lengths.tolist() == lengths
    assert torch.equal(torch.cat([row[:n] for row, n in zip(ours.data, lengths)]), expected)


def test_a_flattened_batch_of_no_1_d_tokens_is_refused_on_every_path(cache_path: str) -> None:
    """Found by review: samples of ``(1, n)`` ids (a tokenizer's ``return_tensors="pt"``) gave a "flat" batch of the
    stacked ids with ``cu_seq_lens`` [0] and no positions, which a model then failed on far from the cause."""
    samples = [{"input_ids": torch.arange(3)[None] + 5 + i} for i in range(4)]  # (of other n: refused as (1, n))
    refused = r"finds no 1-D field of numbers to flatten among \['input_ids'\].*return_tensors='pt' gives \(1, n\)"
    with pytest.raises(ValueError, match=refused):
        TextCollate(flatten=True)(samples)
    with MmapCachedDataset(cache_path, samples) as ds:
        for _state in ("cold", "warm"):
            with pytest.raises(ValueError, match=refused):
                next(iter(ds.loader(batch_size=2, collate_fn=TextCollate(flatten=True))))
            ds.fill()


def test_values_of_shape_1_n_are_refused_naming_return_tensors_on_every_path(cache_path: str) -> None:
    """A tokenizer's ``return_tensors="pt"`` per sample gives ``(1, n)`` values. Found by a new user's trial: from a
    cache a padded batch held them as a list (the model failed far from the cause) where over the samples
    default_collate raised, and ``ds.lengths`` said every sample was 1 long, so length grouping did nothing."""
    samples = [{"input_ids": torch.arange(3 + i)[None], "attention_mask": torch.ones(1, 3 + i, dtype=torch.int64)}
               for i in range(8)]
    refused = r"field 'input_ids' holds values of shapes \(1, 3\), \(1, 4\)\.\.\.: a tokenizer's return_tensors="
    with pytest.raises(ValueError, match=refused):
        TextCollate()(samples[:4])
    with pytest.raises(ValueError, match=r"only 1-D values are: a tokenizer's return_tensors='pt' gives \(1, n\)"):
        TextCollate(labels="input_ids")(samples[:4])
    with MmapCachedDataset(cache_path, samples) as ds:
        for workers in (0, 2):
            with pytest.raises(ValueError, match=refused):
                next(iter(ds.loader(batch_size=4, collate_fn=TextCollate(), num_workers=workers)))
            ds.fill()
        with pytest.raises(ValueError, match=r"holds values of shape \(1, n\) .*whose lengths \(first dimension\) are "
                                             r"all 1"):
            ds.lengths("input_ids")
    square = [{"input_ids": torch.arange(4)[None] + i} for i in range(4)]  # (one shape: stacked, as before)
    assert TextCollate()(square)["input_ids"].shape == (4, 1, 4)
    # Only a tokenizer's fields: mono audio (1, T) beside 1-D ids comes back from a cache as a list, as before (a
    # review found it refused, whole epochs of a mono/stereo mix cut short), and its lengths are its first dimension.
    audio = [{"input_ids": torch.arange(3 + i), "audio": torch.rand(1, 100 + i)} for i in range(4)]
    with MmapCachedDataset(cache_path + "-audio", audio) as ds:
        for _state in ("cold", "warm"):
            batch = next(iter(ds.loader(batch_size=4, collate_fn=TextCollate())))
            assert [tuple(a.shape) for a in batch["audio"]] == [(1, 100 + i) for i in range(4)]
            ds.fill()
        assert ds.lengths("audio").tolist() == [1, 1, 1, 1]
    dropped = [{"input_ids": torch.arange(3 + i), "attention_mask": torch.ones(1, 3 + i, dtype=torch.int64)}
               for i in range(4)]  # (a mask the batch drops is not refused: review found it refused over samples)
    assert TextCollate(build_mask=True)(dropped)["attention_mask"].shape == (4, 6)
    assert "attention_mask" not in TextCollate(flatten=True)(dropped)
    transformers = pytest.importorskip("transformers")  # (the tokenizer's output as it is: refused naming dict())
    encoded = [transformers.BatchEncoding({"input_ids": [1, 2, 3 + i]}) for i in range(2)]
    with pytest.raises(LayoutError, match=r"BatchEncoding; a tokenizer's output is stored as a dict: return "
                                          r"dict\(tokenizer\(text\)\)"):
        MmapCachedDataset(cache_path + "-encoded", encoded)


@pytest.mark.parametrize("columns", [None, ["input_ids", "label"]])
def test_ranks_and_a_resume_at_every_step_serve_the_sources_values(cache_path: str, columns: list[str] | None) -> None:
    source = Tokenized(N)
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        collate = TextCollate(columns=columns)
        for rank in range(2):
            loader = ds.loader(batch_size=4, shuffle=True, rank=rank, world_size=2, collate_fn=collate)
            full = [_indices(b) for b in loader]
            for k in range(len(full) + 1):
                ds.set_epoch(0)  # the same epoch again (DistributedSampler's order of (seed, epoch))
                it = iter(loader)
                for _ in range(k):
                    next(it)
                state = loader.state_dict()
                again = ds.loader(batch_size=4, shuffle=True, rank=rank, world_size=2, collate_fn=collate)
                again.load_state_dict(state)
                rest = list(again)
                assert [_indices(b) for b in rest] == full[k:]
                assert all(same(b, _kept(expected_padded(_samples(source, _indices(b))), columns)) for b in rest)


def test_a_mixture_and_a_stream_pad_as_a_cache_does(shm_dir: str) -> None:
    from helpers.stream_sources import Fresh

    sources = {name: Tokenized(20 + 5 * k, seed=k) for k, name in enumerate(("a", "b"))}
    caches = {name: MmapCachedDataset(os.path.join(shm_dir, name), src) for name, src in sources.items()}
    mix = Mixture(caches, seed=1)
    for columns in (None, ["input_ids", "label"], None):  # (cold, then warm: read from the heaps)
        for batch, which in mix.loader(batch_size=6, collate_fn=TextCollate(columns=columns), return_source=True):
            samples = [sources[mix.names[s]][i] for s, i in zip(which.tolist(), _indices(batch))]
            assert same(batch, _kept(expected_padded(samples), columns))

    class Tokens(Fresh):
        def __getitem__(self, index: int) -> Any:
            sample = super().__getitem__(index)
            return {"input_ids": torch.arange(1 + index % 9), "token": sample["token"]}

    with MmapCachedDataset(os.path.join(shm_dir, "stream"), Tokens(40), stream=True, seed=3) as stream:
        for batch in stream.loader(batch_size=5, collate_fn=TextCollate(fields=["input_ids"])):
            lengths = batch["attention_mask"].sum(1)
            for row, length in zip(batch["input_ids"], lengths.tolist()):
                assert torch.equal(row[:length], torch.arange(length)) and not row[length:].any()


def test_bad_arguments_are_refused_naming_the_fix(cache_path: str) -> None:
    with pytest.raises(TypeError, match="pad must be an int, a dict of field name -> int or a tokenizer, got str"):
        TextCollate("zero")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"fields must be a list of field names, got the str 'input_ids'"):
        TextCollate(fields="input_ids")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pad_to_multiple_of must be an int >= 1"):
        TextCollate(pad_to_multiple_of=0)
    with MmapCachedDataset(cache_path, Tokenized(N)) as ds:
        with pytest.raises(ValueError, match=r"TextCollate names \['input_idz'\], which the samples do not have"):
            ds.loader(batch_size=4, collate_fn=TextCollate({"input_idz": 0}))
        with pytest.raises(ValueError, match=r"labels='text'\) must name a padded field"):
            next(iter(ds.loader(batch_size=4, collate_fn=TextCollate(labels="text"))))
    with pytest.raises(TypeError, match="takes samples that are dicts"):
        TextCollate()([(torch.arange(3), 1)])


# --- a real model ---------------------------------------------------------------------------------------------------


def _tiny_model(transformers: Any) -> Any:
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=128,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class _Ids(torch.utils.data.Dataset):
    """Token ids a 64-word model can take: ``input_ids`` of 3..40 tokens below 64, a ``text``."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = 3 + (i * 7) % 38
        return {"input_ids": (torch.arange(n) * (i + 1)) % 64, "text": f"sample {i}"}


def test_a_model_takes_the_batches_as_they_come(cache_path: str) -> None:
    transformers = pytest.importorskip("transformers")
    model = _tiny_model(transformers)
    with MmapCachedDataset(cache_path, _Ids()) as ds:
        ds.fill()
        loader = ds.loader(batch_size=8, collate_fn=TextCollate(labels="input_ids", columns=["input_ids"]))
        for batch in loader:  # (columns: the batch holds what the model takes, not the samples' text)
            assert sorted(batch) == ["attention_mask", "input_ids", "labels"]
            out = model(**batch)
            assert torch.isfinite(out.loss)
        flat = ds.loader(batch_size=8, collate_fn=TextCollate(labels="input_ids", flatten=True,
                                                              columns=["input_ids"]))
        batch = next(iter(flat))
        kwargs = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
        assert torch.isfinite(model(**kwargs).loss)  # (flash-attention's varlen kernels take the cu_seq_lens too)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_a_flattened_batch_gives_each_sample_the_logits_of_its_padded_row(cache_path: str, model_type: str) -> None:
    """Through ``model(**batch)`` in training mode with ``sdpa`` attention (no flash-attention here), each sample of
    a flattened batch attends to itself only: its logits are those of its row of the padded batch. Without the
    batch's ``use_cache=False`` the model keeps a cache and lets samples attend to the ones before them."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if model_type == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=128,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                          hidden_size=32, intermediate_size=32, vocab_size=64,
                                          max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    model.train()
    with MmapCachedDataset(cache_path, _Ids()) as ds:
        ds.fill()
        padded = next(iter(ds.loader(batch_size=6, collate_fn=TextCollate(labels="input_ids", columns=["input_ids"]))))
        flat = next(iter(ds.loader(batch_size=6, collate_fn=TextCollate(labels="input_ids", flatten=True,
                                                                        columns=["input_ids"]))))
    assert flat["use_cache"] is False
    rows = model(**padded).logits
    lengths = padded["attention_mask"].sum(1).tolist()
    expected = torch.cat([rows[k, :n] for k, n in enumerate(lengths)])
    assert torch.allclose(model(**flat).logits[0], expected, atol=1e-5)
    flat["use_cache"] = True
    assert not torch.allclose(model(**flat).logits[0], expected, atol=1e-5)  # (what use_cache=False prevents)


def test_hugging_faces_trainer_trains_on_the_cache_with_the_collate(cache_path: str, tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    model = _tiny_model(transformers)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 48

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": _Ids()[i]["input_ids"]}

    with MmapCachedDataset(cache_path, Tokens()) as ds:
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                              max_steps=6, learning_rate=1e-2, report_to=[], use_cpu=True,
                                              logging_steps=1, save_strategy="no", dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                       data_collator=TextCollate(labels="input_ids"))
        result = trainer.train()
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        assert result.global_step == 6 and len(losses) == 6 and all(np.isfinite(losses))
        assert losses[-1] < losses[0]


def test_a_trainer_can_read_through_ds_loader_a_new_order_each_epoch(cache_path: str, tmp_path: Any) -> None:
    """``Trainer.get_train_dataloader`` overridden to return ``ds.loader`` (the guide's recipe: batches copied
    straight from the heaps): ``Trainer`` calls its ``set_epoch``, so each epoch reads every sample once, in epoch
    ``e``'s order (what ``set_epoch(e)`` draws in any process, not a pass counted in this one), and the class
    ``label`` arrives as ``labels``."""
    transformers = pytest.importorskip("transformers")
    source = Tokenized(48, longest=10)
    seen: list[list[int]] = []

    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()

        class CacheTrainer(transformers.Trainer):
            def get_train_dataloader(self) -> Any:
                return ds.loader(batch_size=self.args.per_device_train_batch_size, shuffle=True, seed=self.args.seed,
                                 collate_fn=self.data_collator)

            def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
                seen.append(_indices(inputs))
                assert inputs["labels"].tolist() == [i % 7 for i in seen[-1]]
                return super().training_step(model, inputs, num_items_in_batch)

        config = transformers.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                         intermediate_size=16, vocab_size=48 * 1000, num_labels=7)
        torch.manual_seed(0)
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                              num_train_epochs=2, report_to=[], use_cpu=True, save_strategy="no",
                                              disable_tqdm=True)
        trainer = CacheTrainer(model=transformers.BertForSequenceClassification(config), args=args,
                               train_dataset=ds, data_collator=TextCollate(columns=["input_ids", "label"]))
        assert trainer.train().global_step == 12
        loader = ds.loader(batch_size=8, shuffle=True, seed=args.seed, collate_fn=TextCollate(columns=["input_ids"]))
        expected = []
        for epoch in (1, 0):  # (the loader's own: a pass drawn for the epoch set, whatever was drawn before)
            loader.sampler.set_epoch(epoch)
            expected = [_indices(batch) for batch in loader] + expected
    assert seen == expected
    first, second = ([i for batch in seen[k:k + 6] for i in batch] for k in (0, 6))
    assert sorted(first) == sorted(second) == list(range(48)) and first != second


@pytest.mark.parametrize("checkpoint", [4, 6, 8])
def test_a_trainer_resumed_from_a_checkpoint_reads_on_where_ds_loader_was(cache_path: str, tmp_path: Any,
                                                                         checkpoint: int) -> None:
    """The guide's recipe for resuming a ``Trainer`` that reads ``ds.loader`` (``helpers.trainer_recipe``):
    ``LoaderState`` saves the loader's ``state_dict()`` in each checkpoint and loads it when the run resumes, with
    ``ignore_data_skip=True``. Resumed from a checkpoint in the middle of the first or the second epoch, or at the
    first one's end, the run reads the batches the uninterrupted run read after it, in its order; the model's losses
    match too (torch's generator goes on as it did). Two ranks: ``test_distributed.py``."""
    transformers = pytest.importorskip("transformers")
    whole: list[list[int]] = []
    resumed: list[list[int]] = []
    with MmapCachedDataset(cache_path, Tokenized(48, longest=10)) as ds:
        ds.fill()
        losses = trainer_recipe.train(transformers, ds, str(tmp_path), None, whole)
        again = trainer_recipe.train(transformers, ds, str(tmp_path), str(tmp_path / f"checkpoint-{checkpoint}"),
                                     resumed)
    assert len(whole) == 12 and resumed == whole[checkpoint:]
    # (the resumed run's history begins with the checkpoint's)
    assert len(again) == 12 and again[checkpoint:] == pytest.approx(losses[checkpoint:], rel=1e-5)


def test_a_resume_the_loader_state_cannot_make_exact_is_refused_naming_the_fix(cache_path: str, tmp_path: Any) -> None:
    """Without ``ignore_data_skip=True``, ``Trainer`` failed deep in accelerate (``'NoneType' object is not
    iterable``, a new user's report); from a checkpoint saved without ``LoaderState``, the epoch would start over; from
    one saved by another number of ranks, ``Trainer`` would set another epoch. Each is refused as the run resumes,
    naming the fix."""
    transformers = pytest.importorskip("transformers")
    with MmapCachedDataset(cache_path, Tokenized(48, longest=10)) as ds:
        ds.fill()
        trainer_recipe.train(transformers, ds, str(tmp_path), None, [])
        with pytest.raises(ValueError, match="ignore_data_skip=True"):
            trainer_recipe.train(transformers, ds, str(tmp_path), str(tmp_path / "checkpoint-4"), [],
                                 ignore_data_skip=False)
        os.remove(tmp_path / "checkpoint-6" / "mmapcache-loader-0.pt")
        with pytest.raises(ValueError, match="saved without LoaderState"):
            trainer_recipe.train(transformers, ds, str(tmp_path), str(tmp_path / "checkpoint-6"), [])
        # Rank 0's state as a job of two ranks saves it (at step 8 of 3 steps an epoch there: epoch 2), resumed here
        # on one: Trainer would divide 8 by its 6 steps an epoch and set epoch 1.
        state_file = tmp_path / "checkpoint-8" / "mmapcache-loader-0.pt"
        saved = torch.load(state_file, weights_only=False)
        torch.save({**saved, "world_size": 2, "batches_per_epoch": 3}, state_file)
        with pytest.raises(ValueError, match=r"saved by a job of 2 rank.*this one has 1.*resume on 2 rank"):
            trainer_recipe.train(transformers, ds, str(tmp_path), str(tmp_path / "checkpoint-8"), [])


class _Classes(torch.utils.data.Dataset):
    """What a text classifier trains on, as Hugging Face's datasets give it: ids, a mask, a text and a ``label``."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = _Ids()[i]["input_ids"]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "text": f"s{i}", "label": i % 2}


def test_a_classifier_and_its_trainer_take_the_class_label_as_labels(cache_path: str, tmp_path: Any) -> None:
    """A class ``label`` comes back as ``labels``, as Hugging Face's collators return it: a model given ``label``
    ignores it and returns no loss, and its ``Trainer`` stops at the first step."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16,
                                     vocab_size=64, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    source = _Classes()
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        batch = next(iter(ds.loader(batch_size=8, collate_fn=TextCollate(columns=["input_ids", "label"]))))
        assert sorted(batch) == ["attention_mask", "input_ids", "labels"]
        assert batch["labels"].tolist() == [source[i]["label"] for i in range(8)]
        assert torch.isfinite(model(**batch).loss)
        kept = next(iter(ds.loader(batch_size=8, collate_fn=TextCollate(rename_labels=False))))
        assert "labels" not in kept and model(**{k: kept[k] for k in ("input_ids", "label")}).loss is None
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                              max_steps=4, learning_rate=1e-2, report_to=[], use_cpu=True,
                                              logging_steps=1, save_strategy="no", dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, data_collator=TextCollate())
        assert trainer.train().global_step == 4
        assert all(np.isfinite(log["loss"]) for log in trainer.state.log_history if "loss" in log)


class _LongAndEmpty(torch.utils.data.Dataset):
    """Token ids of 0, 1, 5000 and 9000 elements (past the 4096 of the ramps and pad rows the warm path keeps), with
    a stored mask that holds zeros (a tokenizer's padding), a text and a label."""

    def __init__(self, lengths: tuple[int, ...] = (0, 9000, 1, 5000, 0, 3, 4097, 2)) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = self.lengths[i]
        ids = torch.arange(n, dtype=torch.int64) * 7 + i
        mask = (torch.arange(n) % 5 != 0).to(torch.int64)
        return {"input_ids": ids, "attention_mask": mask, "text": f"s{i}", "label": i}


@pytest.mark.parametrize("workers", [0, 2])
def test_long_and_empty_values_read_warm_equal_the_samples_collated(cache_path: str, workers: int) -> None:
    """The warm path copies values through kept ramps and pad rows of 4096 elements, grown for longer values: a
    padded batch (stored mask, built mask, labels, a multiple), a flat one (positions, boundaries) and PadCollate's,
    each equal to the same collate over the source's samples; also batches of empty values only, and a cache whose
    values are all empty (its heaps hold no bytes)."""
    collates = [TextCollate({"input_ids": -1}), TextCollate(build_mask=True, labels="input_ids", pad_to_multiple_of=8),
                TextCollate(flatten=True, labels="input_ids"),
                PadCollate(3, mask=True, fields=["input_ids", "attention_mask"])]  # (fields: padded when all empty)
    for name, source, ragged in (("long", _LongAndEmpty(), "auto"), ("empty", _LongAndEmpty((0,) * 8), None),
                                 ("empty heaps", _LongAndEmpty((0,) * 8), ["input_ids", "attention_mask"])):
        with MmapCachedDataset(f"{cache_path}-{name}", source, ragged=ragged) as ds:
            ds.fill()
            # (all empty and not said ragged, the fields are fixed, of shape (0,): PadCollate pads ragged ones only)
            for collate in collates if ragged else collates[:3]:
                for order in ([7, 1, 0, 3, 4], [2, 6, 5], [0, 4]):
                    (batch,) = ds.loader(batch_size=len(order), sampler=order, collate_fn=collate,
                                         num_workers=workers)
                    expected = collate([source[i] for i in order])
                    if isinstance(collate, PadCollate):  # (Padded tuples: data, lengths, mask)
                        assert all(torch.equal(a, b) for key in ("input_ids", "attention_mask")
                                   for a, b in zip(batch[key], expected[key])), (name, order)
                    else:
                        assert same(batch, expected), (name, collate.__dict__, order)


class _Narrow(torch.utils.data.Dataset):
    """Token ids in the dtype a tokenizer of a small vocabulary gives (bytes: uint8), some samples padded by the
    tokenizer to a fixed length (``padding="max_length"``: pad id 0 and mask 0 after the text)."""

    def __init__(self, dtype: torch.dtype, padded: bool = False) -> None:
        self.dtype, self.padded = dtype, padded

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = 1 + i % 5
        ids = torch.arange(100 + i, 100 + i + n, dtype=self.dtype)
        mask = torch.ones(n, dtype=torch.int64)
        if self.padded:  # (as a tokenizer pads: to 6 tokens, pad id 0)
            ids = torch.cat([ids, torch.zeros(6 - n, dtype=self.dtype)])
            mask = torch.cat([mask, torch.zeros(6 - n, dtype=torch.int64)])
        return {"input_ids": ids, "attention_mask": mask}


def _every_path(cache_path: str, source: Any, collate: TextCollate) -> list[dict[str, Any]]:
    """The batch of indices 0..5 over the samples, then through ``ds.loader`` cold and warm, without and with
    workers: each one's first batch."""
    out = [collate([source[i] for i in range(6)])]
    with MmapCachedDataset(cache_path, source) as ds:
        for workers in (0, 0, 2):
            out.append(next(iter(ds.loader(batch_size=6, collate_fn=collate, num_workers=workers))))
    return out


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
@pytest.mark.parametrize("flatten", [False, True])
def test_labels_made_from_ids_of_any_integer_dtype_are_int64_with_minus_100(cache_path: str, dtype: torch.dtype,
                                                                             flatten: bool) -> None:
    """Found by a review: labels kept the ids' dtype. Flattened uint8 ids got 156 (-100 wrapped) at each sample's
    first token, silently (a byte-level model learned to predict byte 156 there); padded ones refused -100 in this
    process and wrapped it in a worker; int32 labels made the model's loss fail. Labels are int64, as Hugging Face's
    collators give them; the ids keep their dtype."""
    source = _Narrow(dtype)
    samples = [source[i] for i in range(6)]
    for batch in _every_path(cache_path, source, TextCollate(labels="input_ids", flatten=flatten)):
        labels = batch["labels"]
        assert labels.dtype == torch.int64 and batch["input_ids"].dtype == dtype
        if flatten:
            tokens = torch.cat([s["input_ids"] for s in samples]).long()
            firsts = np.cumsum([0] + [len(s["input_ids"]) for s in samples[:-1]])
            tokens[torch.from_numpy(firsts)] = -100
            assert torch.equal(labels[0], tokens)
        else:
            assert torch.equal(labels, torch.where(batch["attention_mask"].bool(), batch["input_ids"].long(), -100))


def test_labels_of_samples_a_tokenizer_padded_ignore_the_padding(cache_path: str) -> None:
    """Found by a review: samples padded by the tokenizer (mask 0 over pad ids inside the sample) kept their pad
    tokens as labels, so the model learned to predict padding (Hugging Face's language-modelling collator ignores
    them). Where the samples' mask is 0, labels are -100, on every path."""
    source = _Narrow(torch.int64, padded=True)
    for batch in _every_path(cache_path, source, TextCollate(labels="input_ids")):
        mask = batch["attention_mask"]
        assert mask.shape == (6, 6) and int(mask.sum()) == 1 + 2 + 3 + 4 + 5 + 1
        assert torch.equal(batch["labels"], torch.where(mask.bool(), batch["input_ids"], -100))


def test_a_flattened_batch_carries_no_mask_even_with_attention_mask_none(cache_path: str) -> None:
    """Found by a review: ``flatten=True, attention_mask=None`` flattened the samples' mask as a field, a (1, T)
    mask of ones with which a model attends across the samples. A flattened batch has no mask."""
    for batch in _every_path(cache_path, _Narrow(torch.int64), TextCollate(flatten=True, attention_mask=None)):
        assert "attention_mask" not in batch and batch["input_ids"].shape == (1, 16)


def test_a_pad_value_the_dtype_cannot_hold_is_refused_in_a_worker_too(cache_path: str) -> None:
    """Found by a review: ``pad=-1`` for uint8 ids raised in this process and wrapped to 255 in a worker."""
    with MmapCachedDataset(cache_path, _Narrow(torch.uint8)) as ds:
        for workers in (0, 2):
            with pytest.raises(OverflowError, match="out of bounds"):
                next(iter(ds.loader(batch_size=6, collate_fn=TextCollate(pad=-1), num_workers=workers)))


_Pair = collections.namedtuple("_Pair", ["a", "b"])


class _WithMeta(torch.utils.data.Dataset):
    """Token ids beside a nested dict of metadata (a source's name, a number, a pair, a 1-D tensor of numbers), as
    HF datasets' nested features give them; ``ids`` names the tokens, which ``first`` puts after the metadata."""

    def __init__(self, ids: str = "input_ids", first: bool = False) -> None:
        self.ids, self.first = ids, first

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, Any]:
        meta = {"source": f"doc{i}", "n": i, "span": (i, 2 * i), "window": torch.tensor([i, i + 1]),
                "pair": _Pair(torch.tensor([i, -i]), float(i)), "none": (), "tags": [i, i + 1, i + 2][:1 + i % 3]}
        ids = torch.arange(i * 1000, i * 1000 + 1 + i % 4)
        return {"meta": meta, self.ids: ids, "label": i % 3} if self.first else {
            self.ids: ids, "meta": meta, "label": i % 3}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.parametrize("options", [{}, {"columns": ["input_ids", "meta"]}, {"columns": ["input_ids"]},
                                     {"flatten": True}, {"labels": "input_ids", "pad": {"input_ids": 7}},
                                     {"pad_to_multiple_of": 8}, {"columns": ["input_ids", "meta.source"]},
                                     {"columns": ["input_ids", "meta.span.1", "meta.window"]},
                                     {"columns": ["input_ids", "meta.pair.0", "meta.source"]},
                                     {"columns": ["input_ids", "meta.pair.0", "meta.pair.1"]}])
def test_a_nested_field_comes_back_under_its_key_from_a_cache_as_over_the_samples(cache_path: str,
                                                                                  options: dict[str, Any]) -> None:
    """Found by a review: from a cache, a nested dict's fields came back under their paths (``batch["meta.source"]``),
    over the samples under their key (``batch["meta"]["source"]``), so code written against one raised a KeyError
    on the other. Every path gives the samples' form, keys in the samples' order; ``columns`` names the key, or
    fields under it by their paths. Found by a later review: a nested 1-D field of numbers (``meta.window``) was
    padded from a cache as tokens (to 8 columns with ``pad_to_multiple_of=8``; refused as not as long as the ids
    with ``flatten=True``), where over the samples it is collated as ``default_collate`` collates it; and
    ``columns`` naming fields under a key was refused over the samples."""
    source = _WithMeta()
    collate = TextCollate(**options)
    batches = _every_path(cache_path, source, collate)
    assert "meta" in batches[0] or options.get("columns") == ["input_ids"]
    meta = batches[0].get("meta", {})
    if "window" in meta:
        assert torch.equal(meta["window"], torch.tensor([[i, i + 1] for i in range(6)]))
    if "tags" in meta:  # (each sample's list, as a cache gives it back; found by a review: transposed over samples)
        assert meta["tags"] == [[i, i + 1, i + 2][:1 + i % 3] for i in range(6)]
    if "pair" in meta and len(meta["pair"]) == 2:  # (whole, a namedtuple; found by a review: a list from a cache)
        assert type(meta["pair"]) is _Pair and meta["pair"].b.tolist() == [float(i) for i in range(6)]
    for batch in batches[1:]:
        assert _equal(batch, batches[0]), (list(batch), list(batches[0]))


def test_a_pad_for_a_field_under_a_key_is_refused_on_every_path(cache_path: str) -> None:
    """Found by a review: ``pad={"meta.window": 5}`` was taken and did nothing (a field under a key is never padded);
    as ``fields=`` naming one, it is refused, naming the field."""
    with MmapCachedDataset(cache_path, _WithMeta()) as ds:
        for collate in (lambda samples: TextCollate(pad={"meta.window": 5})(samples),
                        lambda samples: next(iter(ds.loader(batch_size=6, collate_fn=TextCollate(
                            pad={"meta.window": 5}))))):
            with pytest.raises(ValueError, match=r"names \['meta.window'\] \(pad, labels or mask_from\), which lie "
                                                 r"under a key"):
                collate([ds.dataset[i] for i in range(6)])


def test_a_built_mask_is_made_from_the_samples_own_tokens_not_a_nested_field(cache_path: str) -> None:
    """Found by a review: samples with no mask, their tokens not named ``input_ids`` and a nested 1-D field before
    them: from a cache, the mask was built from the nested field's lengths ((B, 2) of ones beside (B, 4) tokens),
    silently. It is built from the first padded field of the samples' own, on every path."""
    source = _WithMeta(ids="tokens", first=True)
    for batch in _every_path(cache_path, source, TextCollate(labels="tokens")):
        lengths = torch.tensor([1 + i % 4 for i in range(6)])
        assert torch.equal(batch["attention_mask"], (torch.arange(4) < lengths[:, None]).long())
        assert torch.equal(batch["labels"], torch.where(batch["attention_mask"].bool(), batch["tokens"], -100))


def test_a_mixtures_batches_nest_a_nested_field_under_its_key(cache_path: str) -> None:
    """The same through a mixture of two caches, cold (the checked path) and warm: ``batch["meta"]`` holds each
    row's own metadata."""
    with MmapCachedDataset(cache_path, _WithMeta()) as one, MmapCachedDataset(cache_path + "-2", _WithMeta()) as two:
        loader = Mixture({"one": one, "two": two}, seed=1).loader(batch_size=6, collate_fn=TextCollate())
        for _ in range(2):
            for batch in loader:
                rows = [int(row[0]) // 1000 for row in batch["input_ids"]]
                assert list(batch) == ["input_ids", "meta", "labels", "attention_mask"]
                assert batch["meta"]["source"] == [f"doc{i}" for i in rows]
                assert batch["meta"]["n"].tolist() == rows
                assert [t.tolist() for t in batch["meta"]["span"]] == [rows, [2 * i for i in rows]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.bool, torch.int32])
def test_a_built_mask_has_the_dtype_asked_for_on_every_path(cache_path: str, dtype: torch.dtype) -> None:
    """Found by a review: ``mask_dtype=torch.bfloat16`` gave a uint16 mask (the bits bfloat16 is filled as, never
    viewed back) over the samples and from a warm cache, and a TypeError in a worker."""
    lengths = torch.tensor([1 + i % 4 for i in range(6)])
    wanted = (torch.arange(4) < lengths[:, None]).to(dtype)
    for batch in _every_path(cache_path, _WithMeta(), TextCollate(mask_dtype=dtype)):
        assert batch["attention_mask"].dtype == dtype and torch.equal(batch["attention_mask"], wanted)
