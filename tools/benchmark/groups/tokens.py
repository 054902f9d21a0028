"""Group ``tokens`` (issue 14): ragged int64 token ids through ``ds.loader`` with ``PadCollate`` against a python list
of tensors with the same collate, and the bytes the cache's heap holds against the values' own."""

from __future__ import annotations

import os

from torch.utils.data import DataLoader

from benchmark import sources as src
from benchmark.core import Config, Results, Side, interleave, load_now
from benchmark.epochs import epoch
from benchmark.workloads import TOKENS_N, TOKENS_QUICK_N, workspace, write_packed
from mmapcache import MmapCachedDataset, PadCollate


def run_tokens(cfg: Config, results: Results) -> None:
    """Ragged token ids: the fused padding loader against a python list of tensors, and the heap's bytes."""
    n = cfg.size(TOKENS_N, TOKENS_QUICK_N)
    b = cfg.batch
    with workspace("tokens") as tmp:
        paths = write_packed(tmp, "tokens", n)
        source = src.PackedSource(paths["values"], paths["offsets"], "tokens")
        ds = MmapCachedDataset(os.path.join(tmp, "cache"), source, ragged=["<sample>"])
        try:
            ds.fill()
            tensors = [source[i] for i in range(n)]
            pad = PadCollate(0)
            sides = [Side("loader", epoch(ds.loader(batch_size=b, shuffle=True, collate_fn=pad)), n),
                     Side("list", epoch(DataLoader(tensors, batch_size=b, shuffle=True, collate_fn=pad)), n),
                     Side("dataloader", epoch(DataLoader(ds, batch_size=b, shuffle=True, collate_fn=pad)), n)]
            cmp = interleave(sides, cfg.rounds, min_time=cfg.min_time)
            results.sides("tokens", cmp, {
                "loader": "token ids: mmapcache ds.loader(collate_fn=PadCollate(0)), nw=0",
                "list": "token ids: list of tensors + DataLoader(collate_fn=PadCollate(0)), nw=0",
                "dataloader": "token ids: mmapcache DataLoader(ds, collate_fn=PadCollate(0)), nw=0"},
                note=f"N={n}, lengths 16..512")
            results.compared("tokens.loader_vs_list", cmp, "loader", "list")
            values = sum(t.numel() * t.element_size() for t in tensors)
            index = 8 * (2 + 1) * ds._store.rows  # [offset, nbytes, length] per row
            end, capacity = (int(x) for x in ds._store.heap_counters[0][:2])
            load = load_now()
            results.row("tokens", "token ids: the values' own bytes", values, "bytes", f"N={n}", load)
            results.row("tokens", "token ids: heap end (used bytes)", end, "bytes", "heaps.u64 counter", load)
            results.row("tokens", "token ids: heap capacity", capacity, "bytes", "heaps.u64 counter", load)
            results.row("tokens", "token ids: index bytes (offset, nbytes, length per row)", index, "bytes", "", load)
            results.row("tokens", "ratio token ids: heap capacity + index vs values + index",
                        (capacity + index) / (values + index), "x", "what the files reserve", load)
            results.target("tokens.heap_bytes", (end + index) / (values + index), load,
                           f"heap end {end:,}, capacity {capacity:,}, values {values:,}, index {index:,} bytes")
        finally:
            ds.close()
