"""Group ``nodeshare`` (issue 13): two node shares of one dataset, each in its own cache (two "nodes" on one
machine: the read path is the same as on two), against a full cache of the same per-rank size on one node.

Measured, interleaved: a warm epoch's read rate of a rank on its node's share over the full cache's; and how many
source reads the warm epochs made (none, without rotation).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from benchmark.core import Config, Results, Side, interleave, load_now
from benchmark.epochs import raw_gather
from benchmark.workloads import workspace
from mmapcache import MmapCachedDataset


class _Counting(Dataset):
    """A fixed-shape source that counts its calls (in this process)."""

    def __init__(self, images: np.ndarray) -> None:
        self.images, self.calls = images, 0

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Any:
        self.calls += 1
        return torch.from_numpy(self.images[i].copy()), i


def run_nodeshare(cfg: Config, results: Results) -> None:
    n = cfg.size(40000, 2000)
    images = np.random.default_rng(0).integers(0, 256, (n, 3, 64, 64), dtype=np.uint8)
    with workspace("nodeshare") as tmp:
        source = _Counting(images)
        nodes = [MmapCachedDataset(os.path.join(tmp, f"node{k}"), source, node_share=(k, 2), fingerprint="bench")
                 for k in range(2)]
        for node in nodes:
            node.prefill(rank=0, world_size=1, barrier=False)
        first_epoch_reads = source.calls
        full = MmapCachedDataset(os.path.join(tmp, "full"), _Counting(images[: n // 2]), fingerprint="bench")
        full.fill()
        sampler = nodes[0].sampler(rank=0, world_size=1, shuffle=True)
        share_loader = nodes[0].loader(batch_size=cfg.batch, sampler=sampler)
        full_loader = full.loader(batch_size=cfg.batch, shuffle=True)
        epoch = [0]

        def share_epoch() -> None:
            epoch[0] += 1
            sampler.set_epoch(epoch[0])
            for _ in share_loader:
                pass

        def full_epoch() -> None:
            for _ in full_loader:
                pass

        # The same raw gather over each cache's own rows: what their memory alone gives, no code of ours.
        sides = [Side("share", share_epoch, len(sampler)), Side("full", full_epoch, n // 2),
                 Side("raw_share", raw_gather(nodes[0], n // 2, cfg.batch), n // 2),
                 Side("raw_full", raw_gather(full, n // 2, cfg.batch), n // 2)]
        comparison = interleave(sides, cfg.rounds, min_time=cfg.min_time)
        warm_reads = source.calls - first_epoch_reads
        results.sides("nodeshare", comparison, {"share": "node share: rank 0 of node 0 of 2, ds.loader+ds.sampler",
                                                "full": "full cache of the same per-rank size, ds.loader",
                                                "raw_share": "node share: raw sorted np.take over its rows",
                                                "raw_full": "full cache: raw sorted np.take over its rows"})
        results.compared("nodeshare.read_rate", comparison, "share", "full",
                         f"N={n}, 12 KB images, 2 nodes simulated as 2 caches on one machine")
        results.row("nodeshare", "ratio node share vs full cache, raw np.take over each one's rows",
                    comparison.ratio("raw_share", "raw_full"), "x", "interleaved, from best rounds",
                    comparison.load())
        results.target("nodeshare.source_reads", warm_reads, load_now(),
                       f"source reads during {sum(len(m.rounds) + 1 for m in comparison.sides.values())} warm epochs "
                       f"of node 0 (the first epoch read {first_epoch_reads}, once per index)")
        for ds in [*nodes, full]:
            ds.close()
