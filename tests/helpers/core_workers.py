"""Sources and process entry points for the core tests: module-level so spawned processes can import them.

Every entry point reports through a queue (or its exit code) and bounds its own waiting, so a test that joins it
with a timeout can never hang.
"""

from __future__ import annotations

import collections
import os
import random
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from helpers.sources import ImageLabels, sample_equal
from mmapcache import MmapCachedDataset

Point = collections.namedtuple("Point", ["x", "y"])

# Every torch dtype the cache must store, numpy-less ones (bfloat16, complex32, float8) included.
TORCH_DTYPES = [
    torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64,
    torch.complex128,
] + [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                       "float8_e8m0fnu") if hasattr(torch, name)]

# Every numeric numpy dtype and bool. Arrays are made from raw bytes, so even longdouble's padding bytes are
# deterministic and a byte comparison is exact.
NUMPY_DTYPES = [np.dtype(c) for c in "?bBhHiIlLqQefdgFDG"]


def random_bytes(index: int, salt: int, nbytes: int) -> torch.Tensor:
    """Deterministic bytes depending on the index and a salt, so that every field of every sample differs."""
    g = torch.Generator().manual_seed(index * 1000 + salt)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def tensor_of(index: int, dtype: torch.dtype, salt: int, shape: tuple[int, ...] = (2, 3)) -> torch.Tensor:
    """A tensor of any dtype from random bytes (every bit pattern, NaNs included), bool kept to 0/1."""
    itemsize = dtype.itemsize  # not torch.empty(): creating a complex32 tensor warns
    raw = random_bytes(index, salt, itemsize * int(np.prod(shape)))
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def ndarray_of(index: int, dtype: np.dtype, salt: int, shape: tuple[int, ...] = (3, 2)) -> np.ndarray:
    raw = random_bytes(index, salt, dtype.itemsize * int(np.prod(shape))).numpy()
    if dtype == np.bool_:
        return (raw % 2).astype(np.bool_).reshape(shape)
    return raw.view(dtype).reshape(shape).copy()


class AllLeaves(Dataset):
    """Samples holding every supported leaf type, nested several levels deep in every container type."""

    def __init__(self, n: int = 6) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        tensors = {str(dt).removeprefix("torch."): tensor_of(index, dt, salt) for salt, dt in enumerate(TORCH_DTYPES)}
        arrays = [ndarray_of(index, dt, 100 + salt) for salt, dt in enumerate(NUMPY_DTYPES)]
        scalars = (
            index * 7 - 3, index / 3.0, index % 2 == 0, float("nan") if index == 2 else -0.0,
            np.float32(index / 7), np.int8(-index), np.uint64(2**64 - 1 - index), np.bool_(index % 3 == 0),
            np.complex64(index - 1j), np.float16(index), np.int64(-(2**63) + index),
        )
        deep = {"a": [(Point(x=tensor_of(index, torch.float32, 300, (4,)), y=index), {"b": [np.int16(index)]})]}
        return {
            "tensors": tensors,
            "arrays": arrays,
            "scalars": scalars,
            "deep": deep,
            "empty_tensor": torch.zeros((0, 3), dtype=torch.float32),
            "scalar_tensor": torch.tensor(index, dtype=torch.int64),
            "point": Point(x=np.float64(index), y=[1, 2.5, True]),
        }


class OddViews(Dataset):
    """Tensors that are not plain contiguous storage: transposed, sliced, conj-bit, neg-bit, requiring grad,
    and a numpy array that is a non-contiguous view. The cache must store their values."""

    def __init__(self, n: int = 5) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        base = tensor_of(index, torch.float32, 1, (4, 6)).nan_to_num()
        complex_base = tensor_of(index, torch.complex64, 2, (3,)).nan_to_num()
        return {
            "transposed": base.t(),
            "sliced": base[1:, ::2],
            "expanded": base[0].expand(3, 6),
            "conj": complex_base.conj(),
            "neg": complex_base.conj().imag,  # a neg-bit view
            "grad": base.clone().requires_grad_(),
            "strided_array": base.numpy()[::2, ::-1],
        }


