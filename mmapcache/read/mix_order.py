"""A mixture's epoch order: how many samples each source gives (``apportion``), which ones (``draw``), and where they
go (``EpochPlan``), as a function of ``(seed, epoch, pass, the counts, the sources' lengths, the batch size)`` alone:
the same in every process, on every rank, in every run.

Samples are *flat ids*: source ``s``'s index ``i`` is ``starts[s] + i``, ``starts`` the sources' lengths summed
before it, so one int64 array is the epoch's order, which ``read.epoch_split`` cuts into the ranks' batches.

- **Counts.** ``weights`` become counts of an ``epoch_size`` by largest remainders (each within 1 of its share,
  summing exactly; ties go to the earlier source), or are given as counts.
- **Draws.** Source ``s`` gives its ``c`` samples of ``n`` as a random sequence: ``c // n`` whole passes over it,
  then ``c % n`` samples drawn without replacement, in a random order, each seeded by ``(seed, epoch, pass, s)``:
  within an epoch a sample repeats only once every sample of its source has been drawn as often (a source
  over-weighted past its size is repeated whole first), and a source under-weighted gives a random subset, another
  each epoch.
- **Units.** The order is cut into units of ``B`` positions (the batch size; the last one shorter), and each unit
  holds ``composition[j, s]`` samples of source ``s``, grouped by source: the next ones of that source's sequence.
  With a random mix the compositions are those of a uniformly random interleaving of the sources' samples (the
  counts split between halves of the epoch by hypergeometric draws, halves again, down to units), so the order is
  distributed as a shuffle of every sample drawn, grouped by source within each batch; with ``per_batch`` every
  unit holds each source's share of it rounded down or up (within one), the epoch each count exactly. A
  rank's batch is a unit (``read.epoch_split.blocks``), read one gather per source (``read.mix_batches``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["EpochPlan", "MixPass", "apportion", "draw", "grouped", "plan", "source_of"]

# Streams of the seed sequence, one per use (a draw of source s, the compositions).
_DRAW, _MIX = 1, 2


@dataclasses.dataclass(frozen=True)
class MixPass:
    """What a pass's order is drawn from: the epoch, its pass (an epoch read again), each source's count, and the
    units it is composed in (the batch size it was drawn for)."""

    epoch: int
    repeat: int
    counts: tuple[int, ...]
    unit: int


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
    """``count`` indices of a source of ``length`` samples in a random sequence (see the module docstring), int64."""
    if not count:
        return np.empty(0, np.int64)
    generator = _generator(seed, epoch, repeat, source, _DRAW)
    whole, rest = divmod(count, length)
    parts = [torch.randperm(length, generator=generator).numpy() for _ in range(whole)]
    if rest * 8 < length:  # a small subset: drawn in its own size, not a permutation of the whole source
        rng = np.random.default_rng(int(torch.randint(0, 2**62, (), generator=generator)))
        parts.append(rng.choice(length, size=rest, replace=False))
    elif rest:
        parts.append(torch.randperm(length, generator=generator).numpy()[:rest])
    return (parts[0] if len(parts) == 1 else np.concatenate(parts)).astype(np.int64, copy=False)


def _generator(*words: int) -> torch.Generator:
    """A torch generator seeded by numpy's seed sequence of ``words`` (torch's ``randperm`` draws a permutation in
    half the time numpy's takes)."""
    state = np.random.SeedSequence([w % 2**64 for w in words]).generate_state(1, np.uint64)[0]
    generator = torch.Generator()
    generator.manual_seed(int(state) & ((1 << 63) - 1))
    return generator


