"""Sources and process bodies for the feature tests (partial caching, variants, refresh, variable shapes).

Everything here is importable by spawned processes (the tests directory is on their ``sys.path``), and every
process body is bounded by a count and a deadline, so a broken protocol fails a test instead of hanging it.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mmapcache import MmapCachedDataset


def _log_call(log: str | None, index: int) -> None:
    if log is not None:
        # One short O_APPEND write per call: lines from concurrent processes never interleave.
        with open(log, "a") as f:
            f.write(f"{index}\n")


def read_calls(log: str) -> list[int]:
    """The indices a logging source computed, in every process, in order."""
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [int(line) for line in f]


def wait_for(path: str, timeout: float) -> bool:
    """Waits for a file to exist (a start barrier between processes); False on timeout."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# --- random augmentation -------------------------------------------------------------------------------------


class RandomAugment(Dataset):
    """``(noise image, index)`` where the noise comes from an unseeded RNG: every call returns a new version.

    ``log`` (a file path) records each computed index, counting source calls across processes.
    """

    def __init__(self, n: int, log: str | None = None, shape: tuple[int, ...] = (3, 16, 16)) -> None:
        self.n, self.log, self.shape = n, log, tuple(shape)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        _log_call(self.log, index)
        rng = np.random.default_rng()  # fresh OS entropy per call: a real random augmentation
        return torch.from_numpy(rng.integers(0, 256, self.shape, dtype=np.uint8)), index


# --- versioned samples (torn-read detection) ------------------------------------------------------------------


def fill_byte(index: int, version: int) -> int:
    """The byte every body position of sample ``(index, version)`` holds; consecutive versions differ."""
    return (index * 131 + version * 7) % 251 + 1


def versioned_sample(index: int, version: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, int, int]:
    """``(image, index, version)``: the image is filled with ``fill_byte`` after an 8-byte header holding the
    index and version (little-endian int32), so every byte of the sample is a function of (index, version)."""
    image = np.full(shape, fill_byte(index, version), dtype=np.uint8)
    flat = image.reshape(-1)
    flat[:8] = np.frombuffer(np.array([index, version], dtype="<i4").tobytes(), np.uint8)
    return torch.from_numpy(image), index, version


def check_versioned(sample: Any, index: int) -> bool:
    """Whether a received sample is internally consistent: all bytes from one version of ``index``."""
    image, label, version = sample
    flat = image.numpy().reshape(-1) if isinstance(image, torch.Tensor) else np.asarray(image).reshape(-1)
    head_index, head_version = np.frombuffer(flat[:8].tobytes(), "<i4").tolist()
    if head_index != index or label != index or head_version != version:
        return False
    body = flat[8:]
    return bool((body == fill_byte(index, version)).all())


class Versioned(Dataset):
    """A source whose every call returns a new version of the sample: ``version = base + calls in this process``.

    Give each process its own ``base`` (e.g. ``1_000_000 * process number``) so versions never repeat.
    """

    def __init__(self, n: int, shape: tuple[int, ...], base: int = 0, log: str | None = None) -> None:
        self.n, self.shape, self.base, self.log = n, tuple(shape), base, log
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        _log_call(self.log, index)
        self.calls += 1
        return versioned_sample(index, self.base + self.calls, self.shape)


def rewrite_loop(path: str, n: int, shape: tuple[int, ...], worker: int, barrier: str, max_rounds: int,
                 seconds: float, result: Any) -> None:
    """A writer: repeatedly marks a few samples stale and rewrites them with a new version (``refresh`` then
    ``fill``). Puts ``("writer", worker, rounds, stored)`` on ``result``."""
    ds = MmapCachedDataset(path, Versioned(n, shape, base=1_000_000 * (worker + 1)), stale="serve",
                           deterministic=False)
    rng = random.Random(worker)
    if not wait_for(barrier, 60):
        result.put(("writer", worker, -1, -1))
        return
    rounds = stored = 0
    deadline = time.monotonic() + seconds
    while rounds < max_rounds and time.monotonic() < deadline:
        indices = rng.sample(range(n), 2)
        ds.refresh(indices=indices)
        stored += ds.fill(indices)
        rounds += 1
    ds.close()
    result.put(("writer", worker, rounds, stored))


def check_loop(path: str, n: int, shape: tuple[int, ...], worker: int, barrier: str, max_checks: int,
               seconds: float, result: Any) -> None:
    """A reader (``stale="serve"``): checks every sample it receives, through ``ds[i]`` and ``__getitems__``.
    Puts ``("reader", worker, checks, torn)`` on ``result``."""
    # A reader whose copy loses the race computes the sample itself: give it versions no writer uses.
    ds = MmapCachedDataset(path, Versioned(n, shape, base=500_000 + 1_000_000 * (worker + 1)), stale="serve",
                           deterministic=False)
    rng = random.Random(1000 + worker)
    if not wait_for(barrier, 60):
        result.put(("reader", worker, -1, -1))
        return
    checks = torn = 0
    deadline = time.monotonic() + seconds
    while checks < max_checks and time.monotonic() < deadline:
        if rng.random() < 0.5:
            i = rng.randrange(n)
            pairs = [(i, ds[i])]
        else:
            batch = [rng.randrange(n) for _ in range(8)]
            pairs = list(zip(batch, ds.__getitems__(batch)))
        for i, sample in pairs:
            checks += 1
            torn += not check_versioned(sample, i)
    ds.close()
    result.put(("reader", worker, checks, torn))


def die_mid_write(path: str, n: int, shape: tuple[int, ...], index: int, started: str) -> None:
    """Starts rewriting sample ``index`` and stops halfway through the bytes (then waits to be SIGKILLed).

    It goes through the real publication protocol (``SlotState.publish``) with a write that stores the first
    half of a new version, so the kill lands mid-rewrite deterministically.
    """
    ds = MmapCachedDataset(path, Versioned(n, shape, base=7_000_000), deterministic=False)
    reader = ds._ensure_open()
    row = ds._rows.row(index, ds.epoch)
    image = np.asarray(versioned_sample(index, 7_000_001, shape)[0]).reshape(-1)
    data = reader.data[0].reshape(reader.data[0].shape[0], -1)

    def half_write(owned: bool) -> None:
        data[row, : len(image) // 2] = image[: len(image) // 2]
        with open(started, "w"):
            pass
        time.sleep(120)  # killed long before

    reader.state.mark_stale(np.array([row]))  # a rewrite goes through the real protocol: stale, then publish
    reader.state.publish(row, index, half_write)


def rewrite_forever(path: str, n: int, shape: tuple[int, ...], ready: str, seconds: float) -> None:
    """Rewrites every sample again and again (``refresh`` + ``fill``), large rows, until killed or the deadline."""
    ds = MmapCachedDataset(path, Versioned(n, shape, base=8_000_000), stale="serve", deterministic=False)
    with open(ready, "w"):
        pass
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ds.refresh(indices=range(n))
        ds.fill()


# --- DataLoader workers ----------------------------------------------------------------------------------------


def pad_collate(batch: list[Any]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Pads variable-length ``(sequence, label)`` samples to the batch's longest; returns lengths too."""
    lengths = [int(seq.shape[0]) for seq, _ in batch]
    width = max(lengths) if lengths else 0
    padded = torch.zeros(len(batch), width, *batch[0][0].shape[1:], dtype=batch[0][0].dtype)
    for k, (seq, _) in enumerate(batch):
        padded[k, : seq.shape[0]] = seq
    return padded, torch.tensor([label for _, label in batch]), lengths


def list_collate(batch: list[Any]) -> list[Any]:
    return batch
