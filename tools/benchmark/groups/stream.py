"""Group ``stream`` (issue 12): a trainer that spends a fixed time per batch on its step reads a stream whose ring
holds a quarter of the dataset, fed by two producer processes with a real augmentation cost per sample.

Measured: the share of each epoch the trainer spent waiting for its batches, and the share of the samples it was
served that were fresh (produced for it, never served before; readers wait rather than compute:
``on_miss="wait"``). ``Augmented`` is also the source of ``streamnodes``' ranks (``scripts/stream_rank.py``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from benchmark.core import Config, Results, load_now
from benchmark.workloads import workspace
from mmapcache import MmapCachedDataset


class Augmented(Dataset):
    """3x64x64 uint8 images plus a per-call random token, after ``work`` seconds of CPU (an augmentation)."""

    def __init__(self, n: int, work: float) -> None:
        self.n, self.work = n, work
        self.images = np.random.default_rng(0).integers(0, 256, (64, 3, 64, 64), dtype=np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        end = time.perf_counter() + self.work
        while time.perf_counter() < end:
            pass
        return torch.from_numpy(self.images[i % 64].copy()), int.from_bytes(os.urandom(7), "little")


def run_stream(cfg: Config, results: Results) -> None:
    n = cfg.size(2400, 240)
    batch, step, work = (16, 0.01, 0.0002) if cfg.quick else (32, 0.08, 0.002)
    epochs = 2
    source = Augmented(n, work)
    ring_bytes = (n // 4) * (3 * 64 * 64 + 8 + 8 + 64)  # a quarter of the dataset (values, keys, state)
    with workspace("stream") as tmp:
        ds = MmapCachedDataset(os.path.join(tmp, "stream"), source, stream=True, max_bytes=ring_bytes, seed=0,
                               on_miss="wait", wait_timeout=300)
        slots = ds.stream_stats["slots"]
        producer = ds.produce(workers=2)
        try:
            deadline = time.monotonic() + 60
            while ds.stream_stats["ahead"] < slots * 0.9 and time.monotonic() < deadline:
                time.sleep(0.05)  # the ring fills before training starts, as a prefetcher's buffer would
            loader = ds.loader(batch_size=batch)
            waits, fresh, tokens = [], [], set()
            for epoch in range(epochs):
                before = ds.stream_stats
                waited = 0.0
                start = time.perf_counter()
                batches = iter(loader)
                while True:
                    asked = time.perf_counter()
                    try:
                        _, token = next(batches)
                    except StopIteration:
                        break
                    waited += time.perf_counter() - asked
                    tokens.update(token.tolist())
                    time.sleep(step)  # the training step
                elapsed = time.perf_counter() - start
                after = ds.stream_stats
                served = after["served"] - before["served"]
                computed = after["computed"] - before["computed"]
                waits.append(waited / elapsed)
                fresh.append(served / max(1, served + computed))
                results.row("stream", f"stream epoch {epoch}: time waiting for batches / epoch time", waited / elapsed,
                            "share", f"{elapsed:.2f} s epoch, {waited:.3f} s waiting; {served} served from the ring, "
                            f"{computed} computed by the trainer", load_now())
        finally:
            producer.stop()
        repeats = epochs * n - len(tokens)
        ds.close()
    note = (f"N={n}, ring {slots} samples ({slots / n:.0%}), batch {batch}, {step * 1e3:.0f} ms step, "
            f"{work * 1e3:.1f} ms augmentation, 2 producers; {repeats} computations served twice")
    results.row("stream", "stream: ring size / dataset", slots / n, "share", note, load_now())
    results.target("stream.wait", max(waits), load_now(), note)
    results.target("stream.fresh", min(fresh) if repeats == 0 else 0.0, load_now(), note)
