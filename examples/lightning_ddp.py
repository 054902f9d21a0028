"""PyTorch Lightning on a cached image folder: DDP over 2 ranks, ``ds.loader()`` in a ``LightningDataModule``, a
checkpoint every few steps, and an exact resume from one saved mid-epoch.

    python examples/lightning_ddp.py                                   # 2 CPU ranks (gloo), 2 epochs, checkpoints
    python examples/lightning_ddp.py --resume lightning-ckpt/last.ckpt # a new Trainer continues mid-epoch, exactly

What the cache changes: each node decodes every JPEG once, and its ranks (and their DataLoader workers) read one
shared copy from /dev/shm. What ``ds.loader()`` does for Lightning: its sampler is a ``DistributedSampler``, so
Lightning keeps it (instead of wrapping it), and it splits each epoch across the ranks as ``DistributedSampler``
would, with Lightning's ``set_epoch``; Lightning saves its ``state_dict()`` in every checkpoint and restores it on
resume, so the resumed run reads exactly the batches the interrupted one had left (each rank its own part).

Needs ``pip install lightning`` (not torchvision: this example makes its own JPEGs and model). On GPUs:
``--accelerator gpu --devices 8``. The images come from ``image_folder.py`` (synthetic JPEGs generated once into
``--data-dir``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import lightning as L  # noqa: N812 - the name Lightning's own documentation uses
import torch
from image_folder import JpegFolder, RandomCropFlip, default_folder, generate_images
from lightning.pytorch.callbacks import ModelCheckpoint

from mmapcache import MmapCachedDataset


class CachedImages(L.LightningDataModule):
    """A folder of JPEGs, decoded and resized once into a cache; random crops and flips after it."""

    def __init__(self, folder: str, cache: str, size: int, crop: int, batch_size: int, workers: int) -> None:
        super().__init__()
        self.folder, self.cache, self.size, self.crop = folder, cache, size, crop
        self.batch_size, self.workers = batch_size, workers

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        source = JpegFolder(self.folder, self.size)
        # Called in every rank once the process group exists: the ranks of a node open (or one creates) one cache.
        ds = MmapCachedDataset(self.cache, source, fingerprint=source.fingerprint(),
                               transform=RandomCropFlip(self.crop))
        # No sampler: ds.loader splits each epoch across the job's ranks itself, and Lightning leaves it so.
        return ds.loader(batch_size=self.batch_size, shuffle=True, num_workers=self.workers,
                         persistent_workers=self.workers > 0)


class SmallNet(L.LightningModule):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2), torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 3, stride=2),
            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, classes))
        self.started = time.perf_counter()
        self.first = True

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self.net(images.float() / 255), labels)
        if self.first and (index or self.current_epoch):  # a resumed run starts where the checkpoint was
            print(f"rank {self.global_rank}: resumed at epoch {self.current_epoch} batch {index}", flush=True)
        self.first = False
        if index == 0 or self.trainer.is_last_batch:
            elapsed = time.perf_counter() - self.started
            print(f"rank {self.global_rank}: epoch {self.current_epoch} batch {index} (step {self.global_step}), "
                  f"loss {loss.item():.3f}, {elapsed:.1f} s", flush=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", help="a folder of JPEG files (default: synthetic ones under --data-dir)")
    parser.add_argument("--data-dir", default=os.path.expanduser("~/.cache/mmapcache-examples"))
    parser.add_argument("--images", type=int, default=256, help="synthetic JPEGs to generate (without --folder)")
    parser.add_argument("--size", type=int, default=40, help="side the images are resized to before caching")
    parser.add_argument("--crop", type=int, default=32, help="side of the random crop after the cache")
    parser.add_argument("--cache", default="lightning-example", help="cache name or path")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--checkpoints", default="lightning-ckpt", help="where checkpoints go")
    parser.add_argument("--every", type=int, default=5, help="save a checkpoint every this many steps")
    parser.add_argument("--resume", help="a checkpoint to continue from (e.g. lightning-ckpt/last.ckpt)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = args.folder or default_folder(args.data_dir, args.images)
    if args.folder is None and not os.path.isdir(folder) and os.environ.get("LOCAL_RANK", "0") == "0":
        generate_images(folder, args.images)  # rank 0, before Lightning starts the others
    data = CachedImages(folder, args.cache, args.size, args.crop, args.batch_size, args.workers)
    checkpoints = ModelCheckpoint(dirpath=args.checkpoints, every_n_train_steps=args.every, save_last=True,
                                  save_top_k=-1, filename="{epoch}-{step}")
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy="ddp", max_epochs=args.epochs,
                        callbacks=[checkpoints], logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(SmallNet(classes=4), datamodule=data, ckpt_path=args.resume)
    if trainer.global_rank == 0:
        print(f"done: {trainer.global_step} steps; checkpoints in {os.path.abspath(args.checkpoints)}; resume with "
              f"`python {sys.argv[0]} --resume {os.path.join(args.checkpoints, 'last.ckpt')}`", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
