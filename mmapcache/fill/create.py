"""Creating a cache: the opener's request and source, the first sample and the layout probes, and the files.

The creator (holding the parent directory's lock, see ``fill.open``) computes the first cacheable sample, and, with
``ragged="auto"`` (the default) when that sample has an array field, 8 more spread over the cacheable indices (a
stream: its next positions), learns the layout from them (a field whose shape differs among them is ragged), plans
the slots (``max_bytes``), creates the cache under a temporary name and stores these samples in it before the rename,
so no opener ever computes them again. A probe the source fails on is left out; a source that refills one buffer for
every sample (found by the memory of the probes' arrays) has each probe computed again as it is stored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .._version import __version__
from ..errors import InsufficientSpaceError, LayoutError
from ..format.batch import arrays_of, overlaps
from ..format.layout import PYLIST, Layout, flatten
from ..read.reader import RowReader
from ..store import create as _create
from ..store.create import plan_bytes
from ..store.ring import Ring, epoch_order
from ..store.rows import RowMap
from ..store.state import NoRoom
from ..store.store import Store
from ..store.writer import RowWriter
from .options import CreateOptions

__all__ = ["Request", "Source", "create_locked", "first_index"]


@dataclasses.dataclass(frozen=True)
class Source:
    """What opening needs of a source dataset.

    Attributes:
        length: ``len(source)``.
        fetch: computes sample ``i`` (the source's exceptions propagate, annotated with the index).
        check: ``(reader, sample, index) -> values`` flattens and checks a sample for storing; default
            ``reader.check`` (the dataset adds its ``check_finite``).
        deterministic: whether the source returns the same bytes for the same index every time (see above).
    """

    length: int
    fetch: Callable[[int], Any]
    check: Callable[[RowReader, Any, int], list[Any]] | None = None
    deterministic: bool = True

    def values(self, reader: RowReader, sample: Any, index: int) -> list[Any]:
        return self.check(reader, sample, index) if self.check is not None else reader.check(sample, index)


@dataclasses.dataclass(frozen=True)
class Request:
    """What the opener asks for (see ``MmapCachedDataset`` for each option)."""

    path: str
    fingerprint: str | None = None
    options: CreateOptions = dataclasses.field(default_factory=lambda: CreateOptions(None, None, None, None, None))
    overwrite: bool = False
    delete_on_close: bool = False
    variant_choice: str = "epoch"
    seed: int = 0


def first_index(options: CreateOptions, length: int, seed: int = 0) -> int:
    """The first cacheable index of a new cache (the sample its creator computes and stores): for a stream, the
    first position of epoch 0's order the node holds."""
    if options.stream:
        return int(_stream_sequence(options, seed, length, 1)[0])
    if options.share is not None:
        return int(options.share.indices(length)[0])
    return int(options.cache_indices[0]) if options.cache_indices is not None else 0


# With ragged="auto", the samples a creator computes to learn which fields are ragged (their shapes differ), and
# with max_bytes to estimate the ragged values' size: the first and this many more, spread over the cacheable
# indices. They are stored, so none is computed twice.
_PROBES = 8


def create_locked(request: Request, source: Source) -> None:
    """Computes the first sample (and a few probes), learns the layout from them, and creates the cache with
    them stored in it. Caller holds the lock."""
    options = request.options
    index = first_index(options, source.length, request.seed)
    sample = source.fetch(index)
    try:
        # (store_as is applied to the layout learnt from the probes where there are some: an empty list of numbers
        # in the first sample has its dtype from them.)
        layout = Layout.from_samples([sample], options.max_shapes, options.declared_ragged)
    except LayoutError as exc:
        raise LayoutError(f"sample {index}: {exc}") from None
    samples = [(index, sample)]
    auto = options.ragged == "auto" and (any(f.shape and not f.ragged and not f.variable for f in layout.fields)
                                         or _has_empty_list(sample))
    # With max_bytes, ragged values' sizes decide how many samples fit: estimate them from more than one sample.
    if auto or (options.max_bytes is not None and layout.ragged and not options.stream):
        slots, slot_index, _ = options.plan(layout, source.length)
        if options.stream:  # the next positions of epoch 0's order: stored in the ring as they will be read
            probes = _stream_sequence(options, request.seed, source.length, min(_PROBES, slots - 1) + 1)[1:]
        else:  # spread over the cacheable indices
            cacheable = np.arange(slots) if slot_index is None else slot_index
            probes = cacheable[np.linspace(0, len(cacheable) - 1, _PROBES).astype(np.int64)]
        for i in dict.fromkeys(probes.tolist()):
            if i != index:
                # A probe the source fails on is left out: it fails again, with its index, when it is read.
                with contextlib.suppress(Exception):
                    samples.append((int(i), source.fetch(int(i))))
    # A source that refills one buffer for every sample (whole, or at shifting offsets) has overwritten the earlier
    # samples' values by now (their shapes, all the layout needs, are intact): each is computed again when stored.
    refills = len(samples) > 1 and overlaps([arrays_of(s) for _, s in samples])
    if auto or options.store_as:
        try:
            layout = Layout.from_samples([s for _, s in samples] if auto else [sample], options.max_shapes,
                                         options.declared_ragged, options.store_as)
        except LayoutError as exc:
            raise LayoutError(f"sample {index}: {exc}") from None
    ragged_bytes = _ragged_bytes(layout, [s for _, s in samples])
    slots, slot_index, variants = options.plan(layout, source.length, ragged_bytes=ragged_bytes)
    heap_budget = None
    if options.max_bytes is not None and layout.ragged:
        fixed = plan_bytes(layout, slots * variants, slots if slot_index is not None else 0)
        heap_budget = max(0, options.max_bytes - fixed)

    def store_first(directory: str) -> None:
        # In the cache still under its temporary name, so no opener ever finds these samples missing.
        store = Store(directory, writable=True)
        try:
            reader, writer = RowReader(store, recompute_stale=True), RowWriter(store)
            if options.stream:  # the first sample and the probes are epoch 0's positions 0, 1, ...: the ring's
                ring = Ring(store)
                try:
                    values = source.values(reader, source.fetch(index) if refills else sample, index)
                    if ring.length:  # (a node of a job with more ranks than samples holds no position)
                        ring.publish_created(0, functools.partial(writer.write, 0, values))
                    sequence = _stream_sequence(options, request.seed, source.length, slots)
                    position = {int(i): q for q, i in enumerate(sequence.tolist())}
                    for i, probe in samples[1:]:
                        q = position.get(i, -1)  # a probe is the value of its position in epoch 0's order
                        if q < 1:
                            continue
                        with contextlib.suppress(Exception):  # not stored: computed again when read
                            values = source.values(reader, source.fetch(i) if refills else probe, i)
                            ring.publish_created(q, functools.partial(writer.write, q, values))
                except NoRoom:
                    ragged = [f.name for f in layout.ragged]
                    if heap_budget is None:
                        raise InsufficientSpaceError(
                            f"the file system of {request.path} has no room for the stream's first sample "
                            f"({ragged_bytes} bytes in its ragged fields {ragged}); free space") from None
                    raise ValueError(
                        f"max_bytes={options.max_bytes} leaves {heap_budget} bytes for the ragged fields {ragged}, "
                        f"too few for the stream's first sample ({ragged_bytes} bytes in them); raise max_bytes"
                    ) from None
                finally:
                    ring.close()
                return
            rows = RowMap.of(store, variant_choice=request.variant_choice, seed=request.seed)
            for number, (i, probe) in enumerate(samples):
                row = rows.row(i, 0)
                if row < 0:
                    continue
                try:
                    values = source.values(reader, source.fetch(i) if refills else probe, i)
                except Exception:
                    if number == 0:
                        raise
                    continue  # a probe that cannot be stored fails the same way when it is read
                with contextlib.suppress(NoRoom):  # a probe without heap room (max_bytes): computed again later
                    store.state.publish(row, i, functools.partial(writer.write, row, values))
        finally:
            store.close()

    _create.create(
        request.path, layout, length=source.length, slots=slots, variants=variants, slot_index=slot_index,
        fingerprint=request.fingerprint, delete_on_close=request.delete_on_close, library_version=__version__,
        prepare=store_first, heap_budget=heap_budget, ragged_bytes=ragged_bytes,
        share=None if options.share is None else options.share.to_json(),
        stream=_stream_meta(options, request.seed), deterministic=source.deterministic,
    )


def _stream_sequence(options: CreateOptions, seed: int, length: int, count: int) -> np.ndarray:
    """The source indices of a new stream's first ``count`` sequence positions of epoch 0 (at most the node's):
    its first sample and its probes, stored as the ring's first positions."""
    split = options.split
    order = epoch_order(seed, 0, length)
    if split is None:
        return order[:count]
    positions = split.position(np.arange(min(count, split.positions(length)), dtype=np.int64))
    return order[positions] if len(positions) else order[:1]


def _stream_meta(options: CreateOptions, seed: int) -> dict[str, Any] | None:
    if not options.stream:
        return None
    return {"seed": seed} if options.split is None else {"seed": seed, "split": options.split.to_json()}


def _has_empty_list(sample: Any) -> bool:
    """Whether a list of numbers in ``sample`` is empty (its element type is then learnt from the probes)."""
    return any(leaf.field.kind == PYLIST and leaf.value.size == 0 for leaf in flatten(sample)[1])


def _ragged_bytes(layout: Layout, samples: list[Any]) -> int:
    """The mean bytes per sample of the ragged fields' values among ``samples`` as stored (an estimate for
    planning)."""
    numbers = [n for n, f in enumerate(layout.fields) if f.ragged]
    if not numbers:
        return 0
    sizes = []
    for sample in samples:
        try:
            leaves = flatten(sample)[1]
            sizes.append(sum(leaves[n].value.size * layout.fields[n].value_itemsize for n in numbers
                             if n < len(leaves)))
        except LayoutError:
            continue
    return int(np.mean(sizes)) if sizes else 0


