"""Fresh augmentation every epoch on a dataset larger than the RAM you give it: the RAM-disk producer, built in.

The scenario people script by hand for ImageNet: an expensive random augmentation that must differ every epoch,
a bounded buffer of ready samples in RAM, and a producer with many workers that prepares them ahead of the trainer,
in the trainer's order, so the trainer never waits. Here the buffer is a stream (``stream=True``): a ring of
``--ring`` of the dataset, each sample computed fresh and served once.

    python examples/fresh_augmentation.py                     # 600 JPEGs, ring of 1/4, 3 epochs, 2 producers
    python examples/fresh_augmentation.py --producers 0       # no producer: the trainer computes everything
    python examples/fresh_augmentation.py --external          # produce from another process instead:
        mmapcache build fresh-aug --dataset examples/fresh_augmentation.py:AugmentedJpegs \\
            --kwargs '{"folder": "...", "size": 96}' --follow --workers 2

Each epoch prints its time, the share of samples served fresh from the ring (the rest the trainer computed itself
because the producer was behind), and the time spent waiting. Every sample served is a new computation: the
script counts repeats and prints 0. The stream is removed at the end (``delete_on_close``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from image_folder import default_folder, generate_images

from mmapcache import MmapCachedDataset


class AugmentedJpegs(Dataset):
    """Every JPEG under ``folder``, decoded, randomly cropped, flipped, colour-jittered and resized to ``size``:
    an augmentation of a few milliseconds that differs on every call. A sample is ``(image, label, draw)``, where
    ``draw`` identifies the random draw (to show that no computation is served twice)."""

    def __init__(self, folder: str, size: int = 96) -> None:
        self.files = sorted(os.path.join(root, name) for root, _, names in os.walk(folder) for name in names
                            if name.lower().endswith((".jpg", ".jpeg")))
        if not self.files:
            raise FileNotFoundError(f"no JPEG files under {folder}")
        self.size = size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        rng = np.random.default_rng()
        draw = int(rng.integers(2**62))
        with Image.open(self.files[i]) as image:
            image = image.convert("RGB")
            w, h = image.size
            side = int(min(w, h) * rng.uniform(0.5, 1.0))
            left, top = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
            image = image.crop((left, top, left + side, top + side)).resize((self.size, self.size),
                                                                            Image.Resampling.BICUBIC)
        pixels = np.asarray(image, dtype=np.float32)
        if rng.random() < 0.5:
            pixels = pixels[:, ::-1]
        pixels = np.clip(pixels * rng.uniform(0.7, 1.3, size=3), 0, 255).astype(np.uint8)  # colour jitter
        return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).contiguous(), i % 4, draw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--ring", type=float, default=0.25, help="the ring's size, as a share of the dataset")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=150.0, help="the training step's time per batch")
    parser.add_argument("--producers", type=int, default=2, help="producer processes started here (0: none)")
    parser.add_argument("--external", action="store_true", help="wait for a producer started elsewhere")
    parser.add_argument("--data-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "mmapcache-examples"))
    parser.add_argument("--cache", default="fresh-aug")
    args = parser.parse_args(argv)

    folder = default_folder(args.data_dir, args.images)
    generate_images(folder, args.images)  # once; an existing set is kept
    source = AugmentedJpegs(folder, args.size)
    sample_bytes = 3 * args.size * args.size + 64
    ds = MmapCachedDataset(args.cache, source, stream=True, max_bytes=int(args.ring * len(source) * sample_bytes),
                           delete_on_close=True, on_miss="wait" if args.external else "compute")
    print(f"stream at {ds.path}: {len(source)} images, a ring of {ds.stream_stats['slots']} samples "
          f"({100 * args.ring:.0f}% of the dataset); {args.producers} producer(s) started here")
    producer = ds.produce(workers=args.producers) if args.producers else None
    loader = ds.loader(batch_size=args.batch_size)
    draws: set[int] = set()
    repeats = 0
    try:
        for epoch in range(args.epochs):
            before = ds.stream_stats
            start = time.perf_counter()
            for _images, _labels, batch_draws in loader:
                batch = batch_draws.tolist()
                repeats += sum(draw in draws for draw in batch)
                draws.update(batch)
                time.sleep(args.step_ms / 1000)  # the training step
            elapsed = time.perf_counter() - start
            after = ds.stream_stats
            served = after["served"] - before["served"]
            computed = after["computed"] - before["computed"]
            waited = after["waited"] - before["waited"]
            print(f"epoch {epoch}: {elapsed:.2f} s, {served} of {served + computed} served fresh from the ring "
                  f"({100 * served / max(1, served + computed):.0f}%), {computed} computed by the trainer, waited "
                  f"{waited:.2f} s ({100 * waited / elapsed:.1f}%)", flush=True)
        print(f"repeated computations served: {repeats}")
    finally:
        if producer is not None:
            producer.stop()
        ds.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
