"""The sides of the text group's warm tables, listed in ``READERS``: the numpy floor, ``ds.loader`` with
``PadCollate``, and what LLM users read the corpus with otherwise (a list of dicts, HF ``datasets``, litdata); the
sides that yield what a model takes (``TextCollate``) are in ``text_model_sides``. A new side is a ``Reader``
subclass (``text_reader``) and one entry in ``READERS``: it then runs in every table and is checked against the
floor before any timing.

litdata runs in a child process (``litdata_child``): ``litdata.optimize`` switches its process's multiprocessing
start method to spawn, and the child times its own epochs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from benchmark.core import Timed
from benchmark.groups.text_corpus import SEED, Corpus, open_corpus, pad_collate
from benchmark.groups.text_model_sides import (
    Flat,
    FlatFloor,
    FlatTokens,
    FlatTokensFloor,
    Narrowed,
    TextDict,
    TextTokens,
)
from benchmark.groups.text_reader import GatherFloor, LoaderReader, Reader
from mmapcache import MmapCachedDataset, PadCollate


class Floor(GatherFloor):
    """No DataLoader, no torch: per batch, each sample's int64 ids and mask copied out of the concatenated arrays
    into ``np.zeros((B, longest))``, and the labels taken. What the bytes alone cost; workers do not apply."""

    name, label = "floor", "floor: numpy gather into np.zeros((B, longest)), one process, no DataLoader"

    def __init__(self, corpus: Corpus, tmp: str, ds: MmapCachedDataset) -> None:
        super().__init__(corpus, tmp, ds)
        self.ids, self.mask, self.labels = (np.ascontiguousarray(a) for a in (corpus.ids, corpus.mask, corpus.labels))
        self.starts, self.ends = corpus.offsets[:-1].tolist(), corpus.offsets[1:].tolist()
        self.lengths = np.diff(corpus.offsets)

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        longest = int(self.lengths[rows].max())
        ids, mask = np.zeros((len(rows), longest), np.int64), np.zeros((len(rows), longest), np.int64)
        starts, ends = self.starts, self.ends
        for j, i in enumerate(rows.tolist()):
            s, e = starts[i], ends[i]
            ids[j, :e - s] = self.ids[s:e]
            mask[j, :e - s] = self.mask[s:e]
        return ids, mask, self.labels[rows]

    def batches(self, index_lists: list[list[int]]) -> list[dict[str, Any]]:
        out = []
        for rows in index_lists:
            ids, mask, labels = self.gather(np.asarray(rows))
            out.append({"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
                        "labels": torch.from_numpy(labels), "text": None})
        return out


class Cached(LoaderReader):
    name, label = "mmapcache", "mmapcache ds.loader(collate_fn=PadCollate(0, mask=True))"

    def __init__(self, corpus: Corpus, tmp: str, ds: MmapCachedDataset) -> None:
        super().__init__(corpus, tmp, ds)
        self.ds = ds

    def make(self, **kwargs: Any) -> Any:
        if "sampler" not in kwargs:
            kwargs["seed"] = SEED
        return self.ds.loader(collate_fn=PadCollate(0, mask=True), **kwargs)

    def canonical(self, batch: Any) -> dict[str, Any]:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        positions = torch.arange(ids.data.shape[1])
        if not (torch.equal(ids.mask, positions < ids.lengths[:, None]) and torch.equal(ids.lengths, mask.lengths)):
            raise AssertionError("mmapcache: PadCollate's mask or lengths disagree with the values' lengths")
        return {"input_ids": ids.data, "attention_mask": mask.data, "labels": batch["label"], "text": batch["text"]}


class ListOfDicts(LoaderReader):
    name, label = "list", "list of dicts in RAM + pad_sequence collate"

    def __init__(self, corpus: Corpus, tmp: str, ds: MmapCachedDataset) -> None:
        super().__init__(corpus, tmp, ds)
        self.samples = [corpus.sample(i) for i in range(corpus.n)]

    def make(self, **kwargs: Any) -> Any:
        if "sampler" not in kwargs:
            kwargs["generator"] = torch.Generator().manual_seed(SEED)
        return DataLoader(self.samples, collate_fn=pad_collate, **kwargs)


class HFDatasets(LoaderReader):
    """``Dataset.from_dict`` of the int64 samples, ``save_to_disk``, ``load_from_disk``, ``with_format("torch")``."""

    name, label = "hf", "HF datasets load_from_disk().with_format('torch') + pad_sequence collate"

    def __init__(self, corpus: Corpus, tmp: str, ds: MmapCachedDataset) -> None:
        super().__init__(corpus, tmp, ds)
        if importlib.util.find_spec("datasets") is None:
            self.skipped = "skipped: pip install datasets"
            return
        import datasets

        self.path = os.path.join(tmp, "hf-int64")
        self.features = hf_save(corpus, self.path, np.int64, np.int64)
        self.hf = datasets.load_from_disk(self.path).with_format("torch")

    def make(self, **kwargs: Any) -> Any:
        if "sampler" not in kwargs:
            kwargs["generator"] = torch.Generator().manual_seed(SEED)
        return DataLoader(self.hf, collate_fn=pad_collate, **kwargs)


def hf_save(corpus: Corpus, path: str, ids_dtype: Any, mask_dtype: Any) -> str:
    """The corpus given to ``datasets.Dataset.from_dict`` with these dtypes and saved to ``path``; returns the
    features HF stored."""
    import datasets

    if hasattr(datasets, "disable_progress_bars"):
        datasets.disable_progress_bars()
    o = corpus.offsets.tolist()
    t = corpus.text_offsets.tolist()
    raw = corpus.text.tobytes()
    ds = datasets.Dataset.from_dict({
        "input_ids": [corpus.ids[o[i]:o[i + 1]].astype(ids_dtype) for i in range(corpus.n)],
        "attention_mask": [corpus.mask[o[i]:o[i + 1]].astype(mask_dtype) for i in range(corpus.n)],
        "text": [raw[t[i]:t[i + 1]].decode() for i in range(corpus.n)], "label": corpus.labels.tolist()})
    ds.save_to_disk(path)
    return ", ".join(f"{name} {feature}" for name, feature in ds.features.items())


class Litdata(Reader):
    """``litdata.optimize`` to a directory, then ``StreamingDataset(shuffle=True)`` + ``StreamingDataLoader`` with the
    pad_sequence collate, all in a child process (``litdata_child``) that times its own epochs."""

    name, label = "litdata", "litdata optimize + StreamingDataset + StreamingDataLoader + pad_sequence collate"

    def __init__(self, corpus: Corpus, tmp: str, ds: MmapCachedDataset) -> None:
        super().__init__(corpus, tmp, ds)
        if importlib.util.find_spec("litdata") is None:
            self.skipped = "skipped: litdata is not installed (pyproject.toml's bench extra says how)"
            return
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.log = os.path.join(tmp, "litdata.log")
        self.proc = ctx.Process(target=litdata_child, args=(child, corpus.paths, os.path.join(tmp, "litdata"),
                                                            self.log))
        self.proc.start()
        child.close()
        self.optimize_s, self.bytes = self.ask("ready")

    def ask(self, *message: Any) -> Any:
        if message != ("ready",):
            self.conn.send(message)
        if not self.conn.poll(1800):
            raise RuntimeError(f"the litdata child did not answer {message[0]!r} within 1800 s")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the litdata child exited ({self.proc.exitcode}); its log: {self._log()}") from None
        if kind == "error":
            raise RuntimeError(f"the litdata child failed on {message[0]!r}: {value}")
        return value

    def _log(self) -> str:
        try:
            with open(self.log) as f:
                return f.read()[-2000:]
        except OSError:
            return "(none)"

    def epoch(self, batch: int, workers: int) -> Callable[[], Timed]:
        return lambda: Timed(*self.ask("epoch", batch, workers))

    def batches(self, index_lists: list[list[int]]) -> list[dict[str, Any]]:
        return self.ask("batches", index_lists)

    def release(self) -> None:
        if not self.skipped:
            self.ask("release")

    def close(self) -> None:
        if self.skipped:
            return
        with contextlib.suppress(OSError):  # the child may be gone already: join and kill below
            self.conn.send(("close",))
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _litdata_sample(paths: dict[str, str], i: int) -> dict[str, Any]:
    return open_corpus(paths).sample(i)


def litdata_child(conn: Any, paths: dict[str, str], out: str, log: str) -> None:
    """The litdata side's process: optimizes the corpus (one worker, so item ``i`` is sample ``i``), answers
    ("ready", (seconds, bytes)), then serves ("epoch", batch, workers) with the (count, seconds) of one warm epoch,
    ("batches", index lists) with those batches, ("release",) by dropping its loaders, until ("close",)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    import litdata

    try:
        start = time.perf_counter()
        litdata.optimize(fn=functools.partial(_litdata_sample, paths), inputs=list(range(open_corpus(paths).n)),
                         output_dir=out, chunk_bytes="64MB", num_workers=1)
        conn.send(("ok", (time.perf_counter() - start, du(out))))
        loaders: dict[tuple[int, int], Any] = {}
        while True:
            message = conn.recv()
            if message[0] == "close":
                return
            if message[0] == "release":
                loaders.clear()
                conn.send(("ok", None))
            elif message[0] == "epoch":
                key = message[1], message[2]
                if key not in loaders:
                    ds = litdata.StreamingDataset(out, shuffle=True, seed=SEED)
                    loaders[key] = litdata.StreamingDataLoader(ds, batch_size=key[0], num_workers=key[1],
                                                               collate_fn=pad_collate, persistent_workers=key[1] > 0)
                count, start = 0, time.perf_counter()
                for batch in loaders[key]:
                    count += len(batch["labels"])
                conn.send(("ok", (count, time.perf_counter() - start)))
            elif message[0] == "batches":
                ds = litdata.StreamingDataset(out, shuffle=False)
                conn.send(("ok", [pad_collate([ds[i] for i in rows]) for rows in message[1]]))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


# Every side of the warm tables, in the order they run and are shown; a new side is one entry here.
READERS: list[type[Reader]] = [Cached, TextDict, TextTokens, Flat, FlatTokens, Narrowed, ListOfDicts, HFDatasets,
                               Litdata, Floor, FlatFloor, FlatTokensFloor]


def du(path: str) -> int:
    """Bytes allocated under ``path`` (what ``du`` counts: blocks, not apparent sizes)."""
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(directory, name)).st_blocks * 512
    return total
