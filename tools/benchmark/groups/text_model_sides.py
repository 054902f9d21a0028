"""The text group's sides that yield what a model takes (issue 40): ``ds.loader`` with ``TextCollate``, padded (a
dict of plain tensors, the mask built from the lengths), padding-free (``flatten=True``: one row of tokens,
``position_ids``, ``cu_seq_lens``) and over a cache that stores its ids narrower (``store_as``); and the floor of
flat batches, a raw gather of the batch's token values from the cache's heap file.

Each converts its batches to the padded form every side is checked in (``text_reader.Reader.batches``), checking on
the way what its own form promises (plain tensors; positions restarting at each sample; boundaries and the longest
length that agree with the values).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from benchmark.groups.text_corpus import SEED, Corpus, TextSource
from benchmark.groups.text_reader import GatherFloor, LoaderReader
from mmapcache import MmapCachedDataset, TextCollate

# The narrowed cache: token ids under 2**31 stored as int32, the mask (all ones) as its lengths only.
STORE_AS = {"input_ids": "int32", "attention_mask": "ones"}
NARROWED_CACHE = "cache-narrowed"  # its directory under the group's workspace


def narrowed_cache(corpus: Corpus, tmp: str) -> MmapCachedDataset:
    """The corpus cached with ``STORE_AS``, filled (opened again as it is if a side made it already)."""
    ds = MmapCachedDataset(os.path.join(tmp, NARROWED_CACHE), TextSource(corpus.paths), store_as=STORE_AS)
    ds.fill()
    return ds


def _plain(batch: dict[str, Any], name: str, keys: tuple[str, ...]) -> None:
    """A model's batch is a dict of plain tensors: no subclass (``PadCollate``'s ``Padded``) a model would not take."""
    for key in keys:
        if type(batch[key]) is not torch.Tensor:
            raise AssertionError(f"{name}: batch[{key!r}] is a {type(batch[key]).__name__}, not a plain torch.Tensor")


class _TextLoader(LoaderReader):
    """``ds.loader(collate_fn=TextCollate(**collate))`` over the side's cache, seeded as every side is."""

    collate: Mapping[str, Any] = {}  # (read only: a side's TextCollate arguments)

    def __init__(self, corpus: Corpus, tmp: str, ds: MmapCachedDataset) -> None:
        super().__init__(corpus, tmp, ds)
        self.ds = ds

    def make(self, **kwargs: Any) -> Any:
        if "sampler" not in kwargs:
            kwargs["seed"] = SEED
        return self.ds.loader(collate_fn=TextCollate(**self.collate), **kwargs)


class TextDict(_TextLoader):
    """``ds.loader(collate_fn=TextCollate(0))``: ``input_ids`` padded with 0, the stored ``attention_mask`` padded
    with 0 (it may hold a tokenizer's zeros; ``build_mask=True`` would skip it), ``label`` stacked (as ``labels``),
    ``text`` listed."""

    name, label = "dict", ("mmapcache ds.loader(collate_fn=TextCollate(0)): dict of plain tensors, the stored mask "
                           "padded with 0")

    collate: Mapping[str, Any] = {"pad": 0}

    def canonical(self, batch: Any) -> dict[str, Any]:
        _plain(batch, self.name, ("input_ids", "attention_mask", "labels"))
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": batch["labels"],
                "text": batch["text"]}


# The fields a model takes (``columns``): the token ids and the class label; the text is left out, never read.
MODEL_COLUMNS = ["input_ids", "label"]


