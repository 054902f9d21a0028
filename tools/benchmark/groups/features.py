"""Group ``features``: partial caching (``max_bytes``) and ``variants`` against the source calls they save.

Builds what it needs in its own ``workspace``; sides that give a ratio are measured interleaved
(``benchmark.core.interleave``), like the workload groups.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid

from torch.utils.data import DataLoader

from benchmark import sources as src
from benchmark.core import Config, Results, Side, Timed, interleave
from benchmark.epochs import epoch
from benchmark.workloads import workspace
from mmapcache import MmapCachedDataset
from mmapcache.format.layout import Layout


def run_features(cfg: Config, results: Results) -> None:
    """Partial caching (max_bytes) and variants against the source they save calls to, interleaved."""
    n = 100 if cfg.quick else 2000
    shape = (3, 32, 32)
    b = cfg.batch
    rounds = min(cfg.rounds, 3)
    source = src.Synthetic(n, shape, delay=1e-3)
    row_bytes = Layout.from_sample(source[0]).row_bytes
    with workspace("features") as tmp:
        sides = [Side("source", epoch(DataLoader(source, batch_size=b, shuffle=True)), n)]
        caches = []
        for fraction in (0.25, 0.5, 1.0):
            # The budget also pays for per-row state, so a fraction of the data bytes caches slightly fewer rows;
            # the full row runs without a budget.
            budget = int(fraction * n) * row_bytes if fraction < 1 else None
            ds = MmapCachedDataset(os.path.join(tmp, f"partial-{fraction}"), source, max_bytes=budget)
            for _ in ds.loader(batch_size=b, shuffle=True):  # fill what fits
                pass
            caches.append(ds)
            sides.append(Side(f"{fraction:.0%}", epoch(ds.loader(batch_size=b, shuffle=True)), n))
        cmp = interleave(sides, rounds, min_time=cfg.min_time)
        labels = {"source": "features: source only (1 ms/sample busy CPU), one shuffled epoch"}
        for fraction, ds in zip((0.25, 0.5, 1.0), caches):
            labels[f"{fraction:.0%}"] = f"features: warm epoch, {fraction:.0%} cached" + (
                " (max_bytes)" if fraction < 1 else "") + f", {ds.num_cacheable}/{n} cacheable"
            ds.close()
        results.sides("features", cmp, labels, note="misses go to the source")
        for key in ("25%", "50%"):
            results.row("features", f"ratio features: {key} cached vs source only", cmp.ratio(key, "source"), "x",
                        "interleaved, from best rounds", cmp.load())

        n_var, epochs = (50 if cfg.quick else 500), 8
        augmented = src.Augmented(n_var, shape, delay=1e-3)

        def recompute() -> None:
            for _ in range(epochs):
                for _ in DataLoader(augmented, batch_size=b, shuffle=True):
                    pass

        def variants() -> Timed:
            path = os.path.join(tmp, f"variants-{uuid.uuid4().hex[:8]}")
            start = time.perf_counter()
            ds = MmapCachedDataset(path, augmented, variants=4)
            for e in range(epochs):
                ds.set_epoch(e)
                for _ in ds.loader(batch_size=b, shuffle=True):
                    pass
            seconds = time.perf_counter() - start
            ds.close()
            shutil.rmtree(path)
            return Timed(n_var * epochs, seconds)

        cmp = interleave([Side("recompute", recompute, n_var * epochs, autorange=False),
                          Side("variants", variants, autorange=False)], rounds, warmup=0)
    results.sides("features", cmp, {
        "recompute": f"features: recompute a 1 ms augmentation every epoch ({epochs} epochs, N={n_var})",
        "variants": f"features: variants=4, augmentation computed once per variant ({epochs} epochs)"})
    results.row("features", "ratio features: variants=4 vs recompute", cmp.ratio("variants", "recompute"), "x",
                "epochs 1-4 fill the 4 variants, epochs 5-8 read them", cmp.load())
