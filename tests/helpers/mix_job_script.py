"""One rank of a mixture job, started by torchrun (``python -m torch.distributed.run``): what it read, written to
``<results>/rank<R>.json`` for ``test_mixture_jobs.py`` to check across ranks and jobs.

Every rank opens the job caches (``helpers.mix_sources.job_caches``, under the node's ``MMAPCACHE_DIR``; the first
rank to open one creates it, and every read of a sample not yet stored computes and stores it) and mixes them:
weights 0.5/0.3/0.2 over epochs of 50 samples (25/15/10: source ``c`` holds 7, so it repeats), batches of 4, its
rank and job size found in torchrun's environment. The phases, in this order, each with a new ``Mixture``:

- ``--resume DIR``: job B. For each state in ``DIR`` (``<case>-<token>.pt``, rank 0's, saved by job A), a new
  loader of that case loads it, ``set_epoch(1)`` is called after it (where Lightning calls it), and the loader reads
  the rest of epoch 1 and then epoch 2; then a new loader of a new mixture reads epoch 2 (what a job that never
  resumed reads).
- ``--cover``: two epochs with ``set_epoch``, with 0 and with 2 workers; rank 0 also reads them as one rank
  (``rank=0, world_size=1``): each epoch's order.
- ``--save DIR``: job A. For each ``--save-at`` token (a number of batches, or ``last``: every batch of the epoch,
  the iterator not yet exhausted, as a trainer's last step checkpoints), reads that many batches of epoch 1 and
  saves rank 0's ``loader.state_dict()`` with ``torch.save`` (what a trainer saves) as ``DIR/mix-<token>.pt``; with
  ``--single``, the same for ``ds.loader(shuffle=True)`` over one cache (``DIR/single-<token>.pt``). Rank 0 also
  reads epoch 1 as one rank: its order.

Every mixture batch is read with ``return_source=True``, and every batch is checked where it is read (every value
its sample's id, every source number its id's tag); one that fails is listed under ``bad``. ``--workers N``: the
loaders' workers in the resume and save phases.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from helpers.mix_sources import Rows, ids_of, job_mixture, rows_intact, sources_agree
from helpers.rank_exit import exit_now
from mmapcache import Mixture, MmapCachedDataset

EPOCH_SIZE, SEED, BATCH = 50, 5, 4
SINGLE, SINGLE_TAG, SINGLE_SEED, SINGLE_BATCH = 31, 9, 7, 3  # the single cache: 31 Rows of tag 9, batches of 3

bad: list[str] = []  # batches that failed their checks: where, and what they held


def mixture() -> Mixture:
    return job_mixture(epoch_size=EPOCH_SIZE, seed=SEED)


def mix_loader(mix: Mixture, workers: int, **kwargs: Any) -> Any:
    return mix.loader(batch_size=BATCH, return_source=True, num_workers=workers, **kwargs)


def single_loader(workers: int) -> Any:
    ds = MmapCachedDataset("single", Rows(SINGLE, SINGLE_TAG), fingerprint="rows-single")
    return ds.loader(batch_size=SINGLE_BATCH, shuffle=True, seed=SINGLE_SEED, num_workers=workers)


def checked(batch: Any, where: str) -> list[int]:
    """The batch's ids, after checking its values (and its source numbers, for a mixture's batch)."""
    if isinstance(batch[0], (tuple, list)):  # return_source=True: (batch, sources)
        batch, sources = batch
        if not sources_agree(batch[1], sources):
            bad.append(f"{where}: sources {sources.tolist()} for ids {ids_of(batch)}")
    if not rows_intact(batch):
        bad.append(f"{where}: values not those of ids {ids_of(batch)}")
    return ids_of(batch)


def epoch_of(loader: Any, epoch: int, where: str) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)
    return [checked(batch, f"{where}, epoch {epoch}") for batch in loader]


def cover(rank: int) -> dict[str, Any]:
    mix = mixture()
    out: dict[str, Any] = {"counts": mix.counts()}
    for workers in (0, 2):
        loader = mix_loader(mix, workers)
        out[f"workers{workers}"] = {"batches": len(loader),
                                    "epochs": [epoch_of(loader, e, f"cover, {workers} workers") for e in (0, 1)]}
        del loader  # (its workers end with it)
    if rank == 0:
        one = mix_loader(mix, 0, rank=0, world_size=1)
        out["orders"] = [[i for b in epoch_of(one, e, "one rank") for i in b] for e in (0, 1)]
    return out


def cases(single: bool) -> dict[str, Callable[[int], Any]]:
    """The loaders each save and resume phase reads, by case: a new one each time (as a restarted job makes)."""
    made = {"mix": lambda workers: mix_loader(mixture(), workers)}
    if single:
        made["single"] = single_loader
    return made


def save(rank: int, folder: str, tokens: list[str], workers: int, single: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, make in cases(single).items():
        out[case] = {}
        for token in tokens:
            loader = make(workers)
            loader.sampler.set_epoch(1)
            k = len(loader) if token == "last" else int(token)
            batches = iter(loader)
            head = [checked(next(batches), f"{case} saved at {token}") for _ in range(k)]
            if rank == 0:
                torch.save(loader.state_dict(), os.path.join(folder, f"{case}-{token}.pt"))
            out[case][token] = {"k": k, "batches": len(loader), "head": head}
            del batches, loader  # (its workers end with it: the rest of the epoch is not read)
    if rank == 0:
        one = mix_loader(mixture(), 0, rank=0, world_size=1)
        out["order"] = [i for b in epoch_of(one, 1, "one rank") for i in b]
    return out


def resume(folder: str, workers: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    makers = cases(single=True)
    for name in sorted(os.listdir(folder)):
        case, token = name.removesuffix(".pt").split("-")
        loader = makers[case](workers)
        loader.load_state_dict(torch.load(os.path.join(folder, name)))
        where = f"{case} resumed from {token}"
        out.setdefault(case, {})[token] = {"rest": epoch_of(loader, 1, where), "after": epoch_of(loader, 2, where),
                                           "fresh": epoch_of(makers[case](workers), 2, f"{case} fresh")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", required=True)
    parser.add_argument("--cover", action="store_true")
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument("--save-at", default="", help="comma-separated: numbers of batches, or last")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--single", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank, "world": dist.get_world_size()}
    if args.resume:
        out["resumed"] = resume(args.resume, args.workers)
    if args.cover:
        out["cover"] = cover(rank)
    if args.save:
        out["saved"] = save(rank, args.save, args.save_at.split(","), args.workers, args.single)
    out["bad"] = bad
    dist.barrier()  # every rank done before any exits
    dist.destroy_process_group()
    with open(os.path.join(args.results, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
    exit_now()
