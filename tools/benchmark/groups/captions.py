"""Group ``captions`` (issue 14): a str field read through ``ds[i]`` and through loaders, against a python list of
the same samples read the same ways."""

from __future__ import annotations

import os

import numpy as np
from torch.utils.data import DataLoader

from benchmark import sources as src
from benchmark.core import Config, Results, Side, info, interleave
from benchmark.epochs import epoch
from benchmark.workloads import CAPTIONS_N, CAPTIONS_QUICK_N, PER_SAMPLE, workspace, write_packed
from mmapcache import MmapCachedDataset


def run_captions(cfg: Config, results: Results) -> None:
    """A str field read through ``ds[i]`` against a python list of the same samples indexed the same way."""
    n = cfg.size(CAPTIONS_N, CAPTIONS_QUICK_N)
    b = cfg.batch
    with workspace("captions") as tmp:
        paths = write_packed(tmp, "captions", n)
        source = src.PackedSource(paths["values"], paths["offsets"], "captions", paths["labels"])
        ds = MmapCachedDataset(os.path.join(tmp, "cache"), source)
        try:
            ds.fill()
            samples = [source[i] for i in range(n)]
            order = np.random.default_rng(2).permutation(n)[:PER_SAMPLE].tolist()

            def read_ds() -> None:
                for i in order:
                    ds[i]

            def read_list() -> None:
                for i in order:
                    samples[i]

            sides = [Side("ds", read_ds, len(order)), Side("list", read_list, len(order)),
                     Side("loader_ds", epoch(DataLoader(ds, batch_size=b, shuffle=True)), n),
                     Side("loader_list", epoch(DataLoader(samples, batch_size=b, shuffle=True)), n),
                     Side("loader", epoch(ds.loader(batch_size=b, shuffle=True)), n)]
            cmp = interleave(sides, cfg.rounds, min_time=cfg.min_time)
            results.sides("captions", cmp, {
                "ds": "str captions: mmapcache ds[i]", "list": "str captions: list[i]",
                "loader_ds": "str captions: mmapcache DataLoader(ds), default collate, nw=0",
                "loader_list": "str captions: DataLoader(list), default collate, nw=0",
                "loader": "str captions: mmapcache ds.loader(), nw=0"},
                note=f"N={n}, 20..200 chars + int label")
            results.compared("captions.getitem_vs_list", cmp, "ds", "list", "list[i] returns a reference, no copy")
            info(results, "captions", cmp, "loader_ds", "loader_list",
                 "str captions: DataLoader(ds) vs DataLoader(list)")
            info(results, "captions", cmp, "loader", "loader_list", "str captions: ds.loader vs DataLoader(list)")
        finally:
            ds.close()
