"""What an epoch's order is, as one int64 array: the own shuffle's global order (``global_order``), the part a rank
reads of ``DistributedSampler``'s (``distributed_indices``), and a sampler's indices drawn as its ``__iter__`` draws
them (``epoch_indices``). Pure functions of what the order is drawn from (``read.resume.EpochStart``); the loader's
order (``read.order``) splits them across ranks (``read.epoch_split``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.utils.data import RandomSampler, SequentialSampler

__all__ = ["distributed_indices", "epoch_indices", "global_order"]


def global_order(n: int, *, shuffle: bool, seed: int, epoch: int, repeat: int, world: int,
                 generator: torch.Generator | None) -> np.ndarray:
    """The order of epoch ``epoch`` of ``ds.loader``'s own shuffle for a job of ``world`` ranks, before its split:
    ``DistributedSampler``'s permutation of ``(seed, epoch)``; one process draws as ``DataLoader(shuffle=True)``
    with a ``generator`` (``RandomSampler`` over it), and a pass of an epoch read again (``repeat``) as a new
    permutation of ``(seed, epoch, repeat)``. ``shuffle=False``: ``0 .. n-1``."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    if world == 1:
        if generator is not None:
            return epoch_indices(RandomSampler(range(n), generator=generator))
        if repeat:  # read again without set_epoch: a new order, as with DataLoader(shuffle=True)
            return np.random.default_rng([seed % 2**64, epoch % 2**64, repeat]).permutation(n)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator).numpy().astype(np.int64, copy=False)


def distributed_indices(n: int, rank: int, size: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """What ``DistributedSampler(dataset of n, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed)`` yields
    after ``set_epoch(epoch)`` (``drop_last=False``), as one int64 array: the same draws."""
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=generator).numpy().astype(np.int64, copy=False)
    else:
        order = np.arange(n, dtype=np.int64)
    total = math.ceil(n / size) * size
    order = np.resize(order, total)  # pads by repeating from the start, as DistributedSampler does
    return order[rank:total:size]


def epoch_indices(sampler: Any) -> np.ndarray:
    """The indices ``iter(sampler)`` would yield, as one int64 array.

    ``RandomSampler`` draws exactly as its ``__iter__`` does (torch 2.x): a seed from the global generator when it
    has none of its own, then one ``randperm`` per pass over the data plus one for the remainder (without
    replacement), or ``randint`` in chunks of 32 (with): the same calls on the same generator, so the same order
    and the same generator state afterwards, without turning each index into a Python int. (Eagerly: a pass broken
    off before its end has also drawn the last ``randperm``, which ``RandomSampler`` draws when it is exhausted.)
    """
    own = getattr(sampler, "epoch_indices", None)  # ShareSampler: the epoch as one array
    if own is not None:
        return own()
    if type(sampler) is SequentialSampler:
        return np.arange(len(sampler), dtype=np.int64)
    if type(sampler) is RandomSampler:
        n, count = len(sampler.data_source), sampler.num_samples
        generator = sampler.generator
        if generator is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator()
            generator.manual_seed(seed)
        if sampler.replacement:
            parts = [torch.randint(high=n, size=(32,), dtype=torch.int64, generator=generator)
                     for _ in range(count // 32)]
            parts.append(torch.randint(high=n, size=(count % 32,), dtype=torch.int64, generator=generator))
        else:
            parts = [torch.randperm(n, generator=generator) for _ in range(count // n)]
            parts.append(torch.randperm(n, generator=generator)[:count % n])
        return torch.cat(parts).numpy().astype(np.int64, copy=False)
    return np.fromiter(iter(sampler), np.int64, count=len(sampler))
