"""Validating ``MmapCachedDataset``'s arguments and planning a new cache's slots."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..format.layout import Layout
from ..format.sizes import parse_size
from ..store.create import plan_bytes
from ..store.share import Share
from ..store.split import StreamSplit

STALE_MODES = ("recompute", "serve")
ON_MISS = ("compute", "wait")


class CreateOptions:
    """Validated creation options (those that only matter when a cache is created or compared)."""

    def __init__(self, max_bytes: Any, cache_indices: Any, variants: Any, max_shapes: Any,
                 ragged: Any = None, share: Share | None = None, stream: bool = False,
                 split: StreamSplit | None = None, store_as: Any = None) -> None:
        self.max_bytes = None if max_bytes is None else parse_size(max_bytes, "max_bytes")
        if variants is not None:
            if not _is_count(variants) or variants < 1:
                raise ValueError(f"variants must be an integer >= 1, got {variants!r}")
            variants = int(variants)
        self.variants = variants
        if cache_indices is not None:
            cache_indices = np.asarray(cache_indices)
            if cache_indices.ndim != 1 or (cache_indices.size and cache_indices.dtype.kind not in "iu"):
                raise TypeError("cache_indices must be a 1-D sequence of integers")
            cache_indices = cache_indices.astype(np.int64)
            if len(np.unique(cache_indices)) != len(cache_indices):
                raise ValueError("cache_indices contains duplicates; list each index once")
            if len(cache_indices) == 0:
                raise ValueError("cache_indices is empty; pass None to cache every sample")
        self.cache_indices = cache_indices
        if max_shapes is not None:
            if not isinstance(max_shapes, Mapping):
                raise TypeError(f"max_shapes must be a dict of field path -> shape, got {type(max_shapes).__name__}")
            max_shapes = {name: _max_shape(name, shape) for name, shape in max_shapes.items()}
        self.max_shapes = max_shapes
        if ragged is not None and ragged != "auto":
            if isinstance(ragged, str) or not all(isinstance(name, str) for name in ragged):
                raise TypeError(f"ragged must be 'auto' or a list of field paths (str), e.g. ragged=['input_ids'], "
                                f"got {ragged!r}")
            ragged = tuple(ragged)
        self.ragged = ragged
        if store_as is not None:
            if not isinstance(store_as, Mapping) or not all(
                    isinstance(name, str) and isinstance(how, str) for name, how in store_as.items()):
                raise TypeError("store_as must be a dict of field path -> a narrower dtype name or 'ones', e.g. "
                                f"store_as={{'input_ids': 'int32', 'attention_mask': 'ones'}}, got {store_as!r}")
            store_as = dict(store_as)  # ({}: no field narrowed, compared with the cache's as any other)
        self.store_as: dict[str, str] | None = store_as
        if share is not None and cache_indices is not None:
            raise ValueError("node_share and cache_indices both choose which samples the cache holds; pass one")
        self.share = share
        if stream and (share is not None or cache_indices is not None or (variants or 1) != 1):
            raise ValueError("a stream (stream=True) holds the next positions of each epoch's order, once each: it "
                             "takes none of node_share, cache_indices, variants; size its ring with max_bytes")
        self.stream = stream
        self.split = split if stream else None  # a stream's node split (store.split), None for one node

    @property
    def declared_ragged(self) -> tuple[str, ...]:
        """The field paths named ragged (none for ``"auto"``, which probes instead)."""
        return () if self.ragged in (None, "auto") else self.ragged

    def plan(self, layout: Layout, length: int, default_variants: int = 1,
             ragged_bytes: int = 0) -> tuple[int, np.ndarray | None, int]:
        """Slots, slot index and variants of a new cache (or of the cache these options describe), with
        ``ragged_bytes`` per sample expected in the heaps (counted against ``max_bytes``)."""
        if self.stream:
            positions = length if self.split is None else self.split.positions(length)
            return self._plan_ring(layout, max(1, positions), ragged_bytes), None, 1
        variants = self.variants or default_variants
        index = self.cache_indices if self.share is None else self.share.indices(length)
        if index is not None and (index.min() < 0 or index.max() >= length):
            raise IndexError(f"cache_indices has values outside [0, {length}), the dataset's index range")
        slots = length if index is None else len(index)
        if self.max_bytes is not None:
            # max_bytes bounds the whole cache as plan_bytes counts it (data, shapes, counters, bitmaps,
            # slot index), so a size suggested by InsufficientSpaceError really fits.
            has_index = index is not None
            per_row = ragged_bytes
            per_sample = max(1, plan_bytes(layout, 8 * variants, 8 if has_index else 0, per_row) // 8)  # bitmap bits
            fit = self.max_bytes // per_sample
            while fit and plan_bytes(layout, fit * variants, fit if has_index else 0, per_row) > self.max_bytes:
                fit -= 1
            if fit == 0:
                raise ValueError(f"max_bytes={self.max_bytes} is smaller than one sample ({per_sample} bytes with "
                                 f"{variants} variant(s)); raise it")
            if self.share is not None and self.share.rotate_every is not None and fit < slots:
                raise ValueError(
                    f"max_bytes={self.max_bytes} holds {fit} samples, but this node's share has {slots}: a share "
                    "that rotates must fit whole. Use more nodes, a larger max_bytes, or no rotation (then the "
                    "cache holds the part of the share that fits, and the rest passes through)")
            slots = min(slots, fit)
        if index is not None:
            index = index[:slots]
        return slots, index, variants


    def _plan_ring(self, layout: Layout, length: int, ragged_bytes: int) -> int:
        """A stream's ring slots: as many samples as ``max_bytes`` holds (at most the ``length`` positions of an
        epoch the node holds), else ``DEFAULT_RING``."""
        if self.max_bytes is None:
            return min(length, DEFAULT_RING)
        # A ring's rows are written over every lap with values of new sizes: its heaps level off at about 1.5x the
        # live values (moved values leave extents on the free lists, reused at up to ~1.8x their size; see
        # store.heap). Planned at the probes' mean, they ran out of room and producers dropped their values: twice
        # the mean, unless that leaves no slot at all.
        fit = self._fit(layout, length, 2 * ragged_bytes) or self._fit(layout, length, ragged_bytes)
        if fit == 0:
            per_sample = max(1, plan_bytes(layout, 8, 0, ragged_bytes) // 8)
            raise ValueError(f"max_bytes={self.max_bytes} is smaller than one sample ({per_sample} bytes): the ring "
                             "must hold at least one; raise it")
        return fit

    def _fit(self, layout: Layout, length: int, ragged_bytes: int) -> int:
        """How many of a ring's slots (at most ``length``), with ``ragged_bytes`` a slot in the heaps, ``max_bytes``
        holds."""
        assert self.max_bytes is not None
        per_sample = max(1, plan_bytes(layout, 8, 0, ragged_bytes) // 8)
        fit = min(length, self.max_bytes // per_sample)
        while fit and plan_bytes(layout, fit, 0, ragged_bytes) > self.max_bytes:
            fit -= 1
        return fit


# A stream's ring without max_bytes: room for this many samples ahead of the slowest consumer.
DEFAULT_RING = 4096


def _is_count(value: Any) -> bool:
    """An integer, Python or numpy, that is not a bool (True is an int to Python, never a count here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _max_shape(name: Any, shape: Any) -> tuple[int, ...]:
    """One validated ``max_shapes`` entry: a field path and a sequence of non-negative integers."""
    if not isinstance(name, str):
        raise ValueError(f"max_shapes key {name!r} is a {type(name).__name__}; keys are field paths (str), e.g. "
                         "'0' or 'image'")
    if isinstance(shape, np.ndarray) and shape.ndim == 1:
        shape = shape.tolist()  # numpy integers become ints; a float array fails below
    if _is_count(shape):
        raise ValueError(f"max_shapes[{name!r}] must be a tuple of non-negative ints, got {shape!r} (an integer); "
                         f"for a 1-D field write max_shapes={{{name!r}: ({int(shape)},)}}")
    if not isinstance(shape, (tuple, list)) or not all(_is_count(d) and d >= 0 for d in shape):
        raise ValueError(f"max_shapes[{name!r}] must be a tuple of non-negative ints, got {shape!r}; give one "
                         f"maximum per dimension, e.g. max_shapes={{{name!r}: (3, 512, 512)}}")
    return tuple(int(d) for d in shape)


def source_length(dataset: Any) -> int:
    if isinstance(dataset, type):
        raise TypeError(f"the dataset is the class {dataset.__name__}, not a dataset: pass an instance, "
                        f"{dataset.__name__}(...)")
    try:
        n = len(dataset)
    except TypeError:
        raise TypeError(
            f"the dataset ({type(dataset).__name__}) has no __len__; MmapCachedDataset wraps map-style datasets "
            "(__len__ and __getitem__); for an iterable dataset, materialise it into a list first"
        ) from None
    if n == 0:
        raise ValueError(f"the dataset ({type(dataset).__name__}) is empty; there is nothing to cache")
    if not hasattr(dataset, "__getitem__"):
        raise TypeError(f"the dataset ({type(dataset).__name__}) has no __getitem__; it must be map-style")
    return n


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} ({value!r})")
    return bool(value)


def check_optional_str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")
    return value


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value

