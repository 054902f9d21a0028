"""A real PyTorch Lightning job over a cache: ``Trainer(accelerator="cpu", devices=2, strategy=...)`` trains a tiny
model on ``ds.loader(shuffle=True)`` returned by a ``LightningDataModule``, recording every batch's sample indices;
with ``--mixture``, on a ``Mixture``'s loader instead.

Run as a script, with ``tests`` on ``PYTHONPATH`` (Lightning's ``ddp`` starts rank 1 by running this file
again)::

    python lightning_script.py OUT CACHE --strategy ddp --epochs 2 [--every 3] [--epoch-end] [--resume CKPT]
        [--workers N] [--devices 1 --strategy auto] [--seed S] [--mixture] [--kill-at S] [--next OUT2 CACHE2 ...]

Each rank appends ``{"rank", "epoch", "batch", "step", "indices"}`` per training batch to ``OUT/rank<R>.jsonl``;
with ``--every K`` a checkpoint is saved every K steps as ``OUT/ckpt/step=<S>.ckpt``, with ``--epoch-end`` at each
epoch's end as ``OUT/ckpt/epoch=<E>.ckpt``; ``--resume`` continues from one; ``--seed`` calls ``seed_everything``;
``--kill-at S``: every rank SIGKILLs itself as step ``S + 1`` begins (after step ``S``'s checkpoint), the job's end.
The source logs every sample it computes to ``OUT/calls`` (``helpers.sources.Counting``). Each ``--next`` starts
another job's arguments: the jobs run one after the other in this process (each a new ``Trainer``, model and
dataset; ``ddp``'s rank 1 runs them too), so that several resumed jobs pay for one Lightning start-up, not one each.

``--mixture``: the model trains on ``mix.loader(batch_size=8, return_source=True)`` of the mixture jobs' caches in the
folder CACHE (``helpers.mix_sources.job_mixture``, epochs of ``--n`` samples, seed 5), and each record also holds
the batch's ``sources``; the source's calls are not logged.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

import lightning as L  # noqa: N812 - the name Lightning's own documentation uses
import torch

from helpers.mix_sources import job_mixture
from helpers.sources import Counting, Numbered
from mmapcache import MmapCachedDataset


class Data(L.LightningDataModule):
    def __init__(self, cache: str, out: str, n: int, workers: int, mixture: bool) -> None:
        super().__init__()
        self.cache, self.out, self.n, self.workers, self.mixture = cache, out, n, workers, mixture

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        if self.mixture:
            mix = job_mixture(self.cache, epoch_size=self.n, seed=5)
            return mix.loader(batch_size=8, return_source=True, num_workers=self.workers)
        ds = MmapCachedDataset(self.cache, Counting(Numbered(self.n), os.path.join(self.out, "calls")),
                               fingerprint=f"numbered-{self.n}")
        return ds.loader(batch_size=8, shuffle=True, num_workers=self.workers)


class KillAt(L.Callback):
    """SIGKILLs this rank as the batch after step ``step`` begins: a job killed mid-epoch, its checkpoints saved."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class Model(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple[Any, ...], index: int) -> torch.Tensor:
        sources = None
        if isinstance(batch[0], (tuple, list)):  # a mixture's, with return_source: ((x, labels), sources)
            batch, sources = batch
        x, labels = batch
        record = {"rank": self.global_rank, "epoch": self.current_epoch, "batch": index, "step": self.global_step,
                  "indices": labels.tolist()}
        if sources is not None:
            record["sources"] = sources.tolist()
        with open(os.path.join(self.out, f"rank{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("cache")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--n", type=int, default=96)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--every", type=int)
    parser.add_argument("--epoch-end", action="store_true")
    parser.add_argument("--resume")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--mixture", action="store_true")
    parser.add_argument("--kill-at", type=int)
    args = parser.parse_args(argv)
    if args.seed is not None:
        L.seed_everything(args.seed)
    callbacks: list[Any] = [] if args.kill_at is None else [KillAt(args.kill_at)]
    if args.epoch_end:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=os.path.join(args.out, "ckpt"), filename="{epoch}", save_top_k=-1))
    if args.every:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=os.path.join(args.out, "ckpt"), filename="{step}", every_n_train_steps=args.every,
            save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=args.strategy, max_epochs=args.epochs,
                        logger=False, enable_checkpointing=args.every or args.epoch_end, callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    data = Data(args.cache, args.out, args.n, args.workers, args.mixture)
    trainer.fit(Model(args.out), datamodule=data, ckpt_path=args.resume)


if __name__ == "__main__":
    jobs: list[list[str]] = [[]]
    for arg in sys.argv[1:]:
        if arg == "--next":
            jobs.append([])
        else:
            jobs[-1].append(arg)
    for job in jobs:
        main(job)
