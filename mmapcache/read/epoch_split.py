"""How an epoch's order is split across a job's ranks, and what is left of it after a loader state: the arithmetic
that makes a resume *elastic* (a state saved by ``W`` ranks continues on ``W'``).

An epoch is one *global order* (int64 ids: sample indices, or a mixture's flat ids), the same in every process.
Ranks read it in steps, every rank one batch a step, and after ``k`` steps of ``W`` ranks with batches of ``B`` the
job has read exactly its first ``offset = k * B * W`` positions, whichever of the two layouts below split it (as
long as those batches were whole: only an epoch's last batch may be short, and a state taken after it says the
epoch is over). A state records that offset; the loader that loads it, on any number of ranks and with any batch
size, reads ``order[offset:]`` split across its own ranks by the same rule: over the job, the rest of the epoch is
read once, nothing repeated or skipped but the padding below.

Both layouts pad the order, as ``DistributedSampler`` does, by repeating its start, so that every rank reads the
same number of positions (``ceil(rest / W)``) and takes the same number of steps; with ``W`` unchanged and an offset
of whole steps the padding is the uninterrupted pass's own, so a resume on the same ranks reads exactly what the
uninterrupted pass would have:

- ``interleaved`` (``ds.loader``'s own order, ``DistributedSampler``'s split): rank ``r`` reads positions
  ``r, r + W, r + 2W, ...``, in batches of ``B``;
- ``blocks`` (a mixture's): the order is cut into blocks of ``B``, and rank ``r`` reads blocks ``r, r + W, ...``
  (so a batch is a block, which a mixture composes per batch); where each rank has fewer than ``B`` positions left
  (``t``), the last ``W * t`` are dealt out, rank ``r`` taking every ``W``-th from the ``r``-th: a mixture's units
  hold their samples grouped by source, and a rank's ``t`` in a row of them were mostly one source.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["block_spans", "blocks", "consumed", "interleaved", "padded_rest"]


def padded_rest(order: np.ndarray, offset: int, world: int, total: int | None = None) -> np.ndarray:
    """``order[offset:]`` padded by repeating the order's start (cyclically) to a multiple of ``world``, or to
    ``total`` positions (at least the rest's: a node of a job whose nodes read orders of their own, every rank the
    job's number of steps)."""
    rest = order[min(offset, len(order)):]
    if total is None:
        total = math.ceil(len(rest) / world) * world
    if total == len(rest):
        return rest
    # (from an offset inside the padding, it goes on where the padding was)
    skipped = (offset - len(order)) % len(order) if offset > len(order) and len(order) else 0
    return np.concatenate((rest, np.resize(np.roll(order, -skipped), total - len(rest))))


def interleaved(order: np.ndarray, offset: int, rank: int, world: int) -> np.ndarray:
    """Rank ``rank`` of ``world``'s positions of ``order[offset:]``, in reading order: ``DistributedSampler``'s split
    (``offset`` 0: exactly what it yields after ``set_epoch`` for an order it drew)."""
    return padded_rest(order, offset, world)[rank::world]


def blocks(order: np.ndarray, offset: int, rank: int, world: int, batch: int, drop_last: bool,
           total: int | None = None) -> list[np.ndarray]:
    """Rank ``rank`` of ``world``'s batches of ``order[offset:]`` in the block layout (see the module docstring),
    padded as ``padded_rest`` pads; the short last one left out with ``drop_last``."""
    padded = padded_rest(order, offset, world, total)
    return [padded[a:b:step] for a, b, step in block_spans(len(padded), rank, world, batch, drop_last)]


def block_spans(padded: int, rank: int, world: int, batch: int, drop_last: bool) -> list[tuple[int, int, int]]:
    """``blocks``' batches as ``(start, stop, step)`` of the padded rest (of ``padded`` positions, a multiple of
    ``world``): what a reader that needs no arrays of positions reads (a mixture's whole units; step 1 but in the
    short last batch, which takes every ``world``-th position)."""
    per_rank = padded // world
    whole, tail = divmod(per_rank, batch)
    out = [((b * world + rank) * batch, (b * world + rank + 1) * batch, 1) for b in range(whole)]
    if tail and not drop_last:
        start = whole * world * batch
        out.append((start + rank, start + world * tail, world))
    return out


def consumed(steps: int, batch: int, world: int) -> int:
    """Positions of the order a job of ``world`` ranks has read after ``steps`` whole batches of ``batch`` each."""
    return steps * batch * world
