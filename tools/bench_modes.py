"""Benchmark groups for the two ways a cache holds less than a full copy: stream mode and node shares.

``stream`` (issue 12): a trainer that spends a fixed time per batch on its step reads a stream whose ring holds a
quarter of the dataset, fed by two producer processes with a real augmentation cost per sample. Measured: the share
of each epoch the trainer spent waiting for its batches, and the share of the samples it was served that were
fresh (produced for it, never served before; readers wait rather than compute: ``on_miss="wait"``).

``nodeshare`` (issue 13): two node shares of one dataset, each in its own cache (two "nodes" on one machine: the
read path is the same as on two), against a full cache of the same per-rank size on one node. Measured,
interleaved: a warm epoch's read rate of a rank on its node's share over the full cache's; and how many source
reads the warm epochs made (none, without rotation).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
import torch
from bench_core import Config, Results, Side, interleave, load_now
from bench_reads import raw_gather
from bench_workloads import workspace
from torch.utils.data import Dataset

from mmapcache import MmapCachedDataset

TOOLS = os.path.dirname(os.path.abspath(__file__))


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


class _Counting(Dataset):
    """A fixed-shape source that counts its calls (in this process)."""

    def __init__(self, images: np.ndarray) -> None:
        self.images, self.calls = images, 0

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Any:
        self.calls += 1
        return torch.from_numpy(self.images[i].copy()), i


def run_nodeshare(cfg: Config, results: Results) -> None:
    n = cfg.size(40000, 2000)
    images = np.random.default_rng(0).integers(0, 256, (n, 3, 64, 64), dtype=np.uint8)
    with workspace("nodeshare") as tmp:
        source = _Counting(images)
        nodes = [MmapCachedDataset(os.path.join(tmp, f"node{k}"), source, node_share=(k, 2), fingerprint="bench")
                 for k in range(2)]
        for node in nodes:
            node.prefill(rank=0, world_size=1, barrier=False)
        first_epoch_reads = source.calls
        full = MmapCachedDataset(os.path.join(tmp, "full"), _Counting(images[: n // 2]), fingerprint="bench")
        full.fill()
        sampler = nodes[0].sampler(rank=0, world_size=1, shuffle=True)
        share_loader = nodes[0].loader(batch_size=cfg.batch, sampler=sampler)
        full_loader = full.loader(batch_size=cfg.batch, shuffle=True)
        epoch = [0]

        def share_epoch() -> None:
            epoch[0] += 1
            sampler.set_epoch(epoch[0])
            for _ in share_loader:
                pass

        def full_epoch() -> None:
            for _ in full_loader:
                pass

        # The same raw gather over each cache's own rows: what their memory alone gives, no code of ours.
        sides = [Side("share", share_epoch, len(sampler)), Side("full", full_epoch, n // 2),
                 Side("raw_share", raw_gather(nodes[0], n // 2, cfg.batch), n // 2),
                 Side("raw_full", raw_gather(full, n // 2, cfg.batch), n // 2)]
        comparison = interleave(sides, cfg.rounds, min_time=cfg.min_time)
        warm_reads = source.calls - first_epoch_reads
        results.sides("nodeshare", comparison, {"share": "node share: rank 0 of node 0 of 2, ds.loader+ds.sampler",
                                                "full": "full cache of the same per-rank size, ds.loader",
                                                "raw_share": "node share: raw sorted np.take over its rows",
                                                "raw_full": "full cache: raw sorted np.take over its rows"})
        results.compared("nodeshare.read_rate", comparison, "share", "full",
                         f"N={n}, 12 KB images, 2 nodes simulated as 2 caches on one machine")
        results.row("nodeshare", "ratio node share vs full cache, raw np.take over each one's rows",
                    comparison.ratio("raw_share", "raw_full"), "x", "interleaved, from best rounds",
                    comparison.load())
        results.target("nodeshare.source_reads", warm_reads, load_now(),
                       f"source reads during {sum(len(m.rounds) + 1 for m in comparison.sides.values())} warm epochs "
                       f"of node 0 (the first epoch read {first_epoch_reads}, once per index)")
        for ds in [*nodes, full]:
            ds.close()


def run_stream_nodes(cfg: Config, results: Results) -> None:
    """Issue 27: a stream under a job of 2 nodes x 2 ranks on loopback (a torchrun per node, each node its own
    ``MMAPCACHE_DIR``), against the same job with the augmentation done inline in 2 DataLoader workers per rank; the
    modes run in turn (stream, inline, stream, ...). Per epoch: the trainers' time waiting for batches over the
    epoch's time (the worst rank), and for the stream the share of values served fresh from the producers."""
    n = cfg.size(2400, 400)
    # The demand (4 ranks x batch / step x work) stays under this 2-core machine: 0.8 cores of augmentation.
    work, step, batch = (0.001, 0.01, 8) if cfg.quick else (0.001, 0.08, 16)
    rounds = 1 if cfg.quick else min(cfg.rounds, 2)
    waits: dict[str, list[float]] = {"stream": [], "inline": []}
    fresh: list[float] = []
    with workspace("streamnodes") as tmp:
        for r in range(rounds):
            for mode in ("stream", "inline"):
                out = os.path.join(tmp, f"{mode}{r}")
                os.makedirs(out)
                _two_nodes(os.path.join(tmp, f"nodes-{mode}{r}"),
                           [os.path.join(TOOLS, "bench_stream_rank.py"), out, "--mode", mode, "--samples", str(n),
                            "--work", str(work), "--step", str(step), "--batch-size", str(batch)])
                ranks = []
                for name in sorted(os.listdir(out)):
                    with open(os.path.join(out, name)) as f:
                        ranks.append(json.load(f))
                epochs = len(ranks[0]["epochs"])
                for e in range(epochs):
                    waits[mode].append(max(r["epochs"][e]["wait"] / r["epochs"][e]["elapsed"] for r in ranks))
                    if mode == "stream":  # each node's counters, read by its local rank 0 (ranks 0 and 2)
                        served = sum(ranks[k]["epochs"][e]["served"] for k in (0, 2))
                        computed = sum(ranks[k]["epochs"][e]["computed"] for k in (0, 2))
                        fresh.append(served / max(1, served + computed))
    note = (f"N={n}, 2 nodes x 2 ranks on loopback, batch {batch}, {step * 1e3:.0f} ms step, {work * 1e3:.1f} ms "
            f"augmentation; stream: 2 producers per node, a ring of half a node's epoch; inline: 2 workers per rank; "
            f"{rounds} round(s) of each, worst epoch")
    results.row("streamnodes", "2 nodes, stream: time waiting for batches / epoch time (worst epoch)",
                max(waits["stream"]), "share", note, load_now())
    results.row("streamnodes", "2 nodes, inline augmentation in DataLoader workers: waiting / epoch time (worst epoch)",
                max(waits["inline"]), "share", note, load_now())
    results.row("streamnodes", "2 nodes, stream: values served fresh from the producers (worst epoch)", min(fresh),
                "share", note, load_now())


def _two_nodes(root: str, script: list[str]) -> None:
    """A job of 2 "nodes" of 2 ranks on loopback: a torchrun per node, each with its own ``MMAPCACHE_DIR``."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": TOOLS + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                               "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}", *script],
                              env={**env, "MMAPCACHE_DIR": os.path.join(root, f"node{node}")},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for node in (0, 1)]
    try:
        outs = [proc.communicate(timeout=600)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for proc, out in zip(procs, outs):
        if proc.returncode != 0:
            raise RuntimeError(f"a node of the stream job exited with {proc.returncode}: {out[-2000:]}")
