"""Group ``memory``: the summed PSS growth of processes reading one cache against as many holding private copies.

Builds what it needs in its own ``workspace``; sides that give a ratio are measured interleaved
(``benchmark.core.interleave``), like the workload groups.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time

import numpy as np

from benchmark import sources as src
from benchmark.core import Config, Results, load_now
from benchmark.workloads import IMAGES12K, workspace, write_fields
from mmapcache import MmapCachedDataset


def run_memory(cfg: Config, results: Results) -> None:
    """Four processes reading the whole cache against four each holding a private copy: summed PSS growth."""
    n = cfg.size(IMAGES12K.n, IMAGES12K.quick_n)
    shape = IMAGES12K.fields["image"][0]
    readers = 2 if cfg.quick else 4
    with workspace("memory") as tmp:
        paths = write_fields(tmp, IMAGES12K, n)
        cache = os.path.join(tmp, "cache")
        # This process must not map the cache while the readers are measured: PSS splits each shared page among
        # every process mapping it, so a mapping here would hide part of the readers' share.
        with MmapCachedDataset(cache, src.FieldSource(paths)) as ds:
            ds.fill()
            cache_bytes = sum(os.path.getsize(os.path.join(cache, f["file"])) for f in ds._store.meta["fields"])
        gc.collect()
        # Fresh processes, nothing inherited from this one: forked from a server process that imported torch once
        # (spawning each reader would import it once per reader, seconds each on a small machine).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["benchmark.sources"])
        warm = os.path.join(tmp, "memory-warm-up")
        MmapCachedDataset(warm, src.Synthetic(2 * cfg.batch, shape)).fill()
        np.save(warm + ".npy", np.zeros((2 * cfg.batch, *shape), np.uint8))
        modes = {"cache": (cache, cache_bytes), "private": (paths["image"], os.path.getsize(paths["image"]))}
        go, leave = ctx.Event(), ctx.Event()
        procs, ready, done = [], [], []
        for mode, (path, _) in modes.items():  # both sets run at once: one start-up wait instead of two
            for _ in range(readers):
                ready.append(ctx.Event())
                done.append(ctx.Event())
                procs.append((mode, ctx.Process(target=src.memory_reader,
                                                args=(mode, path, warm, ready[-1], go, done[-1], leave))))
        for _, p in procs:
            p.start()
        try:
            if not all(e.wait(180) for e in ready):
                raise RuntimeError("memory readers did not start within 180 s")
            time.sleep(0.2)
            before = {p.pid: src.pss_kib(p.pid) for _, p in procs}
            go.set()
            if not all(e.wait(300) for e in done):
                raise RuntimeError("memory readers did not finish within 300 s")
            after = {p.pid: src.pss_kib(p.pid) for _, p in procs}
        finally:
            leave.set()
            for _, p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
    load = load_now()
    ratios = {}
    for mode, (_path, size) in modes.items():
        growth = sum(after[p.pid] - before[p.pid] for m, p in procs if m == mode) * 1024
        ratios[mode] = growth / size
        label = f"mmapcache ({readers} processes reading the whole cache)" if mode == "cache" else \
            f"private copies ({readers} processes each loading the array, as TensorDataset)"
        results.row("memory", f"memory: {label}", growth / size, "x data size",
                    f"sum of PSS growth {growth / 2**20:,.0f} MiB for {size / 2**20:,.0f} MiB of data (each process "
                    "first read a small cache/array, so imports and allocator pools are in its baseline)", load)
    results.target("memory.pss", ratios["cache"], load, f"N={n} 12 KB images, {readers} readers")
