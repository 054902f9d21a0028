"""One rank of a node-share test job, started by torchrun (``python -m torch.distributed.run``).

Every rank opens its node's cache with ``node_share=True`` (the node and node count come from torchrun's
environment), fills it cooperatively with ``prefill``, then reads ``--epochs`` epochs through
``ds.loader(sampler=ds.sampler())``, checking every batch against the source, and writes what it saw (its node's
share, the indices it read per epoch, the source calls made while reading) to ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch.distributed as dist

from helpers.rank_exit import exit_now
from helpers.sources import Counting, ImageLabels
from mmapcache import MmapCachedDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", required=True)
    parser.add_argument("--calls", required=True, help="file logging this node's source calls")
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    source = ImageLabels(args.samples)
    ds = MmapCachedDataset("cache", Counting(source, args.calls), fingerprint="share-test", node_share=True)
    ds.prefill()  # ends with torch.distributed.barrier(): the whole job's shares are filled
    calls_after_prefill = len(Counting(source, args.calls).calls())
    sampler = ds.sampler(shuffle=True, seed=3)
    loader = ds.loader(batch_size=args.batch_size, sampler=sampler)
    epochs, correct = [], True
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        read = sampler.epoch_indices().tolist()
        got = [label for _, labels in loader for label in labels.tolist()]
        correct &= got == [source[i][1] for i in read]
        epochs.append(read)
    dist.barrier()  # every rank has read every epoch before anyone counts the source calls
    share = ds.share
    result = {
        "rank": rank, "node": share.node, "nodes": share.nodes, "share": share.indices(len(ds)).tolist(),
        "cacheable": ds.cacheable_indices().tolist(), "num_cached": ds.num_cached, "epochs": epochs,
        "correct": correct, "calls_after_prefill": calls_after_prefill,
        "calls_after_epochs": len(Counting(source, args.calls).calls()),
        "stored_keys": np.unique(ds._store.state.keys_np[ds._store.state.filled_mask()]).tolist(),
    }
    dist.barrier()
    ds.close()
    dist.destroy_process_group()
    with open(os.path.join(args.results, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    exit_now()
