"""A mixture's epoch order: how many samples each source gives (``apportion``), which ones (``draw``), and in what
order (``mix_order``), as a function of ``(seed, epoch, pass, the counts, the sources' lengths)`` alone (and, with
per-batch composition, the batch size): the same in every process, on every rank, in every run.

Samples are *flat ids*: source ``s``'s index ``i`` is ``starts[s] + i``, ``starts`` the sources' lengths summed
before it, so one int64 array is the epoch's order, which ``read.epoch_split`` cuts into the ranks' batches.

- **Counts.** ``weights`` become counts of an ``epoch_size`` by largest remainders (each within 1 of its share,
  summing exactly; ties go to the earlier source), or are given as counts.
- **Draws.** Source ``s`` gives ``c`` samples of its ``n``: ``c // n`` whole permutations of it, then ``c % n``
  drawn without replacement from another, each seeded by ``(seed, epoch, pass, s)``: within an epoch a sample
  repeats only once every sample of its source has been drawn as often (a source over-weighted past its size is
  repeated whole first), and a source under-weighted gives a random subset, another each epoch.
- **Interleaving.** The sources' positions in the epoch are a seeded shuffle of their counts; with ``per_batch``
  each source's positions are spread evenly over the epoch instead, so that every block of consecutive positions
  (a rank's batch: ``read.epoch_split.blocks``) holds each source within one sample of its share, and the epoch's
  counts are exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["apportion", "draw", "mix_order", "source_of"]

# Streams of numpy's seed sequence, one per use (a draw of source s, the interleaving).
_DRAW, _MIX = 1, 2


def apportion(weights: Sequence[float], total: int) -> np.ndarray:
    """Non-negative int64 counts, one per weight, summing to ``total``, each within 1 of ``total * w / sum(w)``:
    largest remainders, ties to the earlier source."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    left = total - int(counts.sum())
    if left > 0:
        counts[np.argsort(-(exact - counts), kind="stable")[:left]] += 1
    return counts


def draw(length: int, count: int, seed: int, epoch: int, repeat: int, source: int) -> np.ndarray:
    """``count`` indices of a source of ``length`` samples (see the module docstring), int64."""
    if not count:
        return np.empty(0, np.int64)
    rng = np.random.default_rng([seed % 2**64, epoch % 2**64, repeat, source, _DRAW])
    whole, rest = divmod(count, length)
    parts = [rng.permutation(length) for _ in range(whole)]
    if rest:
        parts.append(rng.choice(length, size=rest, replace=False))
    return np.concatenate(parts).astype(np.int64, copy=False)


def mix_order(lengths: Sequence[int], given: Sequence[int], seed: int, epoch: int, repeat: int,
              per_batch: bool = False) -> np.ndarray:
    """The epoch's order of flat ids, ``given[s]`` samples of each source (see the module docstring)."""
    counts = np.asarray(given, np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    total = int(counts.sum())
    if not per_batch:
        sources = np.repeat(np.arange(len(counts)), counts)
        np.random.default_rng([seed % 2**64, epoch % 2**64, repeat, _MIX]).shuffle(sources)
    else:
        sources = _stratified(counts, total)
    order = np.empty(total, np.int64)
    for s, (length, count) in enumerate(zip(lengths, counts.tolist())):
        if count:
            order[sources == s] = starts[s] + draw(int(length), count, seed, epoch, repeat, s)
    return order


def _stratified(counts: np.ndarray, total: int) -> np.ndarray:
    """The source of each position, each source's ``c`` positions spread evenly over the ``total`` (its ``k``-th at
    ``(k + 1/2) * total / c``, ties to the earlier source): any ``B`` consecutive positions hold within one sample of
    each source's share of ``B``, so every block of a rank's batch does, and the epoch holds the counts exactly."""
    sources = np.repeat(np.arange(len(counts)), counts)
    ks = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    at = (2 * ks + 1) * total / (2.0 * np.repeat(np.maximum(counts, 1), counts))
    return sources[np.argsort(at, kind="stable")]


def source_of(ids: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The source of each flat id (``starts``: each source's first flat id)."""
    return np.searchsorted(starts, ids, side="right") - 1
