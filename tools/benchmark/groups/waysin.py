"""Group ``waysin`` (issue 28, run on request): the ways samples get into a cache, per sample, against the bare
source and against the loader's own batched misses, on cheap sources where the cache's cost shows.

Two workloads: 64-byte rows and 12 KB rows, each with an int label, from a source that copies its row into a new
tensor (``torch.from_numpy(row.copy())``, a few microseconds a sample, as a cheap preprocessing would). Sides, run
in turn (A B C ... A B C ..., best round each), each on a new cache: the bare source in a loop; ``ds.loader``'s
first epoch (batched misses); ``ds.fill()``; ``ds[i]`` for every ``i``; ``mmapcache.build`` with 1 and 2 workers,
their marginal cost per sample (``BuildReport.steady``: the rows stored from the first chunk's result to the last,
over that time: no start-up); one stream producer filling an empty ring the size of the source. And ``prefill()``
of 1M rows of 64 bytes against a cold ``ds.loader`` epoch over the same rows (100,000 with ``--quick``). And ragged
captions (text of 20..200 characters, 16..512 int64 token ids, an int label): a cold ``ds.loader`` epoch,
``DataLoader(ds)``'s, ``ds.fill()`` and ``ds[i]``, against the bare source.

Run on request (``--only waysin``): its builds start worker processes, a minute of both cores even with ``--quick``.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import mmapcache
from benchmark.core import Config, Results, Side, Timed, interleave, load_now
from benchmark.workloads import workspace
from mmapcache import MmapCachedDataset
from mmapcache.fill.producer import SourceFactory, produce
from mmapcache.store.ring import NEXT


class Rows(Dataset):
    """Row ``i`` of a random ``(n, row_bytes)`` uint8 array, copied into a new tensor, and the label ``i``."""

    def __init__(self, n: int, row_bytes: int) -> None:
        self.n = n
        self.data = np.random.default_rng(0).integers(0, 256, (n, row_bytes), dtype=np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.from_numpy(self.data[i].copy()), i


def rows(n: int = 1000, row_bytes: int = 64) -> Rows:
    """The build's dataset spec (``benchmark.groups.waysin:rows``)."""
    return Rows(n, row_bytes)


