"""A rank of a torchrun job that reads a cache through ``ds.loader(shuffle=True)``, with no sampler, for 2 epochs
(``set_epoch`` before each, as with ``DistributedSampler``), and writes the indices it read to ``OUT/rank<R>.json``.
With ``--process-group``, it first joins a gloo process group (else it has only torchrun's environment)."""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist

from helpers.sources import Numbered
from mmapcache import MmapCachedDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("cache")
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--process-group", action="store_true")
    args = parser.parse_args()
    if args.process_group:
        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    with MmapCachedDataset(args.cache, Numbered(args.samples), fingerprint="numbered") as ds:
        loader = ds.loader(batch_size=4, shuffle=True)
        epochs = []
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            epochs.append([index for _, indices in loader for index in indices.tolist()])
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "epochs": epochs, "batches": len(loader)}, f)
    if args.process_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
