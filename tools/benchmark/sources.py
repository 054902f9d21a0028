"""Source datasets and process bodies for ``tools/bench.py``: importable by spawned processes and by
``mmapcache build --dataset tools/benchmark/sources.py:NAME``.

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
from mmapcache.store.writer import RowWriter


class FieldSource(Dataset):
    """Samples read from one ``.npy`` file per field (memory-mapped, opened lazily in each process).

    A field of shape ``(N,)`` is a python int; others are a tensor copy of the row. ``form`` "tuple" gives the fields
    in order (``(image, label)``), "dict" a dict by field name.

    Args:
        paths: field name -> path of an ``(N, *shape)`` ``.npy`` file.
        form: "tuple" or "dict".
        delay: seconds of busy CPU per sample (a stand-in for decoding; see ``spin``).
        n: serve only the first ``n`` samples (default all).
    """

    def __init__(self, paths: dict[str, str], form: str = "tuple", delay: float = 0.0, n: int | None = None) -> None:
        if form not in ("tuple", "dict"):
            raise ValueError(f"form must be 'tuple' or 'dict', got {form!r}")
        self.paths, self.form, self.delay = dict(paths), form, delay
        total = min(int(np.load(path, mmap_mode="r").shape[0]) for path in self.paths.values())
        self.n = total if n is None else min(n, total)
        self._arrays: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        arrays = self._arrays
        if arrays is None:
            arrays = self._arrays = {name: np.load(path, mmap_mode="r") for name, path in self.paths.items()}
        if self.delay:
            spin(self.delay)
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} samples")
        values = {name: int(a[index]) if a.ndim == 1 else torch.from_numpy(np.array(a[index]))
                  for name, a in arrays.items()}
        return tuple(values.values()) if self.form == "tuple" else values

    def touch(self) -> None:
        """Maps the files and reads every byte once, so that no measured epoch pays this process's first page
        faults on them."""
        self._arrays = {name: np.load(path, mmap_mode="r") for name, path in self.paths.items()}
        for a in self._arrays.values():
            int(np.asarray(a[:self.n]).view(np.uint8).sum(dtype=np.uint64))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}


class PackedSource(Dataset):
    """Variable-length values stored back to back in one ``.npy`` file, with their ``offsets`` (N + 1).

    ``kind`` "tokens": each sample is an int64 tensor of token ids. "captions": ``{"caption": str, "label": int}``
    (the values are UTF-8 bytes; ``labels`` is then the path of an ``(N,)`` int64 file).
    """

    def __init__(self, values: str, offsets: str, kind: str, labels: str | None = None) -> None:
        if kind not in ("tokens", "captions") or (kind == "captions") != (labels is not None):
            raise ValueError(f"kind must be 'tokens', or 'captions' with labels; got {kind!r}, labels={labels!r}")
        self.values_path, self.offsets_path, self.kind, self.labels_path = values, offsets, kind, labels
        self.n = int(np.load(offsets, mmap_mode="r").shape[0]) - 1
        self._open: tuple[np.ndarray, list[int], np.ndarray | None] | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if self._open is None:
            labels = np.load(self.labels_path, mmap_mode="r") if self.labels_path else None
            self._open = np.load(self.values_path, mmap_mode="r"), np.load(self.offsets_path).tolist(), labels
        values, offsets, labels = self._open
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} samples")
        part = values[offsets[index]:offsets[index + 1]]
        if labels is None:
            return torch.from_numpy(np.array(part))
        return {"caption": part.tobytes().decode(), "label": int(labels[index])}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": None}


def spin(seconds: float) -> None:
    """Keeps the CPU busy for ``seconds`` (a busy-wait on ``time.perf_counter``). A source that sleeps would leave
    the core free for the cache's own work, which a source that decodes does not: this behaves like decoding."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Synthetic(Dataset):
    """``(uint8 image, int label)`` made from the index; ``delay`` seconds of busy CPU per sample."""

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 32, 32), delay: float = 0.0) -> None:
        self.n, self.shape, self.delay = n, tuple(shape), delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if self.delay:
            spin(self.delay)
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
    """Factory for ``mmapcache build --dataset tools/benchmark/sources.py:cpu_bound --kwargs '{"n": 2000}'``."""
    return CpuBound(n, tuple(shape or (3, 32, 32)), work)


class Augmented(Dataset):
    """A sample plus an "expensive random augmentation" (``delay`` seconds), differing per call."""

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 32, 32), delay: float = 1e-3) -> None:
        self.n, self.shape, self.delay = n, tuple(shape), delay
        self._rng = np.random.default_rng()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        spin(self.delay)
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
    writer = RowWriter(reader.store)
    ready.set()
    if not go.wait(120):
        out.put((0, 0.0, 0.0))
        return
    start = time.perf_counter()
    count = 0
    for row in rows:
        with state.lock:  # the writer lock's handover plus a row's write: what a publish costs under contention
            writer.write(row, value, True)
        count += 1
        if time.perf_counter() - start > seconds:
            break
    out.put((count, start, time.perf_counter()))
    ds.close()
