"""Which row holds which sample: source index -> slot -> row, and the per-epoch choice of variant.

A cache of ``N`` samples has ``S <= N`` slots (the cacheable samples) of ``K`` variants each, ``R = S * K`` rows
(see ``format.spec``). Sample ``i`` lives in slot ``s = i`` when the slots are a prefix (no ``slot_index``) and ``i <
S``, else in the slot ``s`` with ``slot_index[s] == i``; its variant ``v`` is row ``s * K + v``. (A node share that
rotates holds generation ``g``'s share in its slots in epoch ``e``, ``g = e // rotate_every``: see ``store.share``.)
Which variant an epoch reads is ``epoch % K`` (``variant_choice="epoch"``) or a seeded hash of ``(seed, epoch, i)``
(``"random"``). Every module that maps between indices and rows asks a ``RowMap``; none re-derives it.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from .share import Share

__all__ = ["RowMap", "VARIANT_CHOICES", "mix", "mix_array", "check_index", "check_indices"]

VARIANT_CHOICES = ("epoch", "random")
_MASK64 = (1 << 64) - 1


def mix(seed: int, epoch: int, index: int) -> int:
    """splitmix64 of (seed, epoch, index): a cheap, well-spread per-sample variant choice."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_array(seed: int, epoch: int, idx: np.ndarray) -> np.ndarray:
    """``mix`` over an array of indices (uint64 arithmetic wraps like the masked Python version)."""
    base = np.uint64((seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9) & _MASK64)
    z = base + idx.astype(np.uint64) * np.uint64(0x94D049BB133111EB)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class RowMap:
    """The index <-> slot <-> row mapping of one cache, and its variant choice. Safe in any thread.

    Args:
        length: samples in the source (``N``).
        slots: cacheable samples (``S``).
        variants: versions stored per sample (``K``).
        slot_index: the source index in each slot, or None when the slots are the prefix ``0 .. S-1``.
        variant_choice: ``"epoch"`` or ``"random"`` (see the module docstring).
        seed: the seed of ``"random"``.
        share: the node share a cache holds (``store.share``). A share that rotates maps indices to slots per
            generation of epochs (``keyed``: a reader must then check a row's key, since a row filled under
            another generation holds another index).
    """

    def __init__(self, length: int, slots: int, variants: int, slot_index: np.ndarray | None, *,
                 variant_choice: str = "epoch", seed: int = 0, share: Share | None = None) -> None:
        self.length, self.slots, self.variants = length, slots, variants
        self.rows = slots * variants
        self.slot_index = slot_index
        self.variant_choice, self.seed = variant_choice, seed
        self.share = share
        self.keyed = share is not None and share.rotate_every is not None
        self.total = slots == length  # every index is cacheable: a row for each, no check needed
        self._lookup = None if slot_index is None else _lookup(length, slot_index)
        # The generation whose mapping _lookup holds, with its slot index: replaced whole (one assignment), so a
        # thread reading it never sees the lookup of one generation with the slot index of another.
        self._generation: tuple[int, Lookup | None, np.ndarray | None] = (0, self._lookup, slot_index)

    @classmethod
    def of(cls, store: object, *, variant_choice: str = "epoch", seed: int = 0) -> RowMap:
        """The mapping of an open ``store.store.Store``. A stream's rows hold positions of its order, not indices
        (``store.ring``): no index maps to a row."""
        if store.meta["mode"] == "stream":  # type: ignore[attr-defined]
            return cls(store.length, 0, 1, None)  # type: ignore[attr-defined]
        share = store.meta["share"]  # type: ignore[attr-defined]
        return cls(store.length, store.slots, store.variants, store.slot_index,  # type: ignore[attr-defined]
                   variant_choice=variant_choice, seed=seed, share=None if share is None else Share.from_json(share))

    def _mapping(self, epoch: int) -> tuple[Lookup | None, np.ndarray | None]:
        """``(lookup, slot_index)`` of the generation epoch ``epoch`` reads."""
        if not self.keyed:
            return self._lookup, self.slot_index
        generation = self.share.generation(epoch)  # type: ignore[union-attr]
        current = self._generation
        if current[0] != generation:
            index = self.share.indices(self.length, generation)  # type: ignore[union-attr]
            current = self._generation = (generation, _lookup(self.length, index), index)
        return current[1], current[2]

    # --- one sample (the per-item path: plain ints, no numpy scalars) ------------------------------------------

    def slot(self, index: int, epoch: int = 0) -> int:
        """The slot of source index ``index`` (in range) in epoch ``epoch``, or -1 if it is not cacheable."""
        lookup = self._lookup if not self.keyed else self._mapping(epoch)[0]
        if lookup is None:
            return index if index < self.slots else -1
        return int(lookup[index])

    def row(self, index: int, epoch: int) -> int:
        """The row that epoch ``epoch`` reads for source index ``index``, or -1 if it is not cacheable."""
        # self.slot(index, epoch), inlined: every ds[i] comes here, a hit in about 3 us all told.
        lookup = self._lookup if not self.keyed else self._mapping(epoch)[0]
        slot = (index if index < self.slots else -1) if lookup is None else int(lookup[index])
        k = self.variants
        if slot < 0 or k == 1:
            return slot
        if self.variant_choice == "epoch":
            return slot * k + epoch % k
        return slot * k + mix(self.seed, epoch, index) % k

    def row_at(self, slot: int, variant: int) -> int:
        """The row of ``variant`` of the sample in ``slot``."""
        return slot * self.variants + variant

    # --- many samples ------------------------------------------------------------------------------------------

    def slots_of(self, idx: np.ndarray, epoch: int = 0) -> np.ndarray:
        """The slots of in-range source indices (int64) in epoch ``epoch``, -1 where not cacheable."""
        lookup = self._lookup if not self.keyed else self._mapping(epoch)[0]
        if lookup is None:
            return idx if self.total else np.where(idx < self.slots, idx, -1)
        return lookup[idx]

    def rows_of(self, idx: np.ndarray, epoch: int) -> np.ndarray:
        """``row`` over an array of in-range source indices."""
        slots = self.slots_of(idx, epoch)
        k = self.variants
        if k == 1:
            return slots
        if self.variant_choice == "epoch":
            variant = np.full(len(idx), epoch % k, dtype=np.int64)
        else:
            variant = (mix_array(self.seed, epoch, idx) % np.uint64(k)).astype(np.int64)
        return np.where(slots >= 0, slots * k + variant, -1)

    def all_rows_of(self, idx: np.ndarray, epoch: int = 0) -> np.ndarray:
        """Every variant's row of the cacheable ones among ``idx`` (non-cacheable indices are dropped)."""
        slots = self.slots_of(idx, epoch)
        slots = slots[slots >= 0]
        return (slots[:, None] * self.variants + np.arange(self.variants)).reshape(-1)

    def indices_of_slots(self, slots: np.ndarray, epoch: int = 0) -> np.ndarray:
        """The source index each slot holds in epoch ``epoch``."""
        slots = np.asarray(slots, dtype=np.int64)
        slot_index = self.slot_index if not self.keyed else self._mapping(epoch)[1]
        return slots if slot_index is None else np.asarray(slot_index[slots], dtype=np.int64)

    def index_and_variant(self, rows: np.ndarray, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The source index and the variant each row holds in epoch ``epoch``."""
        slots, variants = np.divmod(np.asarray(rows, dtype=np.int64), self.variants)
        return self.indices_of_slots(slots, epoch), variants

    def keys_of(self, rows: np.ndarray, epoch: int = 0) -> np.ndarray | None:
        """The key each row must hold to serve epoch ``epoch`` (its source index) when rows change meaning (a
        rotating share), else None: no key to check."""
        return self.index_and_variant(rows, epoch)[0] if self.keyed else None

    def cacheable(self, epoch: int = 0) -> np.ndarray:
        """The source indices the cache can hold in epoch ``epoch``, in slot order."""
        return self.indices_of_slots(np.arange(self.slots, dtype=np.int64), epoch)


# Source index -> slot: an array, or for a large dataset a _SortedLookup (both indexed like an array).
Lookup = Any

# Up to this many source indices, the index -> slot lookup is one array (8 bytes per index, per process); past it,
# a binary search over the sorted slot index (memory in the slots, not in the dataset).
_DENSE_LOOKUP = 1 << 24


def _lookup(length: int, slot_index: np.ndarray) -> Lookup:
    """Source index -> slot (-1: not cacheable): ``lookup[i]`` for an int or an array of in-range indices."""
    if length > _DENSE_LOOKUP:
        return _SortedLookup(slot_index)
    lookup = np.full(length, -1, dtype=np.int64)
    lookup[slot_index] = np.arange(len(slot_index), dtype=np.int64)
    return lookup


class _SortedLookup:
    """The lookup of a large dataset's few cacheable indices, by binary search."""

    def __init__(self, slot_index: np.ndarray) -> None:
        self.order = np.argsort(slot_index, kind="stable")
        self.sorted = np.asarray(slot_index)[self.order]

    def __getitem__(self, idx: int | np.ndarray) -> np.ndarray:
        if not len(self.sorted):
            return np.full(np.shape(idx), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(self.sorted, idx), len(self.sorted) - 1)
        return np.where(self.sorted[at] == idx, self.order[at], -1)


# --- validating source indices ------------------------------------------------------------------------------------


def check_index(index: object, length: int, where: str) -> int:
    """A source index in ``[0, length)`` from an int-like (negative counts from the end).

    Raises:
        TypeError: not an integer (floats and bools included).
        IndexError: out of range; ``where`` names the cache in the message.
    """
    if type(index) is int:
        i = index
    else:
        if isinstance(index, (bool, float, np.bool_, np.floating)):
            raise TypeError(f"cache indices must be integers, not {type(index).__name__} ({index!r})")
        try:
            i = operator.index(index)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"cache indices must be integers, not {type(index).__name__}") from None
    if not -length <= i < length:
        raise IndexError(f"index {i} is out of range for {where} of length {length}")
    return i + length if i < 0 else i


def check_indices(indices: object, length: int, where: str) -> np.ndarray:
    """Source indices as an int64 array in ``[0, length)``, checked before any cast (a uint64 ``2**64 - 1`` must
    not wrap around to -1, the last sample).

    Raises:
        TypeError: not integers. IndexError: one is out of range (the first such is named).
    """
    idx = np.asarray(indices)
    if idx.dtype == np.int64 and idx.ndim == 1 and idx.size and idx.min() >= 0 and idx.max() < length:
        return idx  # the common case (a sampler's batch), checked with two reductions and no copy
    if idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    if idx.dtype.kind == "O":  # Python ints beyond int64, or mixed objects
        return np.asarray([check_index(i, length, where) for i in idx.reshape(-1).tolist()], dtype=np.int64)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"cache indices must be integers, got an array of {idx.dtype}")
    idx = idx.reshape(-1)
    if idx.dtype.kind == "u":
        bad = idx >= length
    else:
        bad = (idx < -length) | (idx >= length)
    if bad.any():
        raise IndexError(f"index {idx[np.argmax(bad)]} is out of range for {where} of length {length}")
    idx = idx.astype(np.int64)
    return np.where(idx < 0, idx + length, idx)
