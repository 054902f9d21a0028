"""Group ``streamnodes`` (issues 27 and 38, run on request): a stream under a job of 2 nodes x 2 ranks on loopback,
each rank ``scripts/stream_rank.py`` under a torchrun per node, against the same job augmenting inline: with
producers that keep ahead (against 2 DataLoader workers per rank), and with one producer per node that falls behind
its trainers (against the trainers computing every sample themselves), where each position must still be computed
once on its node and the trainers must not be slower than alone."""

from __future__ import annotations

import json
import os

from benchmark.core import Config, Results, load_now
from benchmark.paths import SCRIPTS, TOOLS
from benchmark.workloads import workspace


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
                           [os.path.join(SCRIPTS, "stream_rank.py"), out, "--mode", mode, "--samples", str(n),
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
    _behind(cfg, results, n)


def _behind(cfg: Config, results: Results, n: int) -> None:
    """Issue 38: one producer per node, slower than its 2 trainers (2 ms of work a sample, batches of 8 every 10 ms),
    against the same job computing every sample in the trainers' own processes; the modes in turn, each round a job
    of 2 epochs. Per node: its computations per position its ranks read (producers' values, published or skipped,
    and readers' computations), the share of the producers' values served (those still ahead when the job ended
    excepted), and the epoch time, stream / inline (the worst rank's, best round of each)."""
    work, step, batch = (0.002, 0.005, 8) if cfg.quick else (0.002, 0.01, 8)
    rounds = 1 if cfg.quick else min(cfg.rounds, 3)
    load_from = round(os.getloadavg()[0], 2)
    elapsed: dict[str, list[float]] = {"stream": [], "inline": []}
    per_read, served_share = [], []
    with workspace("streambehind") as tmp:
        for r in range(rounds):
            for mode in ("stream", "inline"):
                out = os.path.join(tmp, f"{mode}{r}")
                os.makedirs(out)
                extra = ["--producers", "1", "--no-fill"] if mode == "stream" else ["--workers", "0"]
                _two_nodes(os.path.join(tmp, f"nodes-{mode}{r}"),
                           [os.path.join(SCRIPTS, "stream_rank.py"), out, "--mode", mode, "--samples", str(n),
                            "--work", str(work), "--step", str(step), "--batch-size", str(batch), *extra])
                ranks = _ranks(out)
                elapsed[mode].append(sum(max(r["epochs"][e]["elapsed"] for r in ranks)
                                         for e in range(len(ranks[0]["epochs"]))))
                if mode == "stream":
                    for k in (0, 2):  # each node's counters, read by its local rank 0
                        c = ranks[k]["node"]
                        reads = c["served"] + c["computed"]
                        made = c["produced"] + c["skipped"]
                        per_read.append((made + c["computed"]) / reads)
                        served_share.append(c["served"] / max(1, made - c["ahead"]))
    note = (f"N={n}, 2 nodes x 2 ranks on loopback, batch {batch}, {step * 1e3:.0f} ms step, {work * 1e3:.1f} ms work "
            f"a sample; stream: 1 producer per node, the ring empty at the start; inline: the trainers compute; "
            f"{rounds} round(s) of each, interleaved")
    load = [load_from, round(os.getloadavg()[0], 2)]
    results.row("streamnodes", "2 nodes, producers behind: a node's computations per position its ranks read (worst "
                "node and round)", max(per_read), "x", note, load)
    results.row("streamnodes", "2 nodes, producers behind: epoch time, stream (1 producer a node) / trainers computing",
                min(elapsed["stream"]) / min(elapsed["inline"]), "x", note, load)
    results.target("streamnodes.behind_served", min(served_share), load, note)
    results.target("streamnodes.behind_time", min(elapsed["stream"]) / min(elapsed["inline"]), load, note)


def _ranks(out: str) -> list[dict]:
    ranks = []
    for name in sorted(os.listdir(out)):
        with open(os.path.join(out, name)) as f:
            ranks.append(json.load(f))
    return ranks


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