class TextTokens(TextDict):
    """``TextDict`` with ``columns=MODEL_COLUMNS`` (and ``build_mask``: the stored mask, all ones, not read): the
    batch a model takes as it is (``input_ids``, the mask made from the lengths, ``labels``), the texts not read."""

    name, label = "tokens", (f"mmapcache ds.loader(collate_fn=TextCollate(0, columns={MODEL_COLUMNS}, build_mask=True))"
                             ": the model's fields only, texts not read")

    collate: Mapping[str, Any] = {"pad": 0, "columns": MODEL_COLUMNS, "build_mask": True}

    def canonical(self, batch: Any) -> dict[str, Any]:
        if sorted(batch) != ["attention_mask", "input_ids", "labels"]:
            raise AssertionError(f"{self.name}: the batch's keys are {sorted(batch)}")
        return super().canonical({**batch, "text": None})


class Narrowed(TextDict):
    """``TextDict`` over a second cache of the corpus stored with ``STORE_AS`` (int32 ids, the mask as lengths
    only): the ids widened to int64 by the collate's one copy."""

    name, label = "narrowed", ("mmapcache, ids stored int32 and mask as ones (store_as), "
                               "ds.loader(collate_fn=TextCollate(0))")

    def __init__(self, corpus: Corpus, tmp: str, ds: MmapCachedDataset) -> None:
        super().__init__(corpus, tmp, narrowed_cache(corpus, tmp))

    def close(self) -> None:
        super().close()
        self.ds.close()  # (its files stay: the group's memory rows measure them)


