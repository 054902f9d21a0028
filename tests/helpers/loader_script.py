"""A rank of a torchrun job that reads a cache through ``ds.loader(shuffle=True)``, with no sampler, for 2 epochs
(``set_epoch`` before each, as with ``DistributedSampler``), twice: first with only torchrun's environment to find
its rank by, then after joining a gloo process group, through a new dataset and loader. It writes the indices each
phase read to ``OUT/rank<R>.json``."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch.distributed as dist

from helpers.rank_exit import exit_now
from helpers.sources import Numbered
from mmapcache import MmapCachedDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("cache")
    parser.add_argument("--samples", type=int, default=50)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    phases = {"environment": _read(args.cache, args.samples)}
    dist.init_process_group("gloo")
    phases["process group"] = _read(args.cache, args.samples)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, **phases}, f)
    dist.destroy_process_group()


def _read(cache: str, samples: int) -> dict[str, Any]:
    """The indices each of 2 epochs read on this rank, and the loader's length."""
    with MmapCachedDataset(cache, Numbered(samples), fingerprint="numbered") as ds:
        loader = ds.loader(batch_size=4, shuffle=True)
        epochs = []
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            epochs.append([index for _, indices in loader for index in indices.tolist()])
    return {"epochs": epochs, "batches": len(loader)}

if __name__ == "__main__":
    main()
    exit_now()