def exact(a: Any, b: Any) -> bool:
    """``sources.sample_equal``, extended to 0-dim tensors wider than a byte (which ``sample_equal`` cannot view
    as bytes): same structure, types, dtypes and bytes."""
    if isinstance(a, torch.Tensor) and type(a) is type(b) and a.dim() == 0:
        return a.dtype == b.dtype and b.dim() == 0 and sample_equal(a.reshape(1), b.reshape(1))
    if isinstance(a, dict) and type(a) is type(b):
        return list(a) == list(b) and all(exact(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and type(a) is type(b):
        return len(a) == len(b) and all(exact(x, y) for x, y in zip(a, b))
    return sample_equal(a, b)


def resolved(sample: Any) -> Any:
    """What the cache must return for a sample of ``OddViews``: the same values as plain tensors."""
    out = {}
    for key, value in sample.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().resolve_conj().resolve_neg().contiguous()
        out[key] = value if not isinstance(value, np.ndarray) else np.ascontiguousarray(value)
    return out


class Big(Dataset):
    """Samples of ``mib`` MiB each (a write takes long enough for a kill to land inside it)."""

    def __init__(self, n: int, mib: int = 8) -> None:
        self.n, self.mib = n, mib

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        g = torch.Generator().manual_seed(index)
        return torch.randint(0, 256, (self.mib, 1024, 1024), dtype=torch.uint8, generator=g), index


class ChangesLayout(Dataset):
    """Like ``ImageLabels``, but sample ``bad`` has a float32 image (a different layout)."""

    def __init__(self, n: int, bad: int) -> None:
        self.inner, self.bad = ImageLabels(n), bad

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        image, label = self.inner[index]
        return (image.float() if index == self.bad else image), label


# --- process entry points ------------------------------------------------------------------------------------


def read_all_by_path(path: str, n: int, queue: Any) -> None:
    """An unrelated process: opens the cache by path alone and checks every sample against the source."""
    try:
        with MmapCachedDataset(path) as ds:
            source = ImageLabels(n)
            bad = [i for i in range(n) if not sample_equal(ds[i], source[i])]
            types = [type(ds[0]).__name__, type(ds[0][0]).__name__, str(ds[0][0].dtype), type(ds[0][1]).__name__]
            queue.put(("ok", bad, types, len(ds), ds.num_cached))
    except BaseException as exc:
        queue.put(("error", repr(exc)))


def _forked_child_setup() -> None:
    """First thing in a forked child: torch's intra-op thread pool does not survive fork (a child entering a
    parallel region can wedge: pytorch issues 17199, 2245), so use one thread, as DataLoader workers do.

    (Not ``faulthandler.dump_traceback_later`` here: pytest's ``faulthandler_timeout`` watchdog thread holds
    faulthandler's lock in the parent, and a forked child calling it waits on that lock forever.)"""
    torch.set_num_threads(1)


def concurrent_filler(path: str, n: int, seed: int, barrier: Any, queue: Any, rounds: int,
                      ragged: bool = False) -> None:
    """Fills and reads overlapping indices in its own random order, in batches (``__getitems__``) and one at a time;
    reports any sample that differs. ``ragged``: ``RaggedBig`` samples (a batch's values written at once), else
    64 KiB images."""
    _forked_child_setup()
    try:
        source = RaggedBig(n) if ragged else ImageLabels(n, shape=(64, 1024))
        barrier.wait(timeout=60)
        # All race to create it, then to fill it.
        ds = MmapCachedDataset(path, source, ragged=["blob"]) if ragged else MmapCachedDataset(path, source)
        rng = random.Random(seed)
        bad = []
        for _ in range(rounds):
            order = list(range(n))
            rng.shuffle(order)
            for k in range(0, n, 8):
                batch = order[k:k + 8]
                bad += [i for i, got in zip(batch, ds.__getitems__(batch)) if not sample_equal(got, source[i])]
            rng.shuffle(order)
            bad += [i for i in order if not sample_equal(ds[i], source[i])]
        ds.close()
        queue.put(("ok", seed, bad))
    except BaseException as exc:
        queue.put(("error", seed, repr(exc)))


def slow_filler(path: str, n: int, delay: float) -> None:
    """Fills a cache one sample at a time from a slow source, until killed."""
    with MmapCachedDataset(path, ImageLabels(n, shape=(16, 16), delay=delay)) as ds:
        for i in range(n):
            ds[i]


def big_filler(path: str, n: int, mib: int) -> None:
    """Fills a cache of large samples, in random order, until killed."""
    order = list(range(n))
    random.Random(os.getpid()).shuffle(order)
    with MmapCachedDataset(path, Big(n, mib), ragged=None) as ds:  # no probes: the rows are written by fill
        for i in order:
            ds[i]


class RaggedBig(Dataset):
    """Ragged values of 0.25-2 MiB (seeded per index), a text and an int: a batch of them takes long enough to
    write for a kill to land inside it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        g = torch.Generator().manual_seed(index)
        blob = torch.randint(0, 256, ((1 + index % 8) << 18,), dtype=torch.uint8, generator=g)
        return {"blob": blob, "name": f"sample {index} " * (index % 4), "i": index}


def ragged_batch_filler(path: str, n: int) -> None:
    """Stores ``RaggedBig(n)`` in shuffled batches of 8 (``__getitems__``: ``DataLoader(ds)``'s path, its ragged
    values written a batch at once), until killed."""
    order = list(range(n))
    random.Random(os.getpid()).shuffle(order)
    with MmapCachedDataset(path, RaggedBig(n), ragged=["blob"]) as ds:
        for k in range(0, n, 8):
            ds.__getitems__(order[k:k + 8])


class Small(Dataset):
    """Tiny samples, so that thousands of rows share few bitmap bytes and writers contend on each byte."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return torch.tensor([index, -index], dtype=torch.int32), index % 3


def interleaved_filler(path: str, n: int, k: int, workers: int, barrier: Any, queue: Any) -> None:
    """Fills indices ``k, k + workers, ...``: every bitmap byte is written by every filler at about the same time."""
    _forked_child_setup()
    try:
        ds = MmapCachedDataset(path, Small(n))
        barrier.wait(timeout=60)
        for i in range(k, n, workers):
            ds[i]
        ds.close()
        queue.put(("ok", k))
    except BaseException as exc:
        queue.put(("error", k, repr(exc)))


class Widening(Dataset):
    """1-D int64 values of 64 KiB and more (seeded per index): nearly every one stored grows the heap's file."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((8192 + index % 50,), index, dtype=torch.int64)


def counter_sweeper(path: str, rounds: int) -> None:
    """Moves a heap's loose bytes between its free and abandoned counters, under the writer lock and in a sweep's
    order (both zeroed, then free set, then abandoned), ``rounds`` times; then puts the counters back."""
    from mmapcache.store.heap import ABANDONED, END, FREE
    from mmapcache.store.store import Store

    store = Store(path, writable=True)
    heap = next(heap for heap in store.heaps if heap is not None)
    c = heap.counters
    free, abandoned, end = int(c[FREE]), int(c[ABANDONED]), int(c[END])
    loose = end * 3 // 5  # within the used bytes alone; twice it (free and abandoned read apart) is past them
    try:
        for k in range(rounds):
            with store.state.lock:
                c[FREE] = c[ABANDONED] = 0
                c[FREE], c[ABANDONED] = (loose, 0) if k % 2 else (0, loose)
    finally:
        with store.state.lock:
            c[FREE], c[ABANDONED] = free, abandoned
        store.close()


def widening_filler(path: str, n: int) -> None:
    """Stores ``Widening(n)`` one sample at a time."""
    with MmapCachedDataset(path, Widening(n), ragged=["<sample>"]) as ds:
        for i in range(n):
            ds[i]


def rewrite_row_slowly(path: str, row: int, started: Any, seconds: float) -> None:
    """A writer in the middle of rewriting ``row``: under the cache's writer lock, its counter odd for ``seconds``
    (``started`` set then), then even again, the value unchanged (as a rewrite with the same value ends)."""
    from mmapcache.store.store import Store

    store = Store(path)
    state = store.state

    def rewrite() -> None:  # (as a writer's change window: the cache-wide counter odd, then even and advanced)
        before, changes = state.seq[row], state.changes[0]
        state.changes[0] = changes | 1
        state.seq[row] = before | 1
        started.set()
        time.sleep(seconds)
        state.seq[row] = before
        state.changes[0] = (changes | 1) + 1
    try:
        state.still(rewrite)
    finally:
        store.close()