def _padded(flat: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Values back to back, as ``(B, longest)`` padded with 0, and the mask of their lengths."""
    rows = list(torch.split(flat, lengths))
    ids = pad_sequence(rows, batch_first=True, padding_value=0)
    mask = (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).to(torch.int64)
    return ids, mask


class Flat(_TextLoader):
    """``ds.loader(collate_fn=TextCollate(flatten=True))``: what HF's ``DataCollatorWithFlattening`` gives a
    flash-attention model, ``input_ids`` ``(1, T)`` with ``position_ids``, ``cu_seq_lens_q/k`` and
    ``max_length_q/k``; the stored mask is not read."""

    name, label = "flat", "mmapcache ds.loader(collate_fn=TextCollate(flatten=True)): padding-free (1, T) + cu_seq_lens"

    collate: Mapping[str, Any] = {"flatten": True}

    def canonical(self, batch: Any) -> dict[str, Any]:
        _plain(batch, self.name, ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "label"))
        return self._padded_form(batch)

    def _padded_form(self, batch: Any) -> dict[str, Any]:
        ids, cu = batch["input_ids"], batch["cu_seq_lens_q"]
        lengths = torch.diff(cu).tolist()
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        if not (ids.dim() == 2 and ids.shape[0] == 1 and cu.dtype == torch.int32 and int(cu[-1]) == ids.shape[1]
                and torch.equal(batch["cu_seq_lens_k"], cu) and torch.equal(batch["position_ids"], positions)
                and batch["max_length_q"] == batch["max_length_k"] == max(lengths)):
            raise AssertionError(f"{self.name}: the flat batch's shape, cu_seq_lens, position_ids or max_length "
                                 f"disagree (input_ids {tuple(ids.shape)}, cu_seq_lens {cu.tolist()[:4]}...)")
        padded, mask = _padded(ids[0], lengths)
        return {"input_ids": padded, "attention_mask": mask, "labels": batch["label"], "text": batch.get("text")}


class FlatTokens(Flat):
    """``Flat`` with ``columns=MODEL_COLUMNS``: the tokens, their positions and boundaries and the class label; the
    texts not read (against ``FlatTokensFloor``, the same bytes)."""

    name, label = "flattokens", (f"mmapcache ds.loader(collate_fn=TextCollate(flatten=True, columns={MODEL_COLUMNS}))"
                                 ": padding-free, texts not read")

    collate: Mapping[str, Any] = {"flatten": True, "columns": MODEL_COLUMNS}

    def canonical(self, batch: Any) -> dict[str, Any]:
        if "text" in batch:
            raise AssertionError(f"{self.name}: the batch holds the texts columns= leaves out")
        return super().canonical(batch)


class FlatFloor(GatherFloor):
    """The floor of flat batches: per batch, the rows' ``[offset, extent, length]`` taken from the cache's
    ``input_ids.index.npy`` and each value's int64 tokens copied from ``input_ids.heap`` (mapped as numpy) into one
    new flat array, back to back, each text's bytes copied out of ``text.heap`` (not decoded), and the labels taken
    from ``label.npy``. No checks (no seqlock, no bounds, no complete-row test), no torch, no DataLoader, no
    positions or boundaries, no decoding: the same bytes ``Flat`` copies, and nothing else. Workers do not
    apply."""

    name, label = "flatfloor", ("flat floor: numpy gather of the token values from the heap file into one flat "
                                "array, one process, no checks")

    def __init__(self, corpus: Corpus, tmp: str, ds: MmapCachedDataset) -> None:
        super().__init__(corpus, tmp, ds)
        spec = next(f for f in ds._store.meta["fields"] if f["name"] == "input_ids")
        labels = next(f for f in ds._store.meta["fields"] if f["name"] == "label")
        dtype = np.dtype(spec["dtype"])
        heap = os.path.join(ds.path, spec["heap"])
        # Plain ndarrays over the maps (np.memmap's slices pay for the subclass on every value).
        self.heap = np.asarray(np.memmap(heap, dtype, mode="r", shape=(os.path.getsize(heap) // dtype.itemsize,)))
        self.index = np.asarray(np.load(os.path.join(ds.path, spec["index_file"]), mmap_mode="r"))
        self.labels = np.asarray(np.load(os.path.join(ds.path, labels["file"]), mmap_mode="r"))
        self.itemsize = dtype.itemsize
        text = next((f for f in ds._store.meta["fields"] if f["name"] == "text"), None)
        self.text: tuple[memoryview, np.ndarray] | None = None
        if text is not None:
            path = os.path.join(ds.path, text["heap"])
            self.text = (memoryview(np.asarray(np.memmap(path, np.uint8, mode="r")) if os.path.getsize(path) else
                                    np.zeros(0, np.uint8)),
                         np.asarray(np.load(os.path.join(ds.path, text["index_file"]), mmap_mode="r")))
        if len(self.index) != corpus.n:  # row i holds sample i (one variant, every sample cached)
            raise RuntimeError(f"flat floor: the cache has {len(self.index)} rows for {corpus.n} samples")

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        entries = self.index.take(rows, 0)
        lengths = entries[:, 2]
        flat = np.empty(int(lengths.sum()), self.heap.dtype)
        heap, at = self.heap, 0
        for start, length in zip((entries[:, 0] // self.itemsize).tolist(), lengths.tolist()):
            flat[at:at + length] = heap[start:start + length]
            at += length
        if self.text is not None:  # the texts' bytes, as they are in the heap
            data, index = self.text
            texts = index.take(rows, 0)
            _ = [data[o:o + n].tobytes() for o, n in zip(texts[:, 0].tolist(), texts[:, 2].tolist())]
        return flat, lengths, self.labels.take(rows)

    def batches(self, index_lists: list[list[int]]) -> list[dict[str, Any]]:
        out = []
        for rows in index_lists:
            flat, lengths, labels = self.gather(np.asarray(rows))
            ids, mask = _padded(torch.from_numpy(flat), lengths.tolist())
            out.append({"input_ids": ids, "attention_mask": mask, "labels": torch.from_numpy(labels), "text": None})
        return out


class FlatTokensFloor(FlatFloor):
    """``FlatFloor`` without the texts: the token values and the labels, the bytes ``FlatTokens`` copies."""

    name, label = "flattokensfloor", ("flat floor of the tokens: numpy gather of the token values and labels, no "
                                      "texts, one process, no checks")

    def __init__(self, corpus: Corpus, tmp: str, ds: MmapCachedDataset) -> None:
        super().__init__(corpus, tmp, ds)
        self.text = None
