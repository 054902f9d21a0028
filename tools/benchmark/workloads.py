"""The benchmark's workloads: what each sample is, how many, and their data written once to ``/dev/shm``.

Each workload's data lives in its own directory (``workspace``), removed when the workload is done, even when it
fails. The sources that read it back are in ``benchmark.sources`` (importable by DataLoader workers).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

PREFIX = "mmapcache-bench-"


@contextlib.contextmanager
def workspace(tag: str) -> Iterator[str]:
    """A fresh directory ``/dev/shm/mmapcache-bench-<uuid>-<tag>``, removed on exit whatever happens."""
    path = os.path.join("/dev/shm", f"{PREFIX}{uuid.uuid4().hex[:8]}-{tag}")
    os.makedirs(path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class FixedWorkload:
    """Samples of fixed-shape fields.

    Attributes:
        name: the group name (``--only``) and the prefix of its target keys.
        title: how rows name it.
        fields: field name -> (shape, numpy dtype); shape ``()`` is a python int label.
        form: "tuple" (``(image, label)``) or "dict".
        n, quick_n: samples (full run, ``--quick``).
        baseline: what the in-memory baseline is called in rows.
        getitems: also measure ``DataLoader(ds)`` (default collation through ``__getitems__``).
        cold_delay: seconds of source work per sample in the cold comparison (None: no cold comparison).
        cold_n, cold_quick_n: samples in the cold comparison (the first ones of the data).
    """

    name: str
    title: str
    fields: dict[str, tuple[tuple[int, ...], str]]
    form: str
    n: int
    quick_n: int
    baseline: str = "TensorDataset + default collate"
    getitems: bool = False
    cold_delay: float | None = None
    cold_n: int = 0
    cold_quick_n: int = 0

    def sample_bytes(self) -> int:
        return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in self.fields.values())


LABEL = ((), "int64")
IMAGES12K = FixedWorkload("images12k", "12 KB images", {"image": ((3, 64, 64), "uint8"), "label": LABEL}, "tuple",
                          50000, 2000, getitems=True, cold_delay=1e-3, cold_n=3000, cold_quick_n=200)
IMAGES150K = FixedWorkload("images150k", "150 KB images", {"image": ((3, 224, 224), "uint8"), "label": LABEL},
                           "tuple", 8000, 300, getitems=True)
TABULAR = FixedWorkload("tabular", "tabular rows", {"x": ((64,), "float32"), "label": LABEL}, "tuple", 200000, 6000,
                        cold_delay=50e-6, cold_n=20000, cold_quick_n=1000)
DICT = FixedWorkload("dict", "37 KB dict", {"image": ((3, 96, 96), "uint8"), "mask": ((96, 96), "uint8"),
                                            "boxes": ((8, 4), "float32"), "label": LABEL}, "dict", 20000, 800,
                     baseline="list of dicts + default collate", cold_delay=50e-6, cold_n=8000, cold_quick_n=400)
FIXED = (IMAGES12K, IMAGES150K, TABULAR, DICT)

# Issue 14: token ids of uniform length 16..512 (int64); captions of 20..200 characters with an int label.
TOKENS_N, TOKENS_QUICK_N, TOKEN_LENGTHS = 50000, 2000, (16, 512)
CAPTIONS_N, CAPTIONS_QUICK_N, CAPTION_LENGTHS = 50000, 2000, (20, 200)

# Shuffled single-sample reads per measured pass (ds[i] rows).
PER_SAMPLE = 20000


def write_fields(directory: str, workload: FixedWorkload, n: int, seed: int = 0) -> dict[str, str]:
    """Random data for every field of ``workload``, ``n`` samples, as ``.npy`` files; returns field -> path."""
    rng = np.random.default_rng(seed)
    paths = {}
    for name, (shape, dtype) in workload.fields.items():
        path = paths[name] = os.path.join(directory, f"{name}.npy")
        array = np.lib.format.open_memmap(path, "w+", np.dtype(dtype), (n, *shape))
        step = max(1, (64 << 20) // max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize))
        for k in range(0, n, step):
            m = min(step, n - k)
            if not shape:
                array[k:k + m] = rng.integers(0, 1000, m)
            elif np.dtype(dtype).kind == "f":
                array[k:k + m] = rng.standard_normal((m, *shape), dtype=np.float32)
            else:
                array[k:k + m] = rng.integers(0, 256, (m, *shape), dtype=np.uint8)
        array.flush()
        del array
    return paths


def write_packed(directory: str, kind: str, n: int, seed: int = 0) -> dict[str, str]:
    """Token ids (int64, lengths uniform in ``TOKEN_LENGTHS``) or captions (ASCII text, lengths uniform in
    ``CAPTION_LENGTHS``, plus int labels), packed back to back with their offsets. Returns the paths by role."""
    rng = np.random.default_rng(seed)
    low, high = TOKEN_LENGTHS if kind == "tokens" else CAPTION_LENGTHS
    lengths = rng.integers(low, high + 1, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if kind == "tokens":
        values = rng.integers(0, 50000, int(offsets[-1]), dtype=np.int64)
    else:
        alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz    ", np.uint8)
        values = alphabet[rng.integers(0, len(alphabet), int(offsets[-1]))]
    paths = {"values": os.path.join(directory, f"{kind}.npy"), "offsets": os.path.join(directory, "offsets.npy")}
    np.save(paths["values"], values)
    np.save(paths["offsets"], offsets)
    if kind == "captions":
        paths["labels"] = os.path.join(directory, "labels.npy")
        np.save(paths["labels"], rng.integers(0, 1000, n, dtype=np.int64))
    return paths
