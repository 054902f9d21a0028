"""Each sample's length in a field, read from the cache's index (no value read): what length-grouped batching,
token budgets and packing need (``MmapCachedDataset.lengths``), and the grouping itself (``by_length``).

A length is the size of a value's first dimension: a token field's tokens, a ragged ``str``'s UTF-8 bytes, a field
of boxes' boxes. For a ragged field it is the index row's first shape word, for a ``max_shapes`` field its shape
file's, and a fixed field's is its one shape. Only stored samples have one: the cache must hold every sample (its
current variant, and not stale unless stale rows are served as they are, ``stale="serve"``: what a read gives), and a
cache a writer changes while the lengths are read is read again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import SampleNotCachedError

__all__ = ["TOKEN_FIELDS", "by_length", "sample_lengths"]

# The fields a Hugging Face tokenizer returns: given as (1, n) integers (its ``return_tensors="pt"`` per sample),
# they are refused naming the fix, where a (1, n) field of any other name (mono audio, say) is left as it is.
TOKEN_FIELDS = frozenset({"input_ids", "attention_mask", "token_type_ids", "special_tokens_mask", "labels",
                          "position_ids"})

_TRIES = 8


def sample_lengths(reader: Any, rows: np.ndarray, field: str, where: str) -> np.ndarray:
    """The lengths (int64) of field ``field`` of the samples stored in ``rows`` (every sample's row, in index order).

    Raises:
        ValueError: no such field, or one without a first dimension (a scalar).
        SampleNotCachedError: a sample is not stored (its row missing, not filled, or stale), naming how many and
            the fix; or writers kept changing the cache while the lengths were read.
    """
    names = [f.name for f in reader.fields]
    if field not in names:
        raise ValueError(f"{where} has no field {field!r}; its fields are {names}")
    k = names.index(field)
    spec = reader.fields[k]
    if not spec.shape:
        raise ValueError(f"field {field!r} of {where} is a scalar ({spec.kind}): it has no length; name a ragged "
                         "field (token ids, text) or an array")
    if (rows < 0).any():
        raise SampleNotCachedError(
            f"{where} holds {int((rows >= 0).sum())} of its {len(rows)} samples (max_bytes, cache_indices or a "
            "node share): the lengths of the others are not stored; length-grouped batching needs a cache of "
            "every sample")
    state = reader.state
    for _ in range(_TRIES):
        lengths = _read_lengths(reader, rows, k, field, where, False)
        if lengths is not None:
            return lengths
    # Writers kept changing the cache (a refresh and fill beside this reader, as `build --follow` runs): read under
    # the writer lock, where none is mid-change (they wait the moment this takes).
    found = state.still(lambda: _read_lengths(reader, rows, k, field, where, True))
    assert found is not None  # (under the lock nothing changes: a read either returns or raises)
    return found


def _read_lengths(reader: Any, rows: np.ndarray, k: int, field: str, where: str, locked: bool) -> np.ndarray | None:
    """``sample_lengths``' one read: the lengths, or None if a writer changed the cache meanwhile or is rewriting a
    row (read again); unless ``locked`` (the caller holds the writer lock: no writer is mid-change)."""
    state, spec = reader.state, reader.fields[k]
    counter = state.all_complete()
    if counter < 0:
        before = state.changes[0]
        stored = state.filled_rows(rows)
        if reader.recompute_stale:  # (stale="serve": a stale row is read as it is, its length too)
            stored &= ~state.stale_rows(rows)
        missing = len(rows) - int(stored.sum())
        if missing and not locked and (before & 1 or state.changes[0] != before):
            return None  # (a writer in a change: a row it rewrites has an odd counter until it is done)
        if missing:
            raise SampleNotCachedError(
                f"{where}: {missing} of its {len(rows)} samples are not stored yet (or stale), and lengths are "
                "read from the stored samples: fill it first (ds.fill(), ds.prefill() on every rank of a job, "
                "or `mmapcache build`)")
        counter = state.changes[0] & ~1  # complete, a writer in another part of it (a refresh): read, check
    if not spec.ragged and not spec.variable:
        return np.full(len(rows), spec.shape[0], np.int64)
    table = reader.store.index[k] if spec.ragged else reader.shapes[k]
    lengths = table[:, 2 if spec.ragged else 0].take(rows)
    if state.changes[0] != counter and not locked:
        return None
    if field in TOKEN_FIELDS and spec.ragged and len(spec.shape) == 2 and spec.np_dtype.kind in "iu" and (
            len(rows) and not (lengths - 1).any() and (table[:, 3].take(rows) != table[rows[0], 3]).any()):
        raise ValueError(f"field {field!r} of {where} holds values of shape (1, n) (as a tokenizer's "
                         "return_tensors='pt' gives them), whose lengths (first dimension) are all 1: "
                         "return 1-D token ids from the dataset (squeeze(0), or leave return_tensors out)")
    return lengths.astype(np.int64, copy=False)


def by_length(order: np.ndarray, lengths: np.ndarray, group: int) -> np.ndarray:
    """``order`` with each run of ``group`` consecutive positions sorted longest first (ties in the order's order):
    batches cut from it hold samples of similar lengths, and which samples share a group stays as random as the
    order (Hugging Face's ``LengthGroupedSampler``'s megabatches). An epoch of one group (a dataset of at most
    ``group`` samples) is sorted whole: its batches are the same every epoch, in the same order, but for ties."""
    keys = lengths.take(order)
    return order[np.lexsort((-keys, np.arange(len(order)) // max(1, group)))]
