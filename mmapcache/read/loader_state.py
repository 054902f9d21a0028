"""A ``ds.loader()``'s state (``state_dict``/``load_state_dict``, torchdata's ``StatefulDataLoader`` protocol): what it
holds, how a state is checked before it is trusted, and what loading one does to the loader's order.

A state (format ``mmapcache.loader/3``, a dict of plain values and tensors that ``torch.save`` stores) holds:

- the loader's shape, which the loading loader must match: ``length``, ``batch_size``, ``drop_last``, ``shuffle``,
  ``world_size``, ``batches_per_epoch``, ``seed`` (where it draws the order), ``sampler_kinds``, ``generators``
  and, with a ``generator=``, ``seeds_workers_once``, ``group_by_length`` and ``group_size`` (the field whose
  lengths group the order, and the groups' size); except that a loader of its own order (no ``sampler``) may
  have another ``world_size`` and ``batch_size`` (so ``batches_per_epoch``, and a default ``group_size``): the
  resume is *elastic*;
- where the loader is: ``epoch`` and ``repeat`` (the pass of that epoch), and ``batches``, the batches of that pass
  handed to the training loop (0 to ``batches_per_epoch``), with ``in_epoch`` saying whether that pass is in flight
  (its order drawn, ``batches`` of it yielded: the rest is resumed) or is the next one (``batches`` is 0), and
  ``persistent`` (a next pass that draws no base seed for its workers); for the own order also ``offset``, the
  positions of the epoch's order the whole job has read (``read.epoch_split``; ``length`` once the pass is over),
  ``base``, where in the order the pass started (0, or the offset of the state it resumed elastically), and
  ``order_world`` and ``order_group``, the number of ranks and the length groups' size (None: none) the epoch's
  order was drawn with;
- what that pass is drawn from (``read.resume.EpochStart``): ``generator``, ``sampler``, ``rng``.

Loading a state sets the dataset's epoch to the state's, unless ``set_epoch`` was called since the loader was made
(a trainer that calls it before loading: the epoch it set stands); what the next pass then reads is
``read.order``'s to decide: the rest of a pass in flight, on the same ranks the batches the uninterrupted pass had
left, on others the rest of the order split across them. A state that does not say those things (another loader's,
a hand-edited one) is a ``ValueError`` naming the key, the value and what it must be: never a silent skip of batches.
A state of format ``mmapcache.loader/2`` (0.4 and 0.5) is one with ``base`` 0 and ``offset`` its batches' positions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .order import BatchOrder
from .resume import EpochStart, Resume, has_generator

__all__ = ["STATE_FORMAT", "save", "load"]

STATE_FORMAT = "mmapcache.loader/3"  # 1: 0.3, whose own shuffle drew its seed from torch's global generator
_FORMATS = ("mmapcache.loader/2", STATE_FORMAT)  # 2: 0.4 and 0.5, no elastic resume
# What a state of the own order may have otherwise (a default group size follows the batch size and ranks).
_ELASTIC = {"world_size", "batch_size", "batches_per_epoch", "group_size"}


def shape(loader: Any, world: int | None = None, batch_size: int | None = None) -> dict[str, Any]:
    """What a state must match: the dataset's length, the batching, the split and what draws the order. Not the
    rank: every rank's state is the same (the epoch and the batches each yielded), and a trainer saves one
    (Lightning, rank 0's) from which each rank resumes its own part. With ``world`` and ``batch_size``: the shape
    this loader would have in a job of ``world`` ranks with batches of ``batch_size`` (the own order's)."""
    order: BatchOrder = loader.sampler
    world = order.num_replicas if world is None else world
    batch_size = order.batch_size if batch_size is None else batch_size
    state = {"format": STATE_FORMAT, "length": len(order.ds), "batch_size": batch_size,
             "drop_last": order.drop_last, "shuffle": order.shuffle, "world_size": world,
             "batches_per_epoch": order.batches_for(world, batch_size) if order.own else len(order),
             "seed": order.seed if order.own and order.shuffle and (
                 order.generator is None or world > 1) else None,
             "sampler_kinds": [_kind(order.user_sampler), _kind(order.user_batch_sampler)],
             "generators": [order.generator is not None, has_generator(order.user_sampler),
                            has_generator(getattr(order.user_batch_sampler, "sampler", None))],
             "group_by_length": order.group_field, "group_size": order.group_for(world, batch_size)}
    if order.own and order.shuffle and order.generator is not None:
        # A generator= also gives the workers their base seed: once with persistent workers, else each epoch.
        state["seeds_workers_once"] = bool(loader.num_workers and loader.persistent_workers)
    return state


def save(loader: Any) -> dict[str, Any]:
    """``CacheLoader.state_dict``: where ``loader`` is (see the module docstring)."""
    order: BatchOrder = loader.sampler
    if loader.num_workers and not getattr(loader, "in_order", True):
        raise ValueError("ds.loader(in_order=False) with workers hands batches to the training loop out of order, "
                         "so no state can say which of an epoch's batches were trained on; pass in_order=True "
                         "(the default) to a loader whose state is saved")
    state = shape(loader)
    current = getattr(loader, "_pass", None)
    resume = order.resume
    start = order.current() if current is not None and current.active else None
    steps = order.batch_size * order.num_replicas if order.batch_size else order.num_replicas
    base, world, group = 0, order.num_replicas, state["group_size"]
    if resume is not None:  # loaded and not iterated since: that state again
        start, batches, in_epoch = resume.start, resume.skip, resume.same_epoch
        epoch, persistent = start.epoch if in_epoch else order.epoch, not in_epoch
        offset = batches * steps
        if resume.offset is not None:
            base = offset = resume.offset
            world = resume.world or world
            group = resume.group if resume.group is not None else group
    elif start is not None and current is not None:  # a pass in flight, its order drawn (after its last batch too)
        epoch, batches, in_epoch, persistent = start.epoch, order.skipped + current.yielded, True, False
        base, world = order.base, order.drawn_by or world
        group = order.drawn_group if order.drawn_group is not None else group
        # Whole batches of every rank so far: the job read the order's positions up to here (read.epoch_split).
        offset = base + batches * steps if batches < order.pass_batches else len(order.ds)
    else:  # between passes: what the next one draws
        start = order.start()
        epoch, batches, in_epoch = start.epoch, 0, False
        # With persistent workers the next pass draws no base seed for its workers (a resumed loader's first
        # does): the generator is then put back when the order is drawn, after that draw.
        persistent = bool(loader.persistent_workers and loader.num_workers and getattr(loader, "_iterator", None))
        offset = 0
    state.update(epoch=epoch, batches=batches, generator=start.generator, sampler=start.sampler,
                 repeat=start.repeat, rng=start.rng, in_epoch=in_epoch, persistent=persistent)
    if order.own:
        state.update(offset=offset, base=base, order_world=world, order_group=group)
    return state


def load(loader: Any, state: Any) -> None:
    """``CacheLoader.load_state_dict``: checks ``state`` against ``loader`` and makes its next pass continue where
    the loader that saved it was."""
    if isinstance(state, dict) and state.get("format") == "mmapcache.loader/1":
        raise ValueError("this loader state was saved by mmapcache 0.3, whose loader drew its shuffle from a seed "
                         "taken from torch's global generator; this version draws it from (seed, epoch), so "
                         "resuming from it would read another order: start the epoch afresh (load no loader "
                         "state; the model's and optimizer's states are unaffected)")
    if not isinstance(state, dict) or state.get("format") not in _FORMATS:
        raise ValueError(f"not a state of ds.loader() (format {STATE_FORMAT!r}); pass what its state_dict() "
                         "returned")
    order: BatchOrder = loader.sampler
    mine = shape(loader)
    differ = _differ(state, mine)
    # (The pass resumed keeps the length groups it was drawn with, whatever size this loader draws its own with.)
    elastic = bool(differ) and order.own and {key for key, _ in differ} <= _ELASTIC and not [
        key for key, _ in _differ(state, shape(loader, _integer(state, "world_size", 1, 2**31), state.get(
            "batch_size"))) if key != "group_size"]
    if differ and not elastic:
        raise ValueError(f"this loader state was saved by a loader of another shape "
                         f"({'; '.join(text for _, text in differ)}): resuming from it would read another order. "
                         "Resume with the same dataset length, batch size, drop_last, shuffle, number of ranks, "
                         "seed, sampler, generators and (with a generator) persistent_workers, or start the epoch "
                         "afresh (a loader of its own order, without a sampler, resumes on another number of ranks "
                         "or batch size)")
    saved = shape(loader, state["world_size"], state["batch_size"]) if elastic else mine
    epoch, repeat, batches, in_epoch, persistent = _checked(state, saved["batches_per_epoch"])
    start = EpochStart(epoch, state["generator"], state["sampler"], repeat, state["rng"])
    chosen = order.ds.epoch_sets != order.sets_seen  # set_epoch since the loader was made: that epoch stands
    if not chosen:
        order.ds.restore_epoch(epoch)
    offset, base, world = _position(state, order, batches, saved["batches_per_epoch"])
    if in_epoch and (elastic or base):  # not whole batches of this job from the epoch's start: read.epoch_split
        group = state.get("order_group", state.get("group_size"))
        if group is not None:
            group = _integer(state, "order_group" if "order_group" in state else "group_size", 1, 2**62)
        order.resume = Resume(start, 0, offset=offset, world=world, group=group)
    elif in_epoch:
        order.resume = Resume(start, batches)
    elif persistent:
        order.resume = Resume(start, 0, same_epoch=False)
    else:
        order.resume = None
        order.restore(start, epoch=False)
    if not in_epoch and not chosen:
        order.record_draw(epoch, repeat - 1)  # the next pass of this epoch is the state's


def _differ(state: dict[str, Any], mine: dict[str, Any]) -> list[tuple[str, str]]:
    """The keys of ``mine`` whose value ``state`` does not have (its format aside), each with a line saying so."""
    return [(key, f"{key} {state.get(key)!r} in the state, {mine[key]!r} here") for key in mine
            if key != "format" and state.get(key) != mine[key]]


def _position(state: dict[str, Any], order: BatchOrder, batches: int, per_epoch: int) -> tuple[int, int, int]:
    """``(offset, base, order_world)`` of a state of the own order (format 2: whole batches from the start, of the
    epoch's ``per_epoch``), each checked (see the module docstring)."""
    length = len(order.ds)
    world = _integer(state, "world_size", 1, 2**31)
    if state.get("format") != STATE_FORMAT or not order.own:
        step = (state["batch_size"] or 1) * world
        return (length if batches >= per_epoch else min(batches * step, length)), 0, world
    offset = _integer(state, "offset", 0, length)
    base = _integer(state, "base", 0, offset)
    return offset, base, _integer(state, "order_world", 1, 2**31)


def _checked(state: dict[str, Any], per_epoch: int) -> tuple[int, int, int, bool, bool]:
    """The state's position, each key checked: ``(epoch, repeat, batches, in_epoch, persistent)``."""
    epoch = _integer(state, "epoch", -(2**63), 2**63 - 1)
    repeat = _integer(state, "repeat", 0, 2**63 - 1)
    in_epoch = _flag(state, "in_epoch")
    persistent = _flag(state, "persistent")
    batches = _integer(state, "batches", 0, per_epoch if in_epoch else 0,
                       f"of this loader's {per_epoch} batches per epoch" if in_epoch else
                       "as the state is of a pass not begun (in_epoch False)")
    for key in ("generator", "rng"):
        value = state.get(key, _MISSING)
        if value is not None and not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8
                                      and value.dim() == 1):
            _refuse(key, value, "None or a torch generator's state (a 1-D uint8 tensor)")
    if state.get("sampler", _MISSING) is not None and not isinstance(state.get("sampler"), dict):
        _refuse("sampler", state.get("sampler", _MISSING), "None or a dict")
    return epoch, repeat, batches, in_epoch, persistent


_MISSING = object()


def _refuse(key: str, value: Any, expected: str) -> None:
    found = "missing" if value is _MISSING else f"{value!r} ({type(value).__name__})"
    raise ValueError(f"loader state key {key!r}: {found}, expected {expected}; load what ds.loader().state_dict() "
                     "returned, unedited (or start the epoch afresh: load no loader state)")


def _integer(state: dict[str, Any], key: str, low: int, high: int, what: str = "") -> int:
    value = state.get(key, _MISSING)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        _refuse(key, value, f"an int from {low} to {high}" + (f" {what}" if what else ""))
    return int(value)


def _flag(state: dict[str, Any], key: str) -> bool:
    value = state.get(key, _MISSING)
    if not isinstance(value, (bool, np.bool_)):
        _refuse(key, value, "True or False")
    return bool(value)


def _kind(sampler: Any) -> str | None:
    return None if sampler is None else f"{type(sampler).__module__}.{type(sampler).__qualname__}"
