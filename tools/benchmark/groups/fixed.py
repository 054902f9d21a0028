"""Groups ``images12k``, ``images150k``, ``tabular`` and ``dict`` (issues 11 and 14): a fixed-shape workload's warm
reads against the raw gather and its in-memory baseline, then its cold first epoch against the bare source.

Each builds its data, its cache and its baselines once, then runs its comparisons (the workloads are defined in
``benchmark.workloads``). Every comparison is one ``interleave`` call: the sides a target compares (and the rows
shown beside them) run in turn, round after round, in this process with ``num_workers=0`` unless a row says
otherwise. 12 KB images also measure ``ds[i]`` against a bare copy and the loaders with two workers.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmark import sources as src
from benchmark.core import Config, Results, Side, Timed, info, interleave
from benchmark.epochs import epoch, raw_gather
from benchmark.targets import TARGETS
from benchmark.workloads import IMAGES12K, PER_SAMPLE, FixedWorkload, workspace, write_fields
from mmapcache import MmapCachedDataset


def run_fixed(w: FixedWorkload, cfg: Config, results: Results) -> None:
    """A fixed-shape workload: warm reads against the raw gather and the in-memory baseline, then the cold epoch."""
    n = cfg.size(w.n, w.quick_n)
    with workspace(w.name) as tmp:
        print(f"  data: N={n} samples of {w.sample_bytes():,} bytes in {tmp}", flush=True)
        paths = write_fields(tmp, w, n)
        ds = MmapCachedDataset(os.path.join(tmp, "cache"), src.FieldSource(paths, w.form))
        ds.fill()
        try:
            baseline = in_memory(w, paths)
            warm(w, cfg, results, ds, baseline, n)
            if w is IMAGES12K:
                per_sample(w, cfg, results, ds, n)
                workers(w, cfg, results, ds, baseline)
            del baseline
            if w.cold_delay is not None:
                cold(w, cfg, results, paths, tmp)
        finally:
            ds.close()


def in_memory(w: FixedWorkload, paths: dict[str, str]) -> Any:
    """The in-memory baseline: a ``TensorDataset`` of the fields (tuple form) or a list of dicts of tensors."""
    arrays = {name: torch.from_numpy(np.load(path)) for name, path in paths.items()}  # private copies
    if w.form == "tuple":
        return TensorDataset(*arrays.values())
    n = len(next(iter(arrays.values())))
    return [{name: int(a[i]) if a.ndim == 1 else a[i] for name, a in arrays.items()} for i in range(n)]


def warm(w: FixedWorkload, cfg: Config, results: Results, ds: MmapCachedDataset, baseline: Any, n: int) -> None:
    b = cfg.batch
    sides = [Side("raw", raw_gather(ds, n, b), n),
             Side("raw2", raw_gather(ds, n, b, buffers=2), n),
             Side("loader", epoch(ds.loader(batch_size=b, shuffle=True)), n),
             Side("baseline", epoch(DataLoader(baseline, batch_size=b, shuffle=True)), n)]
    labels = {"raw": f"{w.title}: raw sorted np.take gather, preallocated buffers",
              "raw2": f"{w.title}: the same raw gather alternating between 2 buffer sets",
              "loader": f"{w.title}: mmapcache ds.loader(), nw=0",
              "baseline": f"{w.title}: {w.baseline}, nw=0",
              "getitems": f"{w.title}: mmapcache DataLoader(ds) via __getitems__, nw=0",
              "per_sample": f"{w.title}: mmapcache DataLoader(ds) per sample (no __getitems__), nw=0"}
    if w.getitems:
        sides.append(Side("getitems", epoch(DataLoader(ds, batch_size=b, shuffle=True)), n))
    per_sample_ds = src.PerSample(ds.path) if w is IMAGES12K else None
    if per_sample_ds is not None:
        sides.append(Side("per_sample", epoch(DataLoader(per_sample_ds, batch_size=b, shuffle=True)), n))
    try:
        cmp = interleave(sides, cfg.rounds, min_time=cfg.min_time)
    finally:
        if per_sample_ds is not None:
            per_sample_ds.close()
    results.sides(w.name, cmp, labels)
    results.compared(f"{w.name}.loader_vs_raw", cmp, "loader", "raw")
    info(results, w.name, cmp, "loader", "raw2", f"{w.title}: ds.loader vs raw gather into 2 buffer sets")
    key = f"{w.name}.loader_vs_baseline"
    if key in TARGETS:
        results.compared(key, cmp, "loader", "baseline")
    else:
        info(results, w.name, cmp, "loader", "baseline", f"{w.title}: ds.loader vs {w.baseline}")
    if w.getitems:
        results.compared(f"{w.name}.getitems_vs_baseline", cmp, "getitems", "baseline")


def per_sample(w: FixedWorkload, cfg: Config, results: Results, ds: MmapCachedDataset, n: int) -> None:
    """``ds[i]`` against the bare copy it replaces, in the same shuffled order."""
    order = np.random.default_rng(2).permutation(n)[:PER_SAMPLE].tolist()
    fields = ds._store.meta["fields"]
    images = np.asarray(np.load(os.path.join(ds.path, fields[0]["file"]), mmap_mode="r"))
    labels = np.asarray(np.load(os.path.join(ds.path, fields[1]["file"]), mmap_mode="r"))
    from_numpy = torch.from_numpy

    def bare() -> None:
        for i in order:
            from_numpy(images[i].copy()), int(labels[i])

    def cached() -> None:
        for i in order:
            ds[i]

    cmp = interleave([Side("bare_copy", bare, len(order)), Side("getitem", cached, len(order))], cfg.rounds,
                     min_time=cfg.min_time)
    results.sides(w.name, cmp, {"bare_copy": f"{w.title}: bare (from_numpy(images[i].copy()), int(labels[i]))",
                                "getitem": f"{w.title}: mmapcache ds[i]"}, note="shuffled single-sample reads")
    results.compared(f"{w.name}.getitem_vs_bare", cmp, "getitem", "bare_copy")


def workers(w: FixedWorkload, cfg: Config, results: Results, ds: MmapCachedDataset, baseline: Any) -> None:
    """The same loaders with two persistent workers (no target: on 2 cores the workers share them with us)."""
    kw: dict[str, Any] = {"batch_size": cfg.batch, "shuffle": True, "num_workers": 2, "persistent_workers": True}
    loaders = {"baseline_nw2": DataLoader(baseline, **kw), "getitems_nw2": DataLoader(ds, **kw),
               "loader_nw2": ds.loader(**kw)}
    n = len(ds)
    # No target here, so fewer rounds; the warm-up round starts the workers.
    cmp = interleave([Side(name, epoch(loader), n) for name, loader in loaders.items()], min(cfg.rounds, 3),
                     min_time=cfg.min_time)
    del loaders
    results.sides(w.name, cmp, {"baseline_nw2": f"{w.title}: {w.baseline}, nw=2",
                                "getitems_nw2": f"{w.title}: mmapcache DataLoader(ds) via __getitems__, nw=2",
                                "loader_nw2": f"{w.title}: mmapcache ds.loader(), nw=2"})


def cold(w: FixedWorkload, cfg: Config, results: Results, paths: dict[str, str], tmp: str) -> None:
    """One shuffled epoch over the bare source against creating a cache and running its first epoch, in turn."""
    count = cfg.size(w.cold_n, w.cold_quick_n)
    source = src.FieldSource(paths, w.form, delay=w.cold_delay or 0.0, n=count)
    source.touch()  # no warm-up round: the first bare epoch would otherwise pay for mapping the files
    b = cfg.batch

    def bare() -> None:
        for _ in DataLoader(source, batch_size=b, shuffle=True):
            pass

    def cached() -> Timed:
        path = os.path.join(tmp, f"cold-{uuid.uuid4().hex[:8]}")
        start = time.perf_counter()
        ds = MmapCachedDataset(path, source)
        for _ in DataLoader(ds, batch_size=b, shuffle=True):
            pass
        seconds = time.perf_counter() - start
        ds.close()
        shutil.rmtree(path)  # not timed
        return Timed(count, seconds)

    row_bytes = w.sample_bytes()
    order = np.random.default_rng(3).permutation(count).tolist()
    page = np.random.default_rng(4).integers(0, 256, row_bytes, np.uint8)

    def store() -> Timed:
        """What tmpfs itself charges for caching the samples: reserve the rows, then write each once, in the
        shuffled order (no Python beyond the loop). No cache can store its first epoch for less."""
        path = os.path.join(tmp, f"floor-{uuid.uuid4().hex[:8]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            start = time.perf_counter()
            os.posix_fallocate(fd, 0, count * row_bytes)
            for row in order:
                os.pwrite(fd, page, row * row_bytes)
            return Timed(count, time.perf_counter() - start)
        finally:
            os.close(fd)
            os.unlink(path)

    cmp = interleave([Side("bare", bare, count, autorange=False), Side("cached", cached, count, autorange=False),
                      Side("store", store, count, autorange=False)], cfg.rounds, warmup=0)
    us = f"{w.cold_delay * 1e6:,.0f} us" if w.cold_delay and w.cold_delay < 1e-3 else "1 ms"
    results.sides(w.name, cmp, {"bare": f"{w.title}: cold, bare source ({us}/sample busy CPU), one epoch",
                                "cached": f"{w.title}: cold, new cache + its first epoch (DataLoader(ds))",
                                "store": f"{w.title}: tmpfs alone: fallocate + one pwrite per row, shuffled"},
                  note=f"N={count}, batch {b}, shuffled")
    # Rate of the bare source over the cached one: the cached epoch's time over the bare one's.
    results.compared(f"{w.name}.cold", cmp, "bare", "cached", f"N={count}")
    # The least any cache can reach: the bare epoch plus tmpfs's own cost of storing it.
    floor = 1 + cmp.sides["bare"].best_rate / cmp.sides["store"].best_rate
    results.row(w.name, f"{w.title}: cold floor, (bare epoch + tmpfs store) / bare epoch", floor, "x",
                "interleaved, from best rounds", cmp.load())
