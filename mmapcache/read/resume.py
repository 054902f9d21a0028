"""What an epoch's order was drawn from, recorded so that a resumed loader can draw it again (``read.order``).

An epoch's order is a function of the state of what it is drawn from, taken just before the draw:

- the epoch, and for the loader's own shuffle the pass (``EpochStart.repeat``: an epoch read again is drawn anew);
- a ``generator=`` the user passed (``EpochStart.generator``);
- a user's sampler (and a batch sampler's inner one): its generators (any attribute holding a ``torch.Generator``)
  and its ``epoch`` (``DistributedSampler`` and samplers like it: their order is a function of ``(seed, epoch)``),
  or, for a sampler with neither but a ``state_dict``/``load_state_dict``, that state (``EpochStart.sampler``);
- torch's global generator, for a user's sampler that has no generator of its own (``RandomSampler``,
  ``SubsetRandomSampler`` and ``WeightedRandomSampler`` without one draw from it, as may a sampler written by
  hand): its state before the draw (``EpochStart.rng``). A resumed epoch is drawn again with the global generator
  put in that state for the draw and back afterwards, so the resumed process's own random state is left as it was.

Not recorded: samplers that draw from another random source (``random``, ``numpy.random``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["EpochStart", "Resume", "has_epoch", "generators", "has_generator", "draws_globally", "no_base_seed",
           "sampler_state", "restore_sampler", "global_rng"]


@dataclasses.dataclass
class EpochStart:
    """What an epoch's order was drawn from (see the module docstring), and how many times this epoch was read
    before (the loader's own shuffle draws a new order each time)."""

    epoch: int
    generator: torch.Tensor | None = None
    sampler: dict[str, Any] | None = None
    repeat: int = 0
    rng: torch.Tensor | None = None  # torch's global generator, for a user's sampler without a generator


@dataclasses.dataclass
class Resume:
    """A loaded state, taken up by the next pass. With ``same_epoch``, a pass in flight: drawn again from
    ``start``, skipping its first ``skip`` batches, if the next pass is of ``start``'s epoch (else settled:
    ``BatchOrder.settle``); or, with ``offset`` (a state of another number of ranks or batch size, or of a pass
    that itself resumed one: ``read.epoch_split``), the order drawn as a job of ``world`` ranks drew it, read from
    position ``offset`` on by this job's ranks. Without ``same_epoch``, a state taken between passes whose
    generators are put back only after the next pass's workers drew their base seed (persistent workers draw none
    there), for the epoch current then."""

    start: EpochStart
    skip: int
    same_epoch: bool = True
    offset: int | None = None
    world: int | None = None
    group: int | None = None  # with ``offset``: the length groups' size the order was drawn with (``group_by_length``)


def has_epoch(sampler: Any) -> bool:
    """Whether a sampler's order is a function of an epoch it is given (``DistributedSampler``, ``ds.sampler()``)."""
    return callable(getattr(sampler, "set_epoch", None)) and isinstance(getattr(sampler, "epoch", None), int)


def generators(sampler: Any) -> dict[str, torch.Generator]:
    """A sampler's own generators, by attribute name (``generator`` as torch's samplers name it, or any other)."""
    return {name: value for name, value in getattr(sampler, "__dict__", {}).items()
            if isinstance(value, torch.Generator)}


def has_generator(sampler: Any) -> bool:
    return bool(generators(sampler))


def draws_globally(sampler: Any) -> bool:
    """Whether a user's sampler (or a batch sampler's inner one) may draw from torch's global generator: it has no
    generator of its own and no epoch to be a function of."""
    inner = getattr(sampler, "sampler", None)
    return not any(has_generator(s) or has_epoch(s) for s in (sampler, inner) if s is not None)


def sampler_state(sampler: Any) -> dict[str, Any] | None:
    """What decides a user sampler's next order: its generators' states and its epoch (its own and a batch
    sampler's inner sampler's), or, for a sampler with neither but a ``state_dict``, that state.

    A ``state_dict`` is asked only of such a sampler: samplers in torchdata's protocol (``StatefulDistributedSampler``,
    its ``RandomSampler``, many written by hand) record there how far the last pass went (at an epoch's start, "all
    of it"), not what the next pass draws, which their epoch or generators decide.
    """
    if sampler is None:
        return None
    if not (has_epoch(sampler) or has_generator(sampler)) and callable(getattr(sampler, "state_dict", None)) and \
            callable(getattr(sampler, "load_state_dict", None)):
        return {"state_dict": sampler.state_dict()}
    state: dict[str, Any] = {}
    for name, obj in (("", sampler), ("sampler_", getattr(sampler, "sampler", None))):
        if obj is None:
            continue
        if has_generator(obj):
            state[name + "generators"] = {attr: g.get_state() for attr, g in generators(obj).items()}
        if has_epoch(obj):
            state[name + "epoch"] = obj.epoch
    return state


def restore_sampler(sampler: Any, state: dict[str, Any] | None, epoch: bool = True) -> None:
    """Puts a user sampler back as ``sampler_state`` found it; its epoch only with ``epoch`` (between epochs the
    next epoch is the one ``set_epoch`` sets, before or after the state is loaded)."""
    if sampler is None or not state:
        return
    if "state_dict" in state:
        sampler.load_state_dict(state["state_dict"])
        return
    for name, obj in (("", sampler), ("sampler_", getattr(sampler, "sampler", None))):
        if obj is None:
            continue
        for attr, generator_state in state.get(name + "generators", {}).items():
            getattr(obj, attr).set_state(generator_state)
        if epoch and name + "epoch" in state:
            obj.set_epoch(state[name + "epoch"])


@contextlib.contextmanager
def global_rng(state: torch.Tensor | None) -> Iterator[None]:
    """Torch's global generator in ``state`` for the block (a recorded draw made again), then as it was before;
    nothing with ``state`` None."""
    if state is None:
        yield
        return
    before = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        yield
    finally:
        torch.set_rng_state(before)


@contextlib.contextmanager
def no_base_seed(loader: Any, resumed: bool) -> Iterator[None]:
    """Where ``resumed`` (the rest of a pass a state recorded) and DataLoader's iterator draws its workers' base seed
    from torch's global generator (no ``loader.generator``): that generator put back after the block, so that the
    resumed run's random numbers go on as the uninterrupted run's did (its pass drew the seed as it began, before the
    state and a trainer's checkpoint of the generators were taken; a resumed pass draws nothing else from it). The
    workers get a base seed all the same. (A loader's own generator is put where the state says by its order.)"""
    if not resumed or loader.generator is not None:
        yield
        return
    before = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(before)
