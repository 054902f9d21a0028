"""Two unrelated processes, one cache: one fills it, another started later reads it by path alone.

    python examples/two_scripts.py fill     # computes every sample once, stores it, exits
    python examples/two_scripts.py read     # any later process: reads without the source
    python examples/two_scripts.py          # runs both, one after the other, as two processes

The reader passes no source dataset: it needs nothing but the path (and the cache survives the filler, since
caches persist until removed: ``mmapcache rm two-scripts-example``). ``--cache`` takes a path or a bare name,
which lives under ``$MMAPCACHE_DIR`` (default ``/dev/shm/mmapcache``).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time

import torch
from torch.utils.data import Dataset

from mmapcache import MmapCachedDataset


class SlowFeatures(Dataset):
    """A stand-in for expensive preprocessing: a deterministic ``(features, target)`` per index, 2 ms each."""

    def __init__(self, n: int = 500, dim: int = 256) -> None:
        self.n, self.dim = n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, float]:
        time.sleep(0.002)
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.dim, generator=g), float(i % 7)


def digest(ds: MmapCachedDataset) -> str:
    """A hash of every sample, to show both processes see the same bytes."""
    h = hashlib.sha256()
    for i in range(len(ds)):
        features, target = ds[i]
        h.update(features.numpy().tobytes())
        h.update(repr(target).encode())
    return h.hexdigest()[:16]


def fill(path: str, n: int) -> None:
    start = time.perf_counter()
    with MmapCachedDataset(path, SlowFeatures(n), fingerprint=f"slow-features-{n}") as ds:
        # Creating the cache stored its first sample and a few probes already (to learn the layout); fill()
        # computes the rest.
        created = ds.num_cached if ds.created else 0
        stored = ds.fill() + created
        elapsed = time.perf_counter() - start
        print(f"fill: stored {stored} samples in {elapsed:.2f} s "
              f"({ds.num_cached}/{len(ds)} cached at {ds.path}); digest {digest(ds)}")


def read(path: str) -> None:
    start = time.perf_counter()
    with MmapCachedDataset(path) as ds:  # no source: only the cache, found by its path
        read_digest = digest(ds)
        print(f"read: {len(ds)} samples from {ds.path} in {time.perf_counter() - start:.2f} s "
              f"without the source; digest {read_digest}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", choices=("fill", "read", "both"), default="both")
    parser.add_argument("--cache", default="two-scripts-example", help="cache path or bare name")
    parser.add_argument("--samples", type=int, default=500)
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error("--samples must be >= 1")
    if args.command == "fill":
        fill(args.cache, args.samples)
    elif args.command == "read":
        read(args.cache)
    else:  # two separate interpreters, the second started after the first has exited
        for command in ("fill", "read"):
            done = subprocess.run([sys.executable, __file__, command, "--cache", args.cache,
                                   "--samples", str(args.samples)])
            if done.returncode:
                return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
