"""One rank of the multi-node stream benchmark (``benchmark.groups.streamnodes``), started by torchrun.

``--mode stream``: every rank opens its node's stream (``MMAPCACHE_DIR`` is the node's own), local rank 0 starts
``--producers`` producers and (unless ``--no-fill``) waits for the ring to fill, then every rank reads ``--epochs``
epochs through ``ds.loader()`` (with ``--workers`` DataLoader workers, ``--stream-workers``), sleeping ``--step``
seconds per batch (the training step). ``--mode inline``: the same job with the augmentation done in ``--workers``
DataLoader workers per rank (``DistributedSampler``; 0: in the rank's own process), as without mmapcache.
Each rank writes ``{"epochs": [{"wait", "elapsed", "served", "computed"}], "node": {...}}`` to ``<out>/rank<R>.json``:
the time it waited for its batches, the epoch's time, (stream) its node's values served from the ring and computed by
readers during the epoch, and at the end its node's counters (``produced``, ``served``, ``computed``, ``skipped``,
``ahead``: produced and not yet read when the job ended).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from benchmark.groups.stream import Augmented
from mmapcache import MmapCachedDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", choices=["stream", "inline"], required=True)
    parser.add_argument("--samples", type=int, default=1200)
    parser.add_argument("--work", type=float, default=0.002)
    parser.add_argument("--step", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--stream-workers", type=int, default=0)
    parser.add_argument("--no-fill", action="store_true", help="start reading at once, the ring empty")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    source = Augmented(args.samples, args.work)
    producer, ds = None, None
    if args.mode == "stream":
        per_node = args.samples // 2
        ds = MmapCachedDataset("aug", source, stream=True, seed=0,
                               max_bytes=(per_node // 2) * (3 * 64 * 64 + 8 + 8 + 64))  # half a node's epoch
        if local == 0 and args.producers:
            producer = ds.produce(workers=args.producers)
            deadline = time.monotonic() + 120
            while not args.no_fill and ds.stream_stats["ahead"] < ds.stream_stats["slots"] * 0.9 and \
                    time.monotonic() < deadline:
                time.sleep(0.05)  # the ring fills before training starts, as a prefetcher's buffer would
        loader = ds.loader(batch_size=args.batch_size, num_workers=args.stream_workers)
    else:
        sampler = DistributedSampler(source, seed=0)
        loader = DataLoader(source, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                            persistent_workers=args.workers > 0)
    dist.barrier()
    epochs = []
    for epoch in range(args.epochs):
        if args.mode == "inline":
            sampler.set_epoch(epoch)
        before = ds.stream_stats if ds is not None else None
        waited, start = 0.0, time.perf_counter()
        batches = iter(loader)
        while True:
            asked = time.perf_counter()
            try:
                next(batches)
            except StopIteration:
                break
            waited += time.perf_counter() - asked
            time.sleep(args.step)
        record = {"wait": waited, "elapsed": time.perf_counter() - start}
        dist.barrier()
        if ds is not None and before is not None:
            after = ds.stream_stats
            record.update(served=after["served"] - before["served"], computed=after["computed"] - before["computed"])
        epochs.append(record)
    dist.barrier()
    node = {}
    if ds is not None:
        node = {key: value for key, value in ds.stream_stats.items() if key != "producers"}
    if producer is not None:
        producer.stop()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "epochs": epochs, "node": node}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
