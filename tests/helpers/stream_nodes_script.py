"""One rank of a stream job over several nodes, started by torchrun (``python -m torch.distributed.run``).

Every rank opens its node's stream (``MMAPCACHE_DIR`` is the node's own), local rank 0 starts ``--producers``
producer processes, and every rank reads ``--epochs`` epochs through ``ds.loader()``, writing each batch's indices
and tokens (one per computation: ``helpers.stream_sources.Fresh``) to ``<results>/rank<R>.json``, with its node's
counters. The node's source calls are logged to ``--calls`` (``helpers.sources.Counting``).

``--delay S``: seconds of work per sample; ``--step S``: seconds per batch, the training step the producers get ahead
of. ``--kill-producer E``: local rank 0 SIGKILLs its producers halfway through epoch ``E`` and starts new ones.
``--resume-at K``: in epoch 1 every rank takes rank 0's state after ``K`` batches (a checkpoint), reads on to the
epoch's end, then reads the rest again through a new loader given that state; both are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import torch.distributed as dist

from helpers.rank_exit import exit_now
from helpers.sources import Counting
from helpers.stream_sources import Fresh, intact
from mmapcache import MmapCachedDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", required=True)
    parser.add_argument("--calls", required=True)
    parser.add_argument("--samples", type=int, default=598)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--producers", type=int, default=1)
    parser.add_argument("--max-bytes", default="24K")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds of work per sample (an augmentation)")
    parser.add_argument("--step", type=float, default=0.0, help="seconds per batch (the training step)")
    parser.add_argument("--kill-producer", type=int, default=-1)
    parser.add_argument("--resume-at", type=int, default=-1)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    source = Counting(Fresh(args.samples, args.delay), args.calls)
    ds = MmapCachedDataset("aug", source, stream=True, max_bytes=args.max_bytes, seed=3)
    producer = ds.produce(workers=args.producers) if local == 0 else None
    dist.barrier()
    loader = ds.loader(batch_size=args.batch_size, num_workers=args.workers)
    out: dict[str, Any] = {"rank": rank, "epochs": [], "intact": True, "batches": len(loader)}
    for epoch in range(args.epochs):
        read: list[dict[str, list[int]]] = []
        for k, batch in enumerate(loader):
            out["intact"] &= intact(batch)
            read.append({"i": batch["i"].tolist(), "token": batch["token"].tolist()})
            time.sleep(args.step)
            if epoch == args.kill_producer and k == len(loader) // 2 and producer is not None:
                for pid in ds.stream_stats["producers"]:
                    os.kill(pid, signal.SIGKILL)
                producer.stop()
                producer = ds.produce(workers=args.producers)
            if epoch == 1 and k + 1 == args.resume_at:
                state = [loader.state_dict() if rank == 0 else None]
                dist.broadcast_object_list(state, src=0)  # what a trainer saves (rank 0's) and gives every rank
                out["state"] = state[0]
        out["epochs"].append(read)
        dist.barrier()  # the ranks read in step, as a trainer's gradient steps keep them
    if args.resume_at >= 0:
        again = ds.loader(batch_size=args.batch_size, num_workers=args.workers)
        again.load_state_dict(out["state"])
        out["resumed"] = [b["i"].tolist() for b in again]
        del out["state"]
    dist.barrier()
    if producer is not None:
        producer.stop()
    out["stats"] = {k: v for k, v in ds.stream_stats.items() if k != "producers"}
    out["split"] = ds.stream_split.to_json()
    dist.barrier()
    ds.close()
    dist.destroy_process_group()
    with open(os.path.join(args.results, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
    exit_now()
