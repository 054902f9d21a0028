"""A weighted mixture of three caches, a curriculum, a loss per source, and a resume on another number of ranks.

    python examples/mixture.py                      # 3 epochs of web 70% / code 20% / curated 10%
    python examples/mixture.py --epochs 4 --batch-size 32 --cache-dir /dev/shm/mix-example

Three token corpora (synthetic stand-ins for tokenized web text, code and a small curated set) are cached once each
with their own preprocessing, then read as one ``Mixture``: each epoch holds 70/20/10 of ``--epoch-size`` samples
(the curated set, smaller than its share, is repeated whole before any sample repeats twice), from epoch 2 on the
weights move towards the curated set (a curriculum), every batch is padded with ``PadCollate`` and comes with the
source of each sample, to log a loss per source. Half-way through an epoch the loader's state is saved, and a
"resumed job" of 2 ranks (``rank=``/``world_size=`` here; under torchrun the job's own) reads the rest of that
epoch: over its ranks, exactly the samples the interrupted job had left.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import torch
from torch.utils.data import Dataset

from mmapcache import Mixture, MmapCachedDataset, PadCollate


class Tokens(Dataset):
    """``{"input_ids": int64 token ids, "label": int}`` of a corpus ``kind``: 8..200 tokens, 1 ms of "tokenizing"."""

    def __init__(self, kind: int, n: int) -> None:
        self.kind, self.n = kind, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor | int]:
        time.sleep(0.001)
        g = torch.Generator().manual_seed(self.kind * 1_000_003 + i)
        length = int(torch.randint(8, 200, (), generator=g))
        return {"input_ids": torch.randint(1, 32000, (length,), generator=g), "label": self.kind}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=os.environ.get("MMAPCACHE_DIR", "/dev/shm/mmapcache"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--epoch-size", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    sizes = {"web": 2000, "code": 500, "curated": 40}
    caches = {name: MmapCachedDataset(os.path.join(args.cache_dir, f"mixture-example-{name}"), Tokens(k, n),
                                      fingerprint=f"tokens-{name}-v1")
              for k, (name, n) in enumerate(sizes.items())}
    mix = Mixture(caches, weights={"web": 0.7, "code": 0.2, "curated": 0.1}, epoch_size=args.epoch_size, seed=0)
    pad = PadCollate(0, fields=["input_ids"])
    loader = mix.loader(batch_size=args.batch_size, collate_fn=pad, return_source=True)
    print(f"per epoch: {mix.counts()} of {len(mix)} samples")

    for epoch in range(args.epochs):
        mix.set_epoch(epoch)
        if epoch == 2:
            mix.set_weights({"web": 0.5, "code": 0.2, "curated": 0.3})  # a curriculum: from this epoch on
        started, seen = time.perf_counter(), collections.Counter()
        losses: dict[str, list[float]] = collections.defaultdict(list)
        for batch, sources in loader:
            ids = batch["input_ids"]
            loss = ids.data.float().mean(dim=1) / 32000  # a stand-in for the model's per-sample loss
            for k, name in enumerate(mix.names):
                mine = sources == k
                if mine.any():
                    losses[name].append(float(loss[mine].mean()))
                    seen[name] += int(mine.sum())
        print(f"epoch {epoch}: {dict(seen)} in {time.perf_counter() - started:.2f} s; mean loss per source "
              f"{ {name: round(sum(v) / len(v), 4) for name, v in losses.items()} }")

    # A job interrupted half-way through the next epoch, resumed by a job of 2 ranks.
    mix.set_epoch(args.epochs)
    batches = iter(loader)
    head = [next(batches) for _ in range(len(loader) // 2)]
    state = loader.state_dict()
    rest = collections.Counter(i for batch, _ in batches for i in batch["label"].tolist())
    resumed = collections.Counter()
    for rank in range(2):
        again = Mixture(caches, weights={"web": 0.7, "code": 0.2, "curated": 0.1}, epoch_size=args.epoch_size, seed=0)
        part = again.loader(batch_size=args.batch_size, collate_fn=pad, rank=rank, world_size=2)
        part.load_state_dict(state)
        resumed += collections.Counter(i for batch in part for i in batch["label"].tolist())
    padding = sum((resumed - rest).values())
    print(f"resumed on 2 ranks after {len(head)} of {len(loader)} batches: {sum(rest.values())} samples left, "
          f"{sum(resumed.values())} read by the 2 ranks ({padding} of padding), the same sources: "
          f"{not (rest - resumed)}")


if __name__ == "__main__":
    main()
