"""One rank of a distributed test job, started by torchrun (``python -m torch.distributed.run``).

Every rank opens the node's cache (``$MMAPCACHE_DIR/<name>``; torchrun launches on "different nodes" get different
``MMAPCACHE_DIR``s), fills it cooperatively with ``prefill``, checks every sample against the source, takes part
in an ``all_reduce`` over the whole job, and writes what it saw to ``<out>/rank<R>.json`` for the test to check.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from helpers.rank_exit import exit_now
from helpers.sources import Counting, ImageLabels, sample_equal
from mmapcache import MmapCachedDataset
from mmapcache.distributed import local_rank_and_size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", required=True)
    parser.add_argument("--cache-name", required=True)
    parser.add_argument("--calls", required=True, help="file counting source calls (one per node)")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--delay", type=float, default=0.002)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    source = ImageLabels(args.samples, delay=args.delay)
    # ragged=None: the creator stores sample 0 only (no layout probes), so the shares prefill fills are exact.
    ds = MmapCachedDataset(args.cache_name, Counting(source, args.calls), fingerprint="dist-test",
                           delete_on_close=False, ragged=None)
    local_rank, local_world = local_rank_and_size(ds.path)
    stored = ds.prefill()  # barrier: torch.distributed.barrier(), so every rank of the job is done here
    cached_after_prefill = ds.num_cached
    samples_ok = all(sample_equal(ds[i], source[i]) for i in range(len(ds)))
    # Proves the ranks formed one job: every rank contributes rank + 1.
    total = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(total)
    st = os.stat(ds.path)
    result = {
        "rank": rank, "world": world, "local_rank": local_rank, "local_world": local_world,
        "node": int(os.environ.get("GROUP_RANK", "-1")), "path": ds.path, "cache_id": [st.st_dev, st.st_ino],
        "stored": stored, "cached_after_prefill": cached_after_prefill, "samples_ok": samples_ok,
        "all_reduce": int(total.item()),
    }
    dist.barrier()  # nobody closes (or exits) before everyone has read
    ds.close()
    dist.destroy_process_group()
    with open(os.path.join(args.results, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    exit_now()
