"""What the loader-order tests compare: which samples each batch holds, epoch by epoch, and the same after a resume.

``ImageLabels``' labels repeat, so a batch's samples are told apart by their images' first bytes.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from helpers.sources import ImageLabels

N = 46  # not a multiple of the ranks or of the batch sizes: padding and short batches matter

_index_of = {bytes(ImageLabels(N)[i][0].reshape(-1)[:16].tolist()): i for i in range(N)}


def labels(batch: Any) -> list[int]:
    """The sample indices of a batch of ``ImageLabels(N)``."""
    return [_index_of[bytes(image.reshape(-1)[:16].tolist())] for image in batch[0]]


def new_process(seed: int | None = None) -> None:
    """What a restarted job starts from: a global random state of its own (``seed``), and no epoch read yet by this
    process's loaders (``ds.loader``'s own shuffle draws the next pass of an epoch this process read before)."""
    from mmapcache.read import order

    order._passes.clear()
    if seed is not None:
        torch.manual_seed(seed)
        np.random.seed(seed)


def epochs(loader: Any, count: int, start: int = 0) -> list[list[list[int]]]:
    """``count`` epochs of ``loader`` from ``start``, ``loader.sampler.set_epoch`` before each (a trainer's loop)."""
    out = []
    for epoch in range(start, start + count):
        loader.sampler.set_epoch(epoch)
        out.append([labels(b) for b in loader])
    return out


def resumed(make: Callable[[], Any], epoch: int, k: int, then: int = 1,
            set_then_load: bool = False) -> tuple[list[list[int]], list[Any]]:
    """Batches of ``make()`` read for epoch ``epoch``'s first ``k`` batches, then (after saving its state and making
    a new loader in a process whose global random state differs) the rest of that epoch and ``then`` more epochs.

    The resumed loop calls ``set_epoch(epoch)`` after ``load_state_dict`` (a hand-written loop), or before it with
    ``set_then_load`` (PyTorch Lightning); ``k == -1`` saves the state after the whole epoch (a checkpoint at the
    epoch's end), and the resumed loop starts at the next epoch."""
    new_process()
    first = make()
    for earlier in range(epoch):  # the epochs before, read whole
        first.sampler.set_epoch(earlier)
        list(first)
    first.sampler.set_epoch(epoch)
    batches = iter(first)
    head = [labels(b) for b in batches] if k == -1 else [labels(next(batches)) for _ in range(k)]
    state = pickle.loads(pickle.dumps(first.state_dict()))  # what a checkpoint holds
    new_process(12345)  # the resumed process's global generator is not the interrupted one's
    second = make()
    rest: list[Any] = []
    start = epoch + 1 if k == -1 else epoch
    for number, later in enumerate(range(start, epoch + 1 + then)):
        if number == 0 and set_then_load:
            second.sampler.set_epoch(later)
            second.load_state_dict(state)
        elif number == 0:
            second.load_state_dict(state)
            second.sampler.set_epoch(later)
        else:
            second.sampler.set_epoch(later)
        rest += [labels(b) for b in second]
    return head, rest
