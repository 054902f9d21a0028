"""Source datasets and process bodies for ``tools/bench.py``: importable by spawned processes and by
``mmapcache build --dataset tools/bench_sources.py:NAME``.

Every source is deterministic (a sample depends only on its index), so a cache built by one process can be read
and checked by another.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mmapcache import MmapCachedDataset


class ArraySource(Dataset):
    """``(uint8 image tensor, int label)`` read from an ``.npy`` file of images (memory-mapped) and labels.

    Args:
        images: path of an ``(N, *shape)`` uint8 ``.npy`` file.
        labels: path of an ``(N,)`` int64 ``.npy`` file.
        delay: seconds slept per sample (a stand-in for decoding or reading from a slow disk).
    """

    def __init__(self, images: str, labels: str, delay: float = 0.0) -> None:
        self.images_path, self.labels_path, self.delay = images, labels, delay
        self._images: np.ndarray | None = None
        self._labels: np.ndarray | None = None
        self.n = int(np.load(labels, mmap_mode="r").shape[0])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if self._images is None:
            self._images = np.load(self.images_path, mmap_mode="r")
            self._labels = np.load(self.labels_path, mmap_mode="r")
        if self.delay:
            _pause(self.delay)
        return torch.from_numpy(np.array(self._images[index])), int(self._labels[index])  # type: ignore[index]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_images": None, "_labels": None}


def _pause(seconds: float) -> None:
    """Sleeps ``seconds`` precisely (time.sleep overshoots 1 ms by ~5-10%: finish with a short spin)."""
    end = time.perf_counter() + seconds
    if seconds > 2e-4:
        time.sleep(seconds - 1.5e-4)
    while time.perf_counter() < end:
        pass


class Synthetic(Dataset):
    """``(uint8 image, int label)`` made from the index; ``delay`` seconds of (precise) sleep per sample."""

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 32, 32), delay: float = 0.0) -> None:
        self.n, self.shape, self.delay = n, tuple(shape), delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if self.delay:
            _pause(self.delay)
        image = np.full(self.shape, index % 251, dtype=np.uint8)
        return torch.from_numpy(image), index % 1000


class CpuBound(Dataset):
    """A source whose samples cost ``work`` rounds of pure CPU (holding the GIL) each: build-scaling benchmark."""

    def __init__(self, n: int = 2000, shape: tuple[int, ...] = (3, 32, 32), work: int = 4000) -> None:
        self.n, self.shape, self.work = n, tuple(shape), work

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        acc = index
        for k in range(self.work):  # deliberately Python: costs CPU and holds the GIL, like decoding in Python
            acc = (acc * 1103515245 + k) & 0xFFFFFFFF
        image = np.full(self.shape, acc % 251, dtype=np.uint8)
        return torch.from_numpy(image), index % 1000


def cpu_bound(n: int = 2000, shape: list[int] | None = None, work: int = 4000) -> CpuBound:
    """Factory for ``mmapcache build --dataset tools/bench_sources.py:cpu_bound --kwargs '{"n": 2000}'``."""
    return CpuBound(n, tuple(shape or (3, 32, 32)), work)


class Augmented(Dataset):
    """A sample plus an "expensive random augmentation" (``delay`` seconds), differing per call."""

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 32, 32), delay: float = 1e-3) -> None:
        self.n, self.shape, self.delay = n, tuple(shape), delay
        self._rng = np.random.default_rng()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        _pause(self.delay)
        shift = int(self._rng.integers(0, 8))
        image = np.full(self.shape, (index + shift) % 251, dtype=np.uint8)
        return torch.from_numpy(image), index % 1000


class PerSample(MmapCachedDataset):
    """The cached dataset with ``__getitems__`` hidden: DataLoader falls back to one ``ds[i]`` per sample."""

    __getitems__ = None  # type: ignore[assignment]  # torch's fetcher checks truthiness of this attribute


# --- process bodies (spawned by tools/bench.py) -------------------------------------------------------------------


def pss_kib(pid: int) -> int:
    """The proportional set size of a process in KiB (``/proc/PID/smaps_rollup``)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss line in /proc/{pid}/smaps_rollup")


def memory_reader(mode: str, path: str, warm: str, ready: Any, go: Any, done: Any, leave: Any) -> None:
    """Reads the small ``warm`` cache (or ``warm.npy``) first, so imports and allocator pools are in the baseline,
    then waits for ``go`` and reads the whole dataset at ``path`` (``mode`` "cache": through the cache; "private":
    a private in-memory copy as a TensorDataset holds), sets ``done`` and keeps it until ``leave``."""
    keep: Any
    if mode == "cache":
        with MmapCachedDataset(warm) as small:
            for _ in small.loader(batch_size=256):
                pass
    else:
        torch.from_numpy(np.load(warm + ".npy"))
    ready.set()
    if not go.wait(120):
        return
    if mode == "cache":
        keep = MmapCachedDataset(path)
        for _ in keep.loader(batch_size=256):
            pass
    else:
        keep = torch.from_numpy(np.load(path))  # the whole array read into private memory
    done.set()
    leave.wait(120)
    del keep


def lock_publisher(mode: str, path: str, rows: list[int], poll: float, seconds: float, ready: Any, go: Any,
                   out: Any) -> None:
    """Publishes ``rows`` of the cache at ``path`` (stopping after ``seconds``), taking the cache's own flock
    (``mode`` "flock") or a ``filelock.FileLock`` with poll interval ``poll``; puts (count, first, last) on ``out``."""
    ds = MmapCachedDataset(path)
    reader = ds._ensure_open()
    state = reader.state
    if mode == "filelock":
        import filelock

        lock = filelock.FileLock(os.path.join(path, "bench.filelock"))

        class _Polled:
            def __enter__(self) -> None:
                lock.acquire(poll_interval=poll)

            def __exit__(self, *exc: object) -> None:
                lock.release()

            def close(self) -> None:
                own.close()

        own = state.lock
        state.lock = _Polled()
    value = [np.zeros(f.shape, f.np_dtype) for f in reader.fields]  # fixed-shape fields only
    ready.set()
    if not go.wait(120):
        out.put((0, 0.0, 0.0))
        return
    start = time.perf_counter()
    count = 0
    for row in rows:
        with state.lock:  # the writer lock's handover plus a row's write: what a publish costs under contention
            reader.write(row, value, True)
        count += 1
        if time.perf_counter() - start > seconds:
            break
    out.put((count, start, time.perf_counter()))
    ds.close()
