"""Process bodies and sources for the fault tests: module-level, so spawned processes can import them.

Workers report through a result file (JSON) or a queue, and check every sample they get against the source
themselves, so a wrong byte seen by any process reaches the test as a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from helpers.sources import ImageLabels, image_of, sample_equal
from mmapcache import CacheReadOnlyWarning, MmapCachedDataset, SampleNotCachedError


def write_result(path: str, result: dict[str, Any]) -> None:
    """Writes a worker's result atomically (a reader never sees half a file)."""
    with open(path + ".part", "w") as f:
        json.dump(result, f)
    os.rename(path + ".part", path)


def read_result(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


# --- sources ---------------------------------------------------------------------------------------------------


class Failing(Dataset):
    """``ImageLabels`` whose sample ``bad`` raises, returns another layout, or hangs, depending on ``mode``."""

    def __init__(self, n: int, bad: int, mode: str, hang_seconds: float = 60.0) -> None:
        self.inner, self.bad, self.mode, self.hang_seconds = ImageLabels(n), bad, mode, hang_seconds

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        if index == self.bad:
            if self.mode == "raise":
                raise OSError(f"corrupt JPEG in record {index}")
            if self.mode == "layout":
                return torch.zeros(3, 9, 9, dtype=torch.uint8), 0
            if self.mode == "hang":
                time.sleep(self.hang_seconds)  # bounded, so a broken test cannot hang CI forever
        return self.inner[index]


# --- fillers and readers ---------------------------------------------------------------------------------------


def fill_shuffled(path: str, n: int, shape: tuple[int, ...], seed: int, barrier: Any, result: str) -> None:
    """Opens the cache with its source, waits at the barrier, then reads every index in a shuffled order
    (filling misses), checking each sample it gets against the source."""
    source = ImageLabels(n, shape)
    ds = MmapCachedDataset(path, source)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    barrier.wait(timeout=120)
    bad = [i for i in order if not sample_equal(ds[i], source[i])]
    ds.close()
    write_result(result, {"checked": n, "bad": bad})


def fill_forever(path: str, n: int, shape: tuple[int, ...], seed: int, ready: Any) -> None:
    """Fills the cache in a shuffled order, round after round, until killed (the kill storm's victim)."""
    ds = MmapCachedDataset(path, ImageLabels(n, shape))
    order = list(range(n))
    rng = random.Random(seed)
    ready.set()
    while True:
        rng.shuffle(order)
        for i in order:
            ds[i]
        ds.refresh(fraction=0.2)  # marks some rows stale so later rounds rewrite filled rows too


def read_continuously(path: str, n: int, shape: tuple[int, ...], seed: int, barrier: Any, stop: Any,
                      result: str, deadline_s: float) -> None:
    """Opens the cache without a source and reads random indices (single and batched) until ``stop`` is set or
    the deadline passes, comparing every sample it gets with the source."""
    ds = MmapCachedDataset(path)
    rng = random.Random(seed)
    barrier.wait(timeout=120)
    end = time.monotonic() + deadline_s
    checked, misses, bad = 0, 0, []
    while not stop.is_set() and time.monotonic() < end:
        for _ in range(64):
            i = rng.randrange(n)
            try:
                sample = ds[i]
            except SampleNotCachedError:
                misses += 1
                continue
            checked += 1
            if not sample_equal(sample[0], image_of(i, shape)) or sample[1] != i * 7 % 10:
                bad.append(i)
        batch = [rng.randrange(n) for _ in range(8)]
        try:
            samples = ds.__getitems__(batch)
        except SampleNotCachedError:
            misses += 1
        else:
            for i, sample in zip(batch, samples):
                checked += 1
                if not sample_equal(sample[0], image_of(i, shape)):
                    bad.append(i)
    ds.close()
    write_result(result, {"checked": checked, "misses": misses, "bad": bad})


def create_at_barrier(path: str, n: int, barrier: Any, result: str) -> None:
    """Waits at the barrier, then opens-or-creates the cache; reports which cache it ended up on."""
    barrier.wait(timeout=120)
    try:
        ds = MmapCachedDataset(path, ImageLabels(n))
    except BaseException as exc:  # reported, not raised: the test shows every process's outcome
        write_result(result, {"error": f"{type(exc).__name__}: {exc}"})
        return
    with open(os.path.join(path, "meta.json")) as f:
        created = json.load(f)["created"]
    inode = os.stat(os.path.join(path, "meta.json")).st_ino
    ok = all(sample_equal(ds[i], ImageLabels(n)[i]) for i in range(n))
    ds.close()
    write_result(result, {"inode": inode, "created": created, "ok": ok})


def read_through_removal(path: str, n: int, shape: tuple[int, ...], ready: Any, go: Any, result: str) -> None:
    """Maps a filled cache, waits while the test removes it, then reads every sample again and checks it."""
    ds = MmapCachedDataset(path)
    first = [i for i in range(n) if not sample_equal(ds[i][0], image_of(i, shape))]
    ready.set()
    go.wait(timeout=60)
    outcome: dict[str, Any] = {"bad_before": first}
    try:
        outcome["bad_after"] = [i for i in range(n) if not sample_equal(ds[i][0], image_of(i, shape))]
        batch = ds.__getitems__(list(range(n)))
        outcome["bad_batch"] = [i for i in range(n) if not sample_equal(batch[i][0], image_of(i, shape))]
    except Exception as exc:  # a clear error is acceptable; the test checks its type and message
        outcome["error"] = f"{type(exc).__name__}: {exc}"
    ds.close()
    write_result(result, outcome)


def write_through_removal(path: str, n: int, shape: tuple[int, ...], ready: Any, go: Any, result: str) -> None:
    """Maps a half-filled cache with its source, waits while the test removes it, then reads every sample (the
    misses cannot be stored): each sample must equal the source, and the warnings say why nothing is stored."""
    import warnings

    source = ImageLabels(n, shape)
    ds = MmapCachedDataset(path, source)
    ready.set()
    go.wait(timeout=60)
    outcome: dict[str, Any] = {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outcome["bad_after"] = [i for i in range(n) if not sample_equal(ds[i], source[i])]
        outcome["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    except Exception as exc:
        outcome["error"] = f"{type(exc).__name__}: {exc}"
    ds.close()
    write_result(result, outcome)


def read_only_user(path: str, n: int, uid: int, filled: list[int], queue: Any) -> None:
    """Drops root (root ignores file modes), then uses a cache whose files it may not write."""
    import warnings

    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    out: dict[str, Any] = {"uid": os.getuid()}
    source = ImageLabels(n)
    ds = MmapCachedDataset(path)
    out["hits_ok"] = all(sample_equal(ds[i], source[i]) for i in filled)
    missing = next(i for i in range(n) if i not in filled)
    try:
        ds[missing]
        out["miss_without_source"] = "no error"
    except SampleNotCachedError as exc:
        out["miss_without_source"] = str(exc)
    ds.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = MmapCachedDataset(path, source)
        misses = [i for i in range(n) if i not in filled][:3]
        out["misses_ok"] = all(sample_equal(ds[i], source[i]) for i in misses)
        out["batch_ok"] = all(sample_equal(a, source[i]) for a, i in zip(ds.__getitems__(misses), misses))
        out["still_unfilled"] = not any(ds.is_cached(i) for i in misses)
        ds.close()
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    out["read_only_warnings"] = sum(issubclass(w.category, CacheReadOnlyWarning) for w in caught)
    queue.put(out)


def create_in(path: str, shape: tuple[int, ...], n: int, fill: bool, queue: Any) -> None:
    """Creates (and optionally fills) a cache; reports the outcome. Run in a child so a SIGBUS shows up as its
    exit signal instead of killing the test process."""
    try:
        ds = MmapCachedDataset(path, ImageLabels(n, shape))
        if fill:
            ds.fill()
        queue.put({"ok": True, "cached": ds.num_cached})
        ds.close()
    except BaseException as exc:
        queue.put({"ok": False, "type": type(exc).__name__, "message": str(exc)})


def raw_rows(path: str, field_file: str = "0.npy") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The data, filled mask and seq counters of a cache, read with numpy alone (no mmapcache code)."""
    data = np.load(os.path.join(path, field_file), mmap_mode="r")
    rows = data.shape[0]
    bits = np.fromfile(os.path.join(path, "filled.bits"), dtype=np.uint8)
    filled = np.unpackbits(bits, bitorder="little", count=rows).astype(bool)
    seq = np.fromfile(os.path.join(path, "seq.u32"), dtype="<u4")
    return data, filled, seq


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def create_as_user(path: str, uid: int, queue: Any) -> None:
    """Drops root, then tries to create a cache; reports the error."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    try:
        MmapCachedDataset(path, ImageLabels(4)).close()
        queue.put({"type": None, "message": "created"})
    except Exception as exc:
        queue.put({"type": type(exc).__name__, "message": str(exc)})


def hog_space(path: str, size: int, stop: Any, deadline_s: float) -> None:
    """Takes ``size`` bytes of a file system and gives them back, again and again, until stopped."""
    end = time.monotonic() + deadline_s
    while not stop.is_set() and time.monotonic() < end:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):  # the room is taken by a cache right now
            os.posix_fallocate(fd, 0, size)
        time.sleep(0.002)
        os.close(fd)
        os.unlink(path)
        time.sleep(0.002)
