"""Distributed data parallel training over one shared, node-local cache per node.

    torchrun --standalone --nproc-per-node=2 examples/ddp.py                  # one machine, 2 processes
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=8 \\
        --master-addr=HOST0 --master-port=29500 examples/ddp.py  # first node; node-rank=1 on the other
    srun --ntasks-per-node=8 python examples/ddp.py                           # under SLURM (see README)

Every rank opens the same cache path. On one node that is one copy in its /dev/shm, shared by all its ranks
(and their DataLoader workers); each node of a multi-node job has its own copy, built by its own ranks, and no
sample crosses the network. ``prefill`` splits the first fill between the node's ranks (each sample is
computed once per node), ``ds.sampler()`` then splits each epoch between all ranks of the job (as
``DistributedSampler`` does).

With ``--node-share`` (a dataset larger than one node's memory) each node caches only its share of the dataset,
and ``ds.sampler()`` keeps each rank on its node's share: every index is still read once per epoch across the
job, and no rank reads from the source after the first epoch. ``--rotate-every E`` draws the shares again every
E epochs.

Backend: nccl when CUDA is available, gloo otherwise (this example also runs on CPU-only machines).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from mmapcache import MmapCachedDataset


class SlowFeatures(Dataset):
    """A stand-in for expensive preprocessing: deterministic ``(features, label)`` pairs, ``delay`` s each."""

    def __init__(self, n: int, dim: int = 64, classes: int = 4, delay: float = 0.005) -> None:
        self.n, self.dim, self.classes, self.delay = n, dim, classes, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.delay)
        label = i % self.classes
        g = torch.Generator().manual_seed(i)
        features = torch.randn(self.dim, generator=g) + label  # learnable: the label shifts the mean
        return features, label


def say(line: str) -> None:
    """Prints one line in one write: ranks share stdout, and print() writes the text and the newline separately
    (two system calls when output is unbuffered), so lines of two ranks could run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def setup_distributed() -> tuple[int, int, torch.device]:
    """Initialises the process group from torchrun's (or SLURM's) environment; returns rank, world, device."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:  # srun: map SLURM's variables to torch's
        env.setdefault("RANK", env["SLURM_PROCID"])
        env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
        env.setdefault("LOCAL_RANK", env["SLURM_LOCALID"])
    if "RANK" not in env:
        sys.exit("ddp.py: start it with torchrun (e.g. `torchrun --standalone --nproc-per-node=2 examples/ddp.py`) "
                 "or srun; RANK/WORLD_SIZE are not set")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(env.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=None,
                        help="cache path or bare name (default: ddp-example, or ddp-example-<job id> with "
                             "--delete-on-close)")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per epoch (a short demo)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    parser.add_argument("--delete-on-close", action="store_true",
                        help="a per-job cache: removed when the last process of this node closes it")
    parser.add_argument("--node-share", action="store_true",
                        help="each node caches only its share of the dataset (larger than one node's memory)")
    parser.add_argument("--rotate-every", type=int, default=None, metavar="E",
                        help="with --node-share: draw the shares again every E epochs")
    args = parser.parse_args(argv)

    rank, world, device = setup_distributed()
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    name = args.cache or ("ddp-example" + (f"-{job}" if args.delete_on_close and job else ""))
    source = SlowFeatures(args.samples)
    ds = MmapCachedDataset(name, source, fingerprint=f"slow-features-{args.samples}",
                           delete_on_close=args.delete_on_close, node_share=args.node_share,
                           rotate_every=args.rotate_every)

    start = time.perf_counter()
    if ds.created:  # this rank created the cache: it stored the first sample and a few layout probes then
        say(f"rank {rank}/{world}: created {ds.path} with {ds.num_cached} samples")
    stored = ds.prefill()  # this node's ranks fill disjoint parts; returns after a barrier
    held = f" (share: {ds.share.describe(len(ds))})" if ds.share is not None else ""
    say(f"rank {rank}/{world}: prefill stored {stored} samples in {time.perf_counter() - start:.2f} s; "
        f"{ds.num_cached}/{len(ds)} cached at {ds.path}{held}")

    sampler = ds.sampler(shuffle=True, seed=0)  # DistributedSampler's split; with a node share, the node's own
    # ds.loader, not DataLoader(ds, ...): it hands each batch the epoch that was current when the epoch's
    # iteration began, so ds.set_epoch reaches persistent workers too (a plain DataLoader's persistent workers
    # keep the copy of the dataset they started with, and would serve epoch 0's variant forever).
    loader = ds.loader(batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                       persistent_workers=args.workers > 0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(source.dim, 32), nn.ReLU(),
                                                  nn.Linear(32, source.classes)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle each epoch; also ds.set_epoch (variants, rotation)
        if args.rotate_every and epoch % args.rotate_every == 0 and epoch:
            ds.prefill()  # a new generation of shares: fill this node's new share together
        losses = []
        for step, (features, labels) in enumerate(loader):
            if step == args.steps:
                break
            loss = nn.functional.cross_entropy(model(features.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        mean = torch.tensor([sum(losses) / max(1, len(losses))], device=device)
        dist.all_reduce(mean)
        if rank == 0:
            say(f"epoch {epoch}: mean loss over {world} ranks {mean.item() / world:.4f}")
    del loader
    dist.barrier()  # everyone is done reading before the last one out may remove a per-job cache
    ds.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # The job is done, its process group destroyed and its cache closed: the rank exits at once. Left to the
    # interpreter's shutdown, torch 2.13's gloo backend (CPU) aborted ranks after the job ('terminate called without an
    # active exception', SIGABRT): 6 of 36 two-node runs of plain torch DDP on one loaded host, without mmapcache;
    # 0 of 30 exiting at once (tools/gloo_exit_repro.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
