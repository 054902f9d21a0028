"""A mixture loader's state (``state_dict``/``load_state_dict``): what it holds, how it is checked, and what loading
one does.

A state (format ``mmapcache.mixture/1``, plain values that ``torch.save`` stores) holds:

- the mixture it belongs to, which the loading one must be: its ``sources`` (name, length and fingerprint of
  each, in order), ``seed``, ``per_batch`` and ``nodes`` (its sources' node shares, 1 for full caches);
- the loader's batching: ``batch_size``, ``drop_last``, ``world_size`` (the ranks reading one order: the job's, or
  a node's); another batch size or number of ranks resumes *elastically* (``read.epoch_split``), except over node
  shares (each node reads its own order: same nodes, same ranks);
- where it is: the pass in flight or the next (``epoch``, ``repeat``, ``counts``, ``unit``: the batch size it was
  drawn for, ``in_epoch``), ``offset``, the
  positions of that pass's order the ranks have read, and ``ended``, whether the pass was read to its last batch;
- the mixture's ``setting`` (``{"weights", "epoch_size"}`` or ``{"counts"}``), restored for the passes after it
  unless the setting was changed since the loader was made (as ``set_epoch``'s epoch stands).

Loading sets the mixture's epoch to the state's, unless ``set_epoch`` was called since the loader was made; the next
pass then reads the rest of the state's pass if it is of that epoch (drawn from the state's counts), or its own
epoch whole. A state that does not say those things is a ``ValueError`` naming the key, what it holds and what it
must be.
"""

from __future__ import annotations

from typing import Any

from .mix_order import MixPass

__all__ = ["STATE_FORMAT", "load", "save"]

STATE_FORMAT = "mmapcache.mixture/1"
_ELASTIC = {"batch_size", "world_size"}  # what a state of a mixture of full caches may have otherwise


def identity(order: Any) -> dict[str, Any]:
    """What a state must match: the mixture (its sources, seed, composition) and the loader's batching."""
    m = order.mixture
    return {"format": STATE_FORMAT, "sources": m.identities, "seed": m.seed, "per_batch": m.per_batch,
            "nodes": order._nodes(), "drop_last": order.drop_last, "batch_size": order.batch_size,
            "world_size": order.num_replicas}


def save(loader: Any) -> dict[str, Any]:
    """``MixtureLoader.state_dict`` (see the module docstring; ``read.mix_loader`` imports this module, so its
    loader and its order, a ``MixtureOrder``, are not named in annotations here)."""
    order = loader.sampler
    if loader.num_workers and not getattr(loader, "in_order", True):
        raise ValueError("a mixture's loader(in_order=False) with workers hands batches to the training loop out of "
                         "order, so no state can say which of an epoch's batches were trained on; pass in_order=True "
                         "(the default) to a loader whose state is saved")
    state = identity(order)
    current = getattr(loader, "_pass", None)
    steps = order.batch_size * order.num_replicas
    if order.resume is not None:  # loaded and not iterated since: that state again
        drawn, offset, ended = order.resume
        in_epoch = True
    elif order.started is not None and current is not None and current.active:
        drawn, in_epoch = order.started, True
        ended = current.yielded >= order.pass_batches
        offset = order.base + current.yielded * steps
    else:  # between passes: what the next one draws
        drawn, offset, ended, in_epoch = order.next_pass(), 0, False, False
    state.update(epoch=drawn.epoch, repeat=drawn.repeat, counts=list(drawn.counts), unit=drawn.unit, in_epoch=in_epoch,
                 offset=offset, ended=ended, setting=order.mixture.setting())
    return state


def load(loader: Any, state: Any) -> None:
    """``MixtureLoader.load_state_dict`` (see the module docstring)."""
    order = loader.sampler
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"not a state of a mixture's loader (format {STATE_FORMAT!r}); pass what its state_dict() "
                         "returned")
    mine = identity(order)
    differ = {key for key in mine if state.get(key) != mine[key]}
    if "sources" in differ:
        raise ValueError(f"this loader state is of another mixture: "
                         f"{_sources_differ(state.get('sources'), mine['sources'])}; resume with the same sources, "
                         "in the same order")
    elastic = mine["nodes"] == 1 and differ <= _ELASTIC
    if differ and not elastic:
        shown = "; ".join(f"{key} {state.get(key)!r} in the state, {mine[key]!r} here" for key in sorted(differ))
        why = " (a mixture of node shares resumes on the same ranks and batch size)" if differ <= _ELASTIC else ""
        raise ValueError(f"this loader state was saved by another mixture or loader ({shown}){why}: resuming from it "
                         "would read another order")
    epoch = _integer(state, "epoch", -(2**63), 2**63 - 1)
    repeat = _integer(state, "repeat", 0, 2**63 - 1)
    counts = state.get("counts")
    if not isinstance(counts, list) or len(counts) != len(mine["sources"]) or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts) or not sum(counts):
        _refuse("counts", counts, f"a list of {len(mine['sources'])} counts >= 0, not all 0")
    in_epoch, ended = _flag(state, "in_epoch"), _flag(state, "ended")
    # Past the pass's positions and the last step's padding (the saving job's batch of every rank), nothing is left
    # to read: a state that says so but not that the pass ended is not one a loader saved.
    steps = _integer(state, "batch_size", 1, 2**31) * _integer(state, "world_size", 1, 2**31)
    total = sum(counts)  # type: ignore[arg-type]  # (a list of ints: checked above)
    offset = _integer(state, "offset", 0, total + steps if in_epoch and not ended else 2**63 - 1)
    unit = _integer(state, "unit", 1, 2**31)
    m = order.mixture  # (changed only once the whole state is checked)
    if m.setting_sets == order.settings_seen:  # no set_weights since the loader was made: the state's setting
        m.restore_setting(state.get("setting"))
    if m.epoch_sets == order.sets_seen:  # no set_epoch since the loader was made: the state's epoch
        m.restore_epoch(epoch)
    drawn = MixPass(epoch, repeat, tuple(counts), unit)  # type: ignore[arg-type]  # (a list of ints: checked above)
    order.resume = (drawn, offset, ended) if in_epoch else None
    if not in_epoch:
        order.record(MixPass(epoch, repeat - 1, drawn.counts, unit))  # the next pass of this epoch is the state's


def _sources_differ(saved: Any, mine: list[dict[str, Any]]) -> str:
    if not isinstance(saved, list) or not all(isinstance(s, dict) for s in saved):
        return f"sources {saved!r} in the state"
    if [s.get("name") for s in saved] != [s["name"] for s in mine]:
        return f"sources {[s.get('name') for s in saved]} in the state, {[s['name'] for s in mine]} here"
    for a, b in zip(saved, mine):
        for key in ("length", "fingerprint"):
            if a.get(key) != b[key]:
                return f"source {b['name']!r}'s {key} is {a.get(key)!r} in the state, {b[key]!r} here"
    return "its sources differ"


def _refuse(key: str, value: Any, expected: str) -> None:
    raise ValueError(f"mixture loader state key {key!r}: {value!r}, expected {expected}; load what state_dict() "
                     "returned, unedited (or start the epoch afresh: load no state)")


def _integer(state: dict[str, Any], key: str, low: int, high: int) -> int:
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        _refuse(key, value, f"an int from {low} to {high}")
    return int(value)  # type: ignore[arg-type]


def _flag(state: dict[str, Any], key: str) -> bool:
    value = state.get(key)
    if not isinstance(value, bool):
        _refuse(key, value, "True or False")
    return bool(value)
