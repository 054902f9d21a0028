"""verify(path, source) and streams/rotating shares. At 9534360: an intact stream, and an intact rotating node share
whose rows were filled in another generation, reported differences (row r compared with the sample of slot r's
generation-0 index, not the sample its key names). At 733e343 both are ok, but verify compares no stream row at
all ("uncomparable: a stream keeps no sample for good", even for a deterministic source): a damaged stream value
is served by the loader while verify reports the cache ok (a silent wrong answer)."""

from __future__ import annotations

import os
import sys

from _common import Images, Tokens, scratch, verdict, words

import mmapcache
from mmapcache import MmapCachedDataset
from mmapcache._producer import produce


class _After:
    def __init__(self, count: int) -> None:
        self.count = count

    def is_set(self) -> bool:
        self.count -= 1
        return self.count < 0


def main() -> int:
    with scratch() as path:
        with MmapCachedDataset(path, Tokens(), stream=True, max_bytes=1000, seed=3) as ds:
            produce(path, Tokens, _After(ds._store.slots))
        intact = mmapcache.verify(path, Tokens(), samples=None)
        print(f"intact stream: ok {intact.ok}, {len(intact.differences)} differences")
        x = words(os.path.join(path, "x.npy"))
        x[2] = 0  # the value at sequence number 2
        x.flush()
        damaged = mmapcache.verify(path, Tokens(), samples=None)
        with MmapCachedDataset(path) as ds:
            batch = next(iter(ds.loader(batch_size=5, rank=0, world_size=1)))
        served = batch["x"][2].tolist()
        print(f"damaged stream: served x {served} for index {int(batch['i'][2])}; verify reports the same as intact: "
              f"{damaged.differences == intact.differences and not damaged.problems}")
        wrong = served != Tokens()[int(batch["i"][2])]["x"].tolist()
        stream_bug = not intact.ok or (wrong and damaged.ok)
    with scratch() as path:
        with MmapCachedDataset(path, Images(20), node_share=(1, 3), rotate_every=1, fingerprint="s") as ds:
            ds.fill()
            ds.set_epoch(1)
            ds.fill(ds.cacheable_indices()[:3])  # rows 0..2 now hold generation 1's indices
        share = mmapcache.verify(path, Images(20), samples=None)
        print(f"intact rotating share: ok {share.ok}, differences {share.differences}")
    return verdict(stream_bug or not share.ok,
                   "verify of an intact cache, with its own source, must be ok")


if __name__ == "__main__":
    sys.exit(main())
