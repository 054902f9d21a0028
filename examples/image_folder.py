"""A folder of JPEG files, decoded and resized by a slow dataset, cached once in shared memory.

The first epoch decodes every JPEG (the slow part) and stores the resized image; every later epoch, in this
process, its DataLoader workers, or any other process that opens the same cache, copies it out of /dev/shm.
Random crop and flip run after the cache (``transform=``), so every epoch still sees fresh augmentations.

    python examples/image_folder.py                       # generates 512 JPEGs on first run, 3 epochs
    python examples/image_folder.py --folder ~/photos --size 224 --epochs 5 --workers 4

Without ``--folder``, synthetic JPEGs are generated once into ``--data-dir`` (default
``~/.cache/mmapcache-examples``). The cache persists (run it twice: the second run is warm from its first epoch);
remove it with ``mmapcache rm NAME``. Nothing of yours is removed or modified.

``JpegFolder`` is also a dataset spec for the command line (see ``examples/prewarm.sh``):
``mmapcache build NAME --dataset examples/image_folder.py:JpegFolder --kwargs '{"folder": "...", "size": 128}'``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from mmapcache import MmapCachedDataset

EXTENSIONS = (".jpg", ".jpeg", ".JPG", ".JPEG")
# Everything that changes the cached pixels: part of the fingerprint, so changing it never serves stale images.
PREPROCESS_VERSION = 1


class JpegFolder(Dataset):
    """Every JPEG under ``folder`` (sorted paths), decoded to RGB and resized to ``size`` x ``size``.

    A sample is ``(image, label)``: a uint8 tensor ``(3, size, size)`` and the index of the file's parent
    directory among all parent directories (class folders, as in the usual ``root/class/x.jpg`` layout).

    Args:
        folder: the directory searched recursively for ``.jpg``/``.jpeg`` files.
        size: the side of the square the images are resized to.
    """

    def __init__(self, folder: str, size: int = 128) -> None:
        self.folder = os.path.abspath(os.path.expanduser(folder))
        if not os.path.isdir(self.folder):
            raise FileNotFoundError(f"{self.folder} is not a directory; pass --folder with a folder of JPEG files")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        self.size = size
        self.files = sorted(
            os.path.join(root, name)
            for root, _, names in os.walk(self.folder) for name in names if name.endswith(EXTENSIONS)
        )
        if not self.files:
            raise FileNotFoundError(f"no .jpg/.jpeg files under {self.folder}; pass a folder of JPEG images")
        classes = sorted({os.path.dirname(f) for f in self.files})
        index = {c: i for i, c in enumerate(classes)}
        self.labels = [index[os.path.dirname(f)] for f in self.files]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[i]) as image:
            image = image.convert("RGB").resize((self.size, self.size), Image.Resampling.BICUBIC)
            pixels = np.array(image)  # a writable copy: torch warns about read-only numpy arrays
        return torch.from_numpy(pixels).permute(2, 0, 1).contiguous(), self.labels[i]

    def fingerprint(self) -> str:
        """Identifies the source: every file's relative path, size and modification time, plus the
        preprocessing config. A different folder content or config gives a different cache, never stale data."""
        digest = hashlib.sha256()
        config = {"size": self.size, "resample": "bicubic", "mode": "RGB", "version": PREPROCESS_VERSION}
        digest.update(json.dumps(config, sort_keys=True).encode())
        for path in self.files:
            st = os.stat(path)
            digest.update(f"{os.path.relpath(path, self.folder)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return f"jpeg-folder:{digest.hexdigest()[:32]}"


class RandomCropFlip:
    """Random crop to ``crop`` x ``crop`` and random horizontal flip of an ``(image, label)`` sample, in torch
    (runs after the cache, in each DataLoader worker, with the worker's own seed)."""

    def __init__(self, crop: int) -> None:
        self.crop = crop

    def __call__(self, sample: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
        image, label = sample
        _, height, width = image.shape
        top = int(torch.randint(0, height - self.crop + 1, ()))
        left = int(torch.randint(0, width - self.crop + 1, ()))
        image = image[:, top:top + self.crop, left:left + self.crop]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image.contiguous(), label


def generate_images(folder: str, count: int, classes: int = 4, seed: int = 0) -> None:
    """Writes ``count`` synthetic 640x480 JPEGs into ``folder/class_k/`` (once; an existing set is kept).

    Written into a temporary directory and renamed, so an interrupted run never leaves a half-made folder.
    """
    if os.path.isdir(folder):
        return
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    partial = f"{folder}.partial-{os.getpid()}"
    rng = np.random.default_rng(seed)
    x, y, channel = np.arange(640.0), np.arange(480.0), np.arange(3.0)
    noise = rng.integers(-12, 13, (480, 640, 3), dtype=np.int16)
    for i in range(count):
        label = i % classes
        # Colour waves plus noise, so the files decode like photos (a flat image compresses to nothing). Waves
        # are separable (a row plus a column), which keeps generating a few hundred files to a few seconds.
        fx, fy, phase = rng.uniform(0.005, 0.05, 3)
        rows = np.cos(y[:, None] * fy - channel) * 60
        cols = np.sin(x[:, None] * fx + phase * channel) * 60
        shifted = np.roll(noise, int(rng.integers(0, 640)), axis=1)
        pixels = (rows[:, None, :] + cols[None, :, :] + 128 + shifted).clip(0, 255).astype(np.uint8)
        directory = os.path.join(partial, f"class_{label}")
        os.makedirs(directory, exist_ok=True)
        Image.fromarray(pixels).save(os.path.join(directory, f"img_{i:05d}.jpg"), quality=90)
    try:
        os.rename(partial, folder)
    except OSError:  # another run generated it meanwhile
        import shutil

        shutil.rmtree(partial, ignore_errors=True)


def default_folder(data_dir: str, count: int) -> str:
    return os.path.join(os.path.expanduser(data_dir), f"jpegs-{count}")


def cache_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--folder", help="a folder of JPEG files (default: synthetic images in --data-dir)")
    parser.add_argument("--images", type=int, default=512, help="how many synthetic JPEGs to generate")
    parser.add_argument("--data-dir", default=os.environ.get("MMAPCACHE_EXAMPLE_DATA", "~/.cache/mmapcache-examples"),
                        help="where synthetic JPEGs are generated (once)")
    parser.add_argument("--size", type=int, default=128, help="images are resized to SIZE x SIZE before caching")
    parser.add_argument("--crop", type=int, help="random crop after the cache (default: 7/8 of --size)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="DataLoader workers")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--cache", default="image-folder-example",
                        help="cache path, or a bare name under $MMAPCACHE_DIR (default /dev/shm/mmapcache)")
    parser.add_argument("--prepare", action="store_true",
                        help="only make sure the folder exists and print 'FOLDER<TAB>FINGERPRINT' (for prewarm.sh)")
    args = parser.parse_args(argv)
    for name in ("images", "size", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.workers < 0:
        parser.error("--workers must be >= 0")
    args.crop = args.crop or max(1, args.size * 7 // 8)
    if not 1 <= args.crop <= args.size:
        parser.error(f"--crop must be between 1 and --size ({args.size})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.folder is None:
        args.folder = default_folder(args.data_dir, args.images)
        if not os.path.isdir(args.folder):
            print(f"generating {args.images} synthetic 640x480 JPEGs into {args.folder} (once) ...", file=sys.stderr)
            generate_images(args.folder, args.images)
    source = JpegFolder(args.folder, args.size)
    if args.prepare:
        print(f"{source.folder}\t{source.fingerprint()}")
        return 0

    ds = MmapCachedDataset(args.cache, source, fingerprint=source.fingerprint(), transform=RandomCropFlip(args.crop))
    print(f"source: {len(source)} JPEGs under {source.folder}, resized to {args.size}x{args.size}, "
          f"random {args.crop}x{args.crop} crop + flip after the cache")
    already = ds.num_cached
    if ds.created:  # creating a cache computes and stores its first sample and a few probes, to learn the layout
        print(f"cache:  {ds.path} (new: {already} samples stored while creating it, {len(ds) - already} to fill)")
    else:
        print(f"cache:  {ds.path} ({ds.num_cached} of {len(ds)} samples already cached)")
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        persistent_workers=args.workers > 0)
    times = []
    for epoch in range(args.epochs):
        start = time.perf_counter()
        seen, checksum = 0, 0.0
        for images, _labels in loader:
            seen += len(images)
            checksum += float(images.float().mean())  # stands in for the training step
        times.append(time.perf_counter() - start)
        state = "warm" if epoch > 0 or already == len(ds) else "cold: decoding JPEGs"
        print(f"epoch {epoch + 1}: {times[-1]:6.2f} s  {seen / times[-1]:8.0f} images/s  ({state})")
    del loader

    size = cache_bytes(ds.path)
    print(f"\nsummary: {ds.num_cached} of {len(ds)} images cached in {ds.path} ({size / 2**20:.1f} MiB, shared by "
          f"every process on this machine)")
    if len(times) > 1:
        warm = sum(times[1:]) / len(times[1:])
        print(f"first epoch {times[0]:.2f} s, later epochs {warm:.2f} s on average: "
              f"{times[0] / max(warm, 1e-9):.1f}x faster from the cache")
    print(f"run again to start warm; remove the cache with `mmapcache rm {ds.path}`")
    ds.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