class Captions(Dataset):
    """Ragged samples: ``{"text": 20..200 characters, "ids": 16..512 int64 token ids, "label": int}``."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(1)
        self.n, self.chars, self.tokens = n, rng.integers(20, 201, n).tolist(), rng.integers(16, 513, n).tolist()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return {"text": "w" * self.chars[i], "ids": torch.arange(self.tokens[i]) + i, "label": i}


def run_ways(cfg: Config, results: Results) -> None:
    with workspace("waysin") as tmp:
        for name, row_bytes, n in (("64 B rows", 64, cfg.size(20000, 4000)), ("12 KB rows", 12288,
                                                                             cfg.size(8000, 1600))):
            _ways(cfg, results, tmp, name, row_bytes, n)
        _prefill(cfg, results, tmp)
        _ragged(cfg, results, tmp)


def _ragged(cfg: Config, results: Results, tmp: str) -> None:
    n = cfg.size(10000, 2000)
    source = Captions(n)

    def bare() -> None:
        for i in range(n):
            source[i]

    def loader(ds: MmapCachedDataset) -> None:
        for _ in ds.loader(batch_size=256, shuffle=True):
            pass

    def dataloader(ds: MmapCachedDataset) -> None:
        for _ in DataLoader(ds, batch_size=256, shuffle=True, collate_fn=list):
            pass

    def getitem(ds: MmapCachedDataset) -> None:
        for i in range(n):
            ds[i]

    def timed(work: Any) -> Timed:
        return _on_a_new_cache(tmp, source, work, ragged=["ids"])
    sides = [Side("source", bare, n), Side("loader", lambda: timed(loader), autorange=False),
             Side("dataloader", lambda: timed(dataloader), autorange=False),
             Side("fill", lambda: timed(lambda ds: ds.fill()), autorange=False),
             Side("getitem", lambda: timed(getitem), autorange=False)]
    cmp = interleave(sides, 1 if cfg.quick else min(cfg.rounds, 3), warmup=0 if cfg.quick else 1)
    per = {side: 1e6 / cmp.rate(side) for side in cmp.sides}
    note = f"N={n}, source {per['source']:.2f} us a sample; load {cmp.load()[0]:.2f}-{cmp.load()[1]:.2f}"
    texts = {"loader": "ds.loader's first epoch, shuffled", "dataloader": "DataLoader(ds)'s first epoch, shuffled",
             "fill": "ds.fill()", "getitem": "ds[i] on a new cache"}
    for side, text in texts.items():
        results.row("waysin", f"ragged captions: {text}, x the bare source", per[side] / per["source"], "x",
                    f"{per[side]:.2f} us a sample, {per[side] / per['loader']:.2f}x the loader; {note}", cmp.load())


def _ways(cfg: Config, results: Results, tmp: str, name: str, row_bytes: int, n: int) -> None:
    source = Rows(n, row_bytes)

    def timed(work: Any) -> Timed:
        return _on_a_new_cache(tmp, source, work)

    def bare() -> None:
        for i in range(n):
            source[i]

    def loader(ds: MmapCachedDataset) -> None:
        for _ in ds.loader(batch_size=256):
            pass

    def getitem(ds: MmapCachedDataset) -> None:
        for i in range(n):
            ds[i]

    def build(workers: int) -> Timed:
        path = os.path.join(tmp, uuid.uuid4().hex[:8])
        report = mmapcache.build(path, "benchmark.groups.waysin:rows",
                                 kwargs={"n": n, "row_bytes": row_bytes}, workers=workers, ragged=None, progress=False)
        shutil.rmtree(path)
        rows, seconds = report.steady  # from the first chunk's result to the last: no start-up
        return Timed(rows, seconds)

    sides = [Side("source", bare, n), Side("loader", lambda: timed(loader), autorange=False),
             Side("produce", lambda: _produced(tmp, source), autorange=False),
             Side("fill", lambda: timed(lambda ds: ds.fill()), autorange=False),
             Side("getitem", lambda: timed(getitem), autorange=False),
             Side("build1", lambda: build(1), autorange=False), Side("build2", lambda: build(2), autorange=False)]
    cmp = interleave(sides, 1 if cfg.quick else min(cfg.rounds, 3), warmup=0 if cfg.quick else 1)
    per = {side: 1e6 / cmp.rate(side) for side in cmp.sides}  # microseconds a sample
    note = (f"N={n}, {row_bytes} B + label, source {per['source']:.2f} us a sample; load "
            f"{cmp.load()[0]:.2f}-{cmp.load()[1]:.2f}")
    texts = {"loader": "ds.loader's first epoch (batched misses)", "fill": "ds.fill()",
             "getitem": "ds[i] on a new cache", "build1": "build(workers=1), marginal",
             "build2": "build(workers=2), marginal", "produce": "a stream producer filling an empty ring"}
    for side, text in texts.items():
        results.row("waysin", f"{name}: {text}, x the bare source / x the loader", per[side] / per["source"], "x",
                    f"{per[side]:.2f} us a sample, {per[side] / per['loader']:.2f}x the loader; {note}", cmp.load())
    key = "64" if row_bytes == 64 else "12k"
    results.target(f"waysin.fill_{key}", per["fill"] / per["loader"], cmp.load(), note)
    results.target(f"waysin.build_{key}", per["build1"] / per["loader"], cmp.load(), note)
    results.target(f"waysin.build2_{key}", per["build1"] / per["build2"], cmp.load(), note)
    if row_bytes == 64:
        results.target("waysin.getitem_over_source", per["getitem"] - per["source"], cmp.load(), note)


def _on_a_new_cache(tmp: str, source: Dataset, work: Any, ragged: Any = None) -> Timed:
    """``work(ds)`` timed on a new cache of ``source`` (created, its first sample and probes stored, before the clock
    starts), removed afterwards."""
    ds = MmapCachedDataset(os.path.join(tmp, uuid.uuid4().hex[:8]), source, ragged=ragged)
    start = time.perf_counter()
    work(ds)
    seconds = time.perf_counter() - start
    ds.close()
    shutil.rmtree(ds.path)
    return Timed(len(source), seconds)


class _RingFull:
    """A producer's ``stop``: set once the ring's next position to claim is past its last row, read from the ring's
    words (``stream_stats`` takes about 0.5 ms a call: asked once a run, it would weigh on the producer it times)."""

    def __init__(self, ds: MmapCachedDataset) -> None:
        self.ring, self.slots = ds._ring, ds.stream_stats["slots"]

    def is_set(self) -> bool:
        return bool(int(self.ring.words[NEXT]) >= self.slots)


def _produced(tmp: str, source: Rows) -> Timed:
    """One stream producer (``fill.producer.produce``, in this process) filling the empty ring of a new stream that
    holds about the whole source, timed from its first claim to its last publication."""
    ds = MmapCachedDataset(os.path.join(tmp, uuid.uuid4().hex[:8]), source, stream=True, seed=0,
                           max_bytes=len(source) * (source.data.shape[1] + 64))
    full = _RingFull(ds)
    start, first = time.perf_counter(), ds.stream_stats["next"]
    produce(ds.path, SourceFactory(source), full)
    seconds = time.perf_counter() - start
    positions = ds.stream_stats["next"] - first
    ds.close()
    shutil.rmtree(ds.path)
    return Timed(positions, seconds)


def _prefill(cfg: Config, results: Results, tmp: str) -> None:
    n = 100_000 if cfg.quick else 1_000_000
    source = Rows(n, 64)

    def timed(work: Any) -> Timed:
        return _on_a_new_cache(tmp, source, work)

    def epoch(ds: MmapCachedDataset) -> None:
        for _ in ds.loader(batch_size=256):
            pass

    cmp = interleave([Side("prefill", lambda: timed(lambda ds: ds.prefill(rank=0, world_size=1, barrier=False)),
                           autorange=False), Side("loader", lambda: timed(epoch), autorange=False)],
                     1 if cfg.quick else min(cfg.rounds, 3), warmup=0)
    note = (f"{n} rows of 64 B + label: prefill {n / cmp.rate('prefill'):.2f} s, a cold ds.loader epoch "
            f"{n / cmp.rate('loader'):.2f} s")
    results.row("waysin", f"prefill() of {n} rows of 64 B, time x a cold ds.loader epoch",
                cmp.ratio("loader", "prefill"), "x", note, cmp.load())
    results.target("waysin.prefill", cmp.ratio("loader", "prefill"), load_now(), note)
