"""Resume at every point: a loader's states taken after each batch of a pass (0 to all of them), and what a new loader
given each one yields under the loops trainers run (``tests/test_resume_anywhere.py``).

``resume_all`` is the resumed job in another process, all cases in one (a process per case would cost one each).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from helpers.sources import Numbered
from mmapcache import MmapCachedDataset
from mmapcache.errors import DistributedOrderWarning

N = 22  # 6 batches of 4 in one process (the last short), 3 per rank of 2: padding and short batches matter
BATCH = 4

# How the training loop around the resumed loader calls set_epoch:
#   after:   load_state_dict, then set_epoch(epoch) before each pass (a hand-written loop restarted at the state's
#            epoch)
#   before:  set_epoch(epoch), then load_state_dict
#   trainer: load_state_dict, iter(), then set_epoch(the trainer's epoch) before the first batch (PyTorch Lightning:
#            from a state taken after an epoch's last batch, its epoch is the next one)
#   never:   no set_epoch at all (the original loop never called it either: each pass a new order)
SET_EPOCH_MODES = ("after", "before", "trainer")


@dataclass
class Case:
    """One resumed run: the state taken after ``k`` batches of pass ``e`` (an epoch, or with ``mode`` never a
    pass of epoch 0; ``k`` -1: after the pass ended), resumed under ``mode``, its loop's first pass for epoch
    ``first``; ``expected`` is what the original loader went on to yield, pass by pass."""

    mode: str
    e: int
    k: int
    first: int
    state: dict[str, Any]
    expected: list[list[list[int]]]

    @property
    def name(self) -> str:
        where = "after the end" if self.k == -1 else f"after {self.k} batches"
        return f"{self.mode}: a state {where} of {'pass' if self.mode == 'never' else 'epoch'} {self.e}"


def options(workers: int, ranks: int, rank: int = 1) -> dict[str, Any]:
    placement = {"rank": rank, "world_size": ranks} if ranks > 1 else {}
    return {"batch_size": BATCH, "shuffle": True, "num_workers": workers, **placement}


def ids(batch: Any) -> list[int]:
    return batch[1].tolist()


@contextlib.contextmanager
def unwarned(set_epoch: bool) -> Iterator[None]:
    """A loop without set_epoch in a job of several ranks reads DistributedSampler's order of the same epoch again,
    and is warned about it (``test_loader_order.py``); here it is done on purpose."""
    with warnings.catch_warnings():
        if not set_epoch:
            warnings.simplefilter("ignore", DistributedOrderWarning)
        yield


def original(ds: MmapCachedDataset, opts: dict[str, Any], set_epoch: bool,
             passes: int = 4) -> tuple[list[list[list[int]]], dict[int, list[dict[str, Any]]]]:
    """Reads ``passes`` passes (epochs 0.. with set_epoch, else passes of epoch 0), taking a state after ``iter()``
    (before the first batch), after every batch, and after the pass ended, of the first ``passes - 2``; returns the
    batches of each pass and those states by pass (the one after the end last)."""
    with unwarned(set_epoch):
        return _original(ds, opts, set_epoch, passes)


def _original(ds: MmapCachedDataset, opts: dict[str, Any], set_epoch: bool,
              passes: int) -> tuple[list[list[list[int]]], dict[int, list[dict[str, Any]]]]:
    loader = ds.loader(**opts)
    read: list[list[list[int]]] = []
    states: dict[int, list[dict[str, Any]]] = {}
    for p in range(passes):
        if set_epoch:
            loader.sampler.set_epoch(p)
        batches = iter(loader)
        taken = [pickle.loads(pickle.dumps(loader.state_dict()))]  # what a checkpoint holds
        read.append([])
        for batch in batches:
            read[-1].append(ids(batch))
            taken.append(pickle.loads(pickle.dumps(loader.state_dict())))
        taken.append(pickle.loads(pickle.dumps(loader.state_dict())))
        if p < passes - 2:
            states[p] = taken
    return read, states


def cases(read: list[list[list[int]]], states: dict[int, list[dict[str, Any]]], set_epoch: bool,
          edges_only: bool = False) -> list[Case]:
    """The resumed runs of ``states``; with ``edges_only``, of the last pass's states at the edges only: after
    ``iter()``, after the first batch, before and after the last, after the end."""
    out = []
    for e, taken in states.items():
        whole = len(read[e])
        for k, state in zip([*range(whole + 1), -1], taken):
            if edges_only and (e != max(states) or k not in (0, 1, whole - 1, whole, -1)):
                continue
            rest = [read[e + 1], read[e + 2]] if k == -1 else [read[e][k:], read[e + 1], read[e + 2]]
            for mode in SET_EPOCH_MODES if set_epoch else ("never",):
                if mode == "trainer" and k == whole:  # it moves on to the next epoch: it reads no empty pass
                    out.append(Case(mode, e, k, e + 1, state, rest[1:]))
                else:
                    out.append(Case(mode, e, k, e + 1 if k == -1 else e, state, rest))
    return out


def resume(ds: MmapCachedDataset, opts: dict[str, Any], case: Case) -> list[list[list[int]]]:
    """What a new loader over ``ds`` yields for ``case``, pass by pass."""
    with unwarned(case.mode != "never"):
        return _resume(ds, opts, case)


def _resume(ds: MmapCachedDataset, opts: dict[str, Any], case: Case) -> list[list[list[int]]]:
    loader = ds.loader(**opts)
    if case.mode == "before":
        loader.sampler.set_epoch(case.first)
    loader.load_state_dict(case.state)
    out = []
    for p, epoch in enumerate(range(case.first, case.first + len(case.expected))):
        if case.mode == "trainer":
            batches = iter(loader)
            loader.sampler.set_epoch(epoch)
            out.append([ids(b) for b in batches])
            continue
        if case.mode == "after" or (case.mode == "before" and p):
            loader.sampler.set_epoch(epoch)
        out.append([ids(b) for b in loader])
    return out


def resume_all(path: str, opts: dict[str, Any], todo: list[Case], results: Any) -> None:
    """The resumed job in another process: puts what each case's resumed loader yielded on ``results``. Each case
    gets a new dataset object (no set_epoch seen, no pass read) and torch's global generator reseeded (the resumed
    process's is not the interrupted one's). Its DataLoader workers are forked, as the original loader's were (a
    forkserver's child would start them from its server)."""
    multiprocessing.set_start_method("fork", force=True)
    got = []
    for case in todo:
        torch.manual_seed(12345)
        with MmapCachedDataset(path, Numbered(N), fingerprint="numbered") as ds:
            got.append(resume(ds, opts, case))
    results.put(got)