class EpochPlan:
    """One pass's order of a mixture: each unit's composition (see the module docstring) and the order itself, held
    as each source's index in that source (``local``: unit after unit, each grouped by source), so that a unit is a
    slice of it, read without building anything.

    Args:
        drawn: each source's sequence of its indices, in the order it is used.
        composition: ``(units, sources)`` counts.
        unit: positions per unit (the last one may be shorter).
        starts: each source's first flat id.
    """

    def __init__(self, drawn: list[np.ndarray], composition: np.ndarray, unit: int, starts: np.ndarray) -> None:
        self.composition, self.unit, self.starts = composition, unit, starts
        self.total = int(composition.sum())
        units = len(composition)
        # bounds[j, s]: where source s's part of unit j starts in the unit (bounds[j, -1]: the unit's size).
        self.bounds = np.zeros((units, composition.shape[1] + 1), np.int64)
        np.cumsum(composition, axis=1, out=self.bounds[:, 1:])
        self.unit_starts = np.zeros(units + 1, np.int64)
        np.cumsum(self.bounds[:, -1], out=self.unit_starts[1:])
        # The k-th of source s's sequence goes to position k + (its unit's start + its part's start there - the
        # samples of s in the units before): one repeat and one scatter per source.
        # (In place, one temporary array at a time: fresh memory is what a plan of many samples spends most on.)
        used = np.cumsum(composition, axis=0) - composition
        self.local = np.empty(self.total, np.int64)
        steps = np.arange(max((len(d) for d in drawn), default=0), dtype=np.int64)
        for s, sequence in enumerate(drawn):
            positions = np.repeat(self.unit_starts[:-1] + self.bounds[:, s] - used[:, s], composition[:, s])
            positions += steps[:len(sequence)]
            self.local[positions] = sequence
        self._bounds = [tuple(b) for b in self.bounds.tolist()]

    def unit_batch(self, j: int) -> tuple[np.ndarray, tuple[int, ...]]:
        """Unit ``j`` as a batch is read (``grouped``'s form): its indices in their sources, grouped by source, and
        the bounds of each source's."""
        return self.local[self.unit_starts[j]:self.unit_starts[j + 1]], self._bounds[j]

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The flat ids at ``positions`` (int64, in ``[0, total)``) of the order."""
        j = np.searchsorted(self.unit_starts, positions, side="right") - 1
        offset = positions - self.unit_starts[j]
        source = (offset[:, None] >= self.bounds[j, 1:-1]).sum(axis=1)
        return self.local[positions] + self.starts[source]

    def order(self) -> np.ndarray:
        """The whole order of flat ids (each unit's, in turn)."""
        return self.at(np.arange(self.total, dtype=np.int64))


def plan(lengths: Sequence[int], given: Sequence[int], seed: int, epoch: int, repeat: int, unit: int,
         per_batch: bool = False, pools: Sequence[np.ndarray] | None = None) -> EpochPlan:
    """The epoch's plan, ``given[s]`` samples of each source in units of ``unit`` positions (see the module
    docstring). With ``pools`` (a node's shares), source ``s``'s samples are drawn from ``pools[s]``, the indices it
    holds, and ``lengths`` are still the sources' (for the flat ids)."""
    counts = np.asarray(given, np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    drawn = []
    for s, count in enumerate(counts.tolist()):
        pool = None if pools is None else pools[s]
        picked = draw(len(pool) if pool is not None else int(lengths[s]), count, seed, epoch, repeat, s)
        drawn.append(picked if pool is None else pool[picked])
    total = int(counts.sum())
    sizes = np.full(-(-total // unit), unit, np.int64)
    if len(sizes):
        sizes[-1] = total - unit * (len(sizes) - 1)
    if per_batch:
        composition = _spread(counts, sizes)
    else:
        rng = np.random.default_rng([seed % 2**64, epoch % 2**64, repeat, _MIX])
        composition = _random_split(counts, sizes, rng)
    return EpochPlan(drawn, composition, unit, starts)


def _random_split(counts: np.ndarray, sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``(units, sources)``: how many samples of each source each unit of ``sizes`` holds in a uniformly random
    interleaving of ``counts`` samples: each span of units split in two halves, a source at a time by
    hypergeometric draws (multivariate hypergeometric, as a shuffle splits them), down to single units. A few numpy
    calls per halving, for all spans at once."""
    units, sources = len(sizes), len(counts)
    out = np.zeros((units, sources), np.int64)
    ends = np.cumsum(sizes)
    lo, hi, held = np.array([0]), np.array([units]), counts[None, :].copy()
    while len(lo):
        single = hi - lo == 1
        out[lo[single]] = held[single]
        lo, hi, held = lo[~single], hi[~single], held[~single]
        if not len(lo):
            break
        mid = (lo + hi) // 2
        need = ends[mid - 1] - np.where(lo > 0, ends[lo - 1], 0)  # positions in the left half
        left = np.empty_like(held)
        others = held.sum(axis=1)
        for s in range(sources):
            others = others - held[:, s]
            left[:, s] = rng.hypergeometric(held[:, s], others, need) if s < sources - 1 else need
            need = need - left[:, s]
        lo, hi, held = np.concatenate((lo, mid)), np.concatenate((mid, hi)), np.concatenate((left, held - left))
    return out


def _spread(counts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``(units, sources)``: each unit of ``sizes`` holds each source's share of it (``size x count / total``)
    rounded down or up, the units summing to each source's count exactly. Unit by unit, each source gets its share
    rounded down, and the units left go to the sources owed most so far (what they were given minus their exact
    shares; ties to the earlier source): that keeps every source within one sample of its exact running total, so
    each unit's count is within one of its share (a controlled rounding of the proportional matrix). In integers
    (shares scaled by the total): the same in every process."""
    counts_ = [int(c) for c in counts]
    total = sum(counts_)
    out = np.zeros((len(sizes), len(counts_)), np.int64)
    if not total:
        return out
    owed = [0] * len(counts_)  # per source: (given - exact share) x total, so far
    for j, size in enumerate(sizes.tolist()):
        shares = [divmod(size * count, total) for count in counts_]
        left = size - sum(whole for whole, _ in shares)
        ahead = [owed[s] - part for s, (_, part) in enumerate(shares)]  # given - exact after the rounded-down share
        more = set(sorted(range(len(counts_)), key=lambda s: (ahead[s], s))[:left])
        for s, (whole, _) in enumerate(shares):
            extra = s in more
            out[j, s] = whole + extra
            owed[s] = ahead[s] + extra * total
    return out


def source_of(ids: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The source of each flat id (``starts``: each source's first flat id)."""
    return np.searchsorted(starts, ids, side="right") - 1


def grouped(batches: list[np.ndarray], starts: np.ndarray) -> list[tuple[np.ndarray, tuple[int, ...]]]:
    """Batches of flat ids in any order (a pass resumed on other ranks or batch sizes, an epoch's padded tail) as
    ``(indices, bounds)``, as ``EpochPlan`` gives its units: grouped by source (sources in order, each in the
    batch's order), ``indices`` their indices in their sources, source ``s``'s being ``indices[bounds[s]:bounds[s +
    1]]``. All batches at once: a few passes per source over them, no sort."""
    if not batches:
        return []
    sizes = np.array([len(b) for b in batches], np.int64)
    flat = np.concatenate(batches)
    sources = source_of(flat, starts)
    which = np.repeat(np.arange(len(batches)), sizes)
    counts = np.bincount(which * len(starts) + sources, minlength=len(batches) * len(starts))
    # Each batch's counts of source 0, then 1, ...; each source's samples keep their order, so the k-th of source s
    # in the grouped sequence is its k-th in the batches'.
    grouped_sources = np.repeat(np.tile(np.arange(len(starts)), len(batches)), counts)
    local = np.empty_like(flat)
    for s in range(len(starts)):
        local[grouped_sources == s] = flat[sources == s] - starts[s]
    bounds = np.zeros((len(batches), len(starts) + 1), np.int64)
    np.cumsum(counts.reshape(len(batches), len(starts)), axis=1, out=bounds[:, 1:])
    return list(zip(np.split(local, np.cumsum(sizes)[:-1]), map(tuple, bounds.tolist())))
