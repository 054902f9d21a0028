"""Hugging Face's ``Trainer`` under torchrun, reading ``ds.loader`` by the guide's recipe (``helpers.trainer_recipe``)
over a ``Tokenized`` cache of 48 samples, 2 epochs, a checkpoint every 2 steps::

    torchrun --nproc-per-node=2 trainer_script.py CACHE OUT RESULTS [--resume CHECKPOINT]

Each rank writes ``RESULTS/rank<R>.json``: ``{"rank", "seen": each batch's indices, "losses"}``."""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers

from helpers.rank_exit import exit_now
from helpers.text_sources import Tokenized
from helpers.trainer_recipe import train
from mmapcache import MmapCachedDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache")
    parser.add_argument("out")
    parser.add_argument("results")
    parser.add_argument("--resume")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    seen: list[list[int]] = []
    with MmapCachedDataset(args.cache, Tokenized(48, longest=10)) as ds:
        losses = train(transformers, ds, args.out, args.resume, seen, batch_size=4)
    with open(os.path.join(args.results, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "seen": seen, "losses": losses}, f)
    exit_now()  # (Trainer leaves its gloo group up: torch's shutdown aborted a finished rank, see helpers.rank_exit)


if __name__ == "__main__":
    main()
