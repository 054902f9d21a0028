"""``Mixture``: several caches read as one weighted mixture by one fast, resumable loader.

The order of an epoch is the mixture's own (``read.mix_order``): each source gives its count of samples (weights
apportioned over an epoch size, or counts), drawn without replacement while its count allows, interleaved at random
or, with ``per_batch``, in proportion in every batch. Its loader (``read.mix_loader``) splits each epoch across the
job's ranks and resumes exactly from its state, on any number of ranks (``read.epoch_split``); each batch is gathered
from the sources' shared maps, one gather per source and field (``read.mix_batches``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import UsageError
from .read.collate import PadCollate
from .read.mix_batches import MixedReads, merged_layout
from .read.mix_loader import MixtureLoader, MixtureOrder
from .read.mix_order import apportion
from .read.text_collate import TextCollate

__all__ = ["Mixture"]


class Mixture:
    """Caches read as one weighted mixture: ``mix.loader(batch_size=...)`` yields batches drawn from all of them.

    Args:
        sources: the caches (``MmapCachedDataset``: full, partial or node shares; not streams), by name
            (``{"web": web, "code": code}``) or in a list (named ``"0"``, ``"1"``...). Their samples must have the
            same fields, dtypes and fixed shapes (a field stored ragged mixes with any lengths).
        weights: each source's share of an epoch (by name, or in order; normalised), apportioned over
            ``epoch_size`` by largest remainders: each count is within one of its share, and they sum exactly.
        counts: instead of weights, each source's number of samples per epoch (the epoch size is their sum).
        epoch_size: samples per epoch with ``weights`` (default: the sources' lengths summed).
        per_batch: every batch holds the sources in proportion (within one sample each), instead of a random mix.
        seed: the seed of every epoch's order (the same on every rank).

    Default: weights proportional to the sources' lengths (every sample once per epoch). Within an epoch a source is
    drawn without replacement while its count allows; a count beyond its length repeats it whole (every sample as
    often) before any sample repeats once more; a count below gives a random subset, another each epoch.
    ``set_weights`` changes the setting for the epochs drawn after it (a curriculum); a loader state records it.
    """

    def __init__(self, sources: Mapping[str, Any] | Sequence[Any], *, weights: Any = None, counts: Any = None,
                 epoch_size: int | None = None, per_batch: bool = False, seed: int = 0) -> None:
        if isinstance(sources, Mapping):
            names, datasets = [str(name) for name in sources], list(sources.values())
        elif isinstance(sources, Sequence) and not isinstance(sources, (str, bytes)):
            names, datasets = [str(k) for k in range(len(sources))], list(sources)
        else:
            raise TypeError(f"sources must be a dict of name -> MmapCachedDataset or a list of them, got "
                            f"{type(sources).__name__}")
        if not datasets:
            raise ValueError("a mixture needs at least one source")
        for name, ds in zip(names, datasets):
            if not callable(getattr(ds, "gather_columns", None)):
                raise TypeError(f"source {name!r} is a {type(ds).__name__}, not an MmapCachedDataset: cache it first "
                                "(MmapCachedDataset(path, dataset)), then mix the caches")
            if ds.stream:
                raise UsageError(f"source {name!r} (the stream at {ds.path}) is a stream, which reads its own order "
                                 "once per rank and keeps no sample for good: a mixture draws samples by index. Mix "
                                 "caches (stream=False)")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if not isinstance(per_batch, bool):
            raise TypeError(f"per_batch must be True or False, got {per_batch!r}")
        self.names: list[str] = names
        self.sources: list[Any] = datasets
        self.paths: list[str] = [ds.path for ds in datasets]
        self.lengths: list[int] = [len(ds) for ds in datasets]
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)
        stores = [ds._ensure_open().store for ds in datasets]
        self.layouts = [store.layout for store in stores]
        self.main = merged_layout(names, self.layouts)
        self.shares = _shares(names, datasets)
        self.identities = [{"name": name, "length": length, "fingerprint": store.meta["fingerprint"]}
                           for name, length, store in zip(names, self.lengths, stores)]
        self.seed: int = int(seed)
        self.per_batch: bool = per_batch
        self.epoch: int = 0
        self.epoch_sets: int = 0  # set_epoch calls
        self.setting_sets: int = 0  # set_weights calls
        self._setting: dict[str, Any] = {}
        self._apply(weights, counts, epoch_size)

    # --- the setting ----------------------------------------------------------------------------------------------

    def set_weights(self, weights: Any = None, *, counts: Any = None, epoch_size: int | None = None) -> None:
        """Changes the mixture for the epochs drawn from now on (a pass in flight keeps its order): ``weights``
        (with an ``epoch_size``, default the current one) or ``counts``, as the constructor takes them."""
        if weights is None and counts is None:
            raise TypeError("set_weights() takes weights= or counts=")
        if epoch_size is None and counts is None:
            epoch_size = len(self)
        self._apply(weights, counts, epoch_size)
        self.setting_sets += 1

    def _apply(self, weights: Any, counts: Any, epoch_size: int | None) -> None:
        if weights is not None and counts is not None:
            raise TypeError("pass weights= or counts=, not both")
        if counts is not None:
            if epoch_size is not None:
                raise TypeError("counts= give the epoch size (their sum): leave epoch_size out")
            given = self._per_source(counts, "counts")
            if not all(isinstance(c, numbers.Integral) and not isinstance(c, bool) and int(c) >= 0 for c in given):
                raise ValueError(f"counts must be ints >= 0, got {dict(zip(self.names, given))}")
            if not sum(given):
                raise ValueError("counts are all 0: an epoch needs at least one sample")
            self._setting = {"counts": [int(c) for c in given]}
            return
        size = sum(self.lengths) if epoch_size is None else epoch_size
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or int(size) < 1:
            raise ValueError(f"epoch_size must be an int >= 1, got {epoch_size!r}")
        shares = list(self.lengths) if weights is None else self._per_source(weights, "weights")
        if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) and _finite(w) and w >= 0
                   for w in shares) or not sum(shares):
            raise ValueError(f"weights must be finite numbers >= 0, not all 0, got {dict(zip(self.names, shares))}")
        if not math.isfinite(sum(float(w) for w in shares)):  # (each share is its weight over the sum)
            raise ValueError(f"weights {dict(zip(self.names, shares))} sum past the largest float; give them at "
                             "another scale (only their ratios count)")
        self._setting = {"weights": [float(w) for w in shares], "epoch_size": int(size)}

    def _per_source(self, given: Any, what: str) -> list[Any]:
        if isinstance(given, Mapping):
            unknown = sorted(set(map(str, given)) - set(self.names))
            missing = [name for name in self.names if name not in given]
            if unknown or missing:
                raise ValueError(f"{what} name {unknown or missing} {'not among' if unknown else 'missing from'} "
                                 f"the sources {self.names}: give one for each source, by its name")
            return [given[name] for name in self.names]
        values = list(given)
        if len(values) != len(self.names):
            raise ValueError(f"{what}: {len(values)} values for {len(self.names)} sources {self.names}")
        return values

    def counts_now(self) -> tuple[int, ...]:
        """Each source's count in the epochs drawn next."""
        if "counts" in self._setting:
            return tuple(self._setting["counts"])
        return tuple(apportion(self._setting["weights"], self._setting["epoch_size"]).tolist())

    def counts(self) -> dict[str, int]:
        """How many samples of each source an epoch drawn now holds (by name)."""
        return dict(zip(self.names, self.counts_now()))

    def setting(self) -> dict[str, Any]:
        """The weights or counts the next epochs are drawn with (what a loader state records)."""
        return {key: list(value) if isinstance(value, list) else value for key, value in self._setting.items()}

    def restore_setting(self, setting: Any) -> None:
        """Puts back a loader state's setting (``setting()``'s form), checked as the constructor checks it."""
        if not isinstance(setting, dict) or not ({"counts"} == set(setting) or {"weights", "epoch_size"} == set(
                setting)):
            raise ValueError(f"mixture loader state key 'setting': {setting!r}, expected {{'weights': [...], "
                             "'epoch_size': N}} or {'counts': [...]}; load what state_dict() returned, unedited")
        self._apply(setting.get("weights"), setting.get("counts"), setting.get("epoch_size"))

    # --- epochs and the loader -------------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass draws (its order is a function of ``(seed, epoch)`` and the setting)."""
        self.restore_epoch(epoch)
        self.epoch_sets += 1

    def restore_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or not -(2**63) <= epoch < 2**63:
            raise ValueError(f"epoch must be an int, got {epoch!r}")
        self.epoch = int(epoch)

    def loader(self, batch_size: int = 1, *, drop_last: bool = False, collate_fn: Any = None,
               rank: int | None = None, world_size: int | None = None, return_source: bool = False,
               **kwargs: Any) -> MixtureLoader:
        """A DataLoader over the mixture: each epoch's order split across the job's ranks (``rank``/``world_size``,
        default the job's), read in batches gathered from the sources' maps, with ``num_workers``, ``PadCollate``
        (fused into the gather) or another ``collate_fn``, and the sources' ``transform``. A batch holds its
        samples grouped by source; with ``return_source`` it is ``(batch, sources)``, ``sources`` each sample's
        source number (``names[k]``), to log a loss per source. ``state_dict()``/``load_state_dict()`` resume
        exactly, on any number of ranks (see ``read.mix_state``).

        Other DataLoader arguments pass through; those that choose an order (``sampler``, ``batch_sampler``,
        ``generator``, ``shuffle=False``, ``group_by_length``) are refused: the order is the mixture's, shuffled
        (``shuffle=True`` is accepted, and changes nothing).
        """
        if kwargs.get("group_by_length") is not None:
            raise ValueError("group_by_length= is ds.loader()'s: a mixture's batches are composed per source by its "
                             "plan (weights, per_batch); leave it out of the mixture's loader()")
        for name in ("shuffle", "sampler", "batch_sampler", "generator"):
            if kwargs.get(name) is not None and not (name == "shuffle" and kwargs[name] is True):
                raise ValueError(f"{name}= chooses an order, and a mixture draws its own (seed=, weights=); leave "
                                 f"{name} out of loader()")
            kwargs.pop(name, None)
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1 for a mixture, got {batch_size!r}")
        pad = collate_fn if isinstance(collate_fn, (PadCollate, TextCollate)) else None
        if pad is not None:
            pad.check_fields({f.name for f in self.layouts[self.main].fields if f.kind != "json"})
        order = MixtureOrder(self, batch_size=int(batch_size), drop_last=bool(drop_last), rank=rank,
                             world_size=world_size)
        reads = MixedReads(self.sources, self.starts, self.layouts, self.main, pad,
                           None if pad is not None else collate_fn, bool(return_source))
        return MixtureLoader(reads, batch_size=None, sampler=order, collate_fn=_whole, **kwargs)

    def __len__(self) -> int:
        """Samples per epoch of the setting."""
        return sum(self.counts_now())

    def __repr__(self) -> str:
        return f"Mixture({self.counts()}, seed={self.seed}{', per_batch=True' if self.per_batch else ''})"


def _shares(names: list[str], datasets: list[Any]) -> list[Any] | None:
    """The sources' node shares: none, or all of one node of the same nodes (each node mixes its own shares)."""
    shares = [ds.share for ds in datasets]
    if all(share is None for share in shares):
        return None
    if any(share is None for share in shares) or len({(s.node, s.nodes) for s in shares}) != 1:
        shown = {name: ("full copy" if s is None else f"node {s.node} of {s.nodes}") for name, s in zip(names, shares)}
        raise UsageError(f"a mixture's sources must all be full (or partial) caches, or all node shares of the same "
                         f"node and node count, not {shown}: each node then reads a mixture of its own shares")
    return shares


def _whole(batch: Any) -> Any:
    return batch  # each item is already a collated batch


def _finite(weight: numbers.Real) -> bool:
    """Whether a weight is a finite number a float holds (an int past 1e308 is none: ``math.isfinite`` raises)."""
    try:
        return math.isfinite(weight)
    except OverflowError:
        return False
