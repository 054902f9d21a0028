"""A cache's misses: computing the samples it lacks from the source, checking them, and storing them, one at a
time or a batch's at once (one stack per field, one acquisition of the writer lock)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import (
    CacheFormatError,
    CacheReadOnlyWarning,
    CacheRemovedWarning,
    SampleNotCachedError,
    SourceError,
    warn,
)
from ..format.batch import FILLED, SHARED, arrays_of, overlaps
from ..format.fields import Field
from ..read.ragged import RaggedColumn
from ..read.reader import RowReader
from ..store.rows import RowMap
from ..store.state import Declined, NoRoom
from ..store.store import Store
from ..store.writer import RowWriter

# A batch's computed misses: (position in the batch, source index, checked values or None when the values are
# only in the batch's columns; see Misses.fill).
Computed = list[tuple[int, int, "list[Any] | None"]]
OnError = Callable[[int, Exception], None]  # told of a sample the source or its check failed on: (index, error)


def fetcher(source: Any, path: str) -> Callable[[int], Any]:
    """``source[index]``, its exceptions annotated with the index and the cache."""
    def fetch(index: int) -> Any:
        try:
            return source[index]
        except Exception as exc:
            _annotate(exc, index, path)
            raise
    return fetch


def _annotate(exc: Exception, index: int, path: str) -> None:
    exc.add_note(f"mmapcache: raised by the source dataset computing sample {index} for the cache at {path}")


def checker(check_finite: bool) -> Callable[..., list[Any]]:
    """``(reader, sample, index, stored=True) -> values``: the layout's check (``stored=False``: a sample served,
    never stored, whose values need not fit ``store_as``), and with ``check_finite`` a refusal of NaN and
    infinities naming the sample and field."""
    def checked(reader: RowReader, sample: Any, index: int, stored: bool = True) -> list[Any]:
        values = (reader.check if stored else reader.check_served)(sample, index)
        if check_finite:
            for field, value in zip(reader.fields, values):
                if not _finite(field, value):
                    raise ValueError(f"sample {index}, field {field.name!r}: contains NaN or infinite values "
                                     "(check_finite=True); nothing was stored for it")
        return values
    return checked


class Misses:
    """The miss path of one open cache in one process.

    Args:
        source: the source dataset, or None (then a miss is a ``SampleNotCachedError`` naming the fix).
        store, rows, reader: the open cache, its row map and its reader.
        check_finite: refuse samples with NaN or infinite floating-point values.
    """

    def __init__(self, source: Any, store: Store, rows: RowMap, reader: RowReader, check_finite: bool) -> None:
        self.source, self.store, self.rows, self.reader = source, store, rows, reader
        self.writer = RowWriter(store)
        self.path = store.path
        self.check_finite = check_finite
        self.fetch = fetcher(source, self.path)
        self.checked = checker(check_finite)
        # Whether a batch's misses are computed first and checked together (RowReader.fill_batch); off for good
        # once the source is seen to refill one buffer for every sample.
        self.batched = reader.fill_batch is not None and source is not None
        # Whether two samples computed in a row were compared for one refilled buffer in shared memory
        # (_refuse_shared_refills; once per process and cache), and the refusal, raised again for every batch after.
        self.refills_checked = False
        self.refills_refused: str | None = None

    def _still(self, read: Callable[[int, int], Any], index: int, row: int) -> Any | None:
        """Without a source: ``read(row, key)`` (the reader's ``read`` for a sample, ``read_values`` for a batch)
        under the writer lock, where a writer was rewriting the row (an odd counter, or one that kept changing, reads
        as a miss: a refresh and fill beside this reader); None if the row holds nothing to read."""
        if row < 0 or not self.store.state.filled[row >> 3] >> (row & 7) & 1:
            return None
        return self.store.state.still(lambda: read(row, index if self.rows.keyed else -1))

    def require_source(self, index: int, row: int) -> None:
        """Raises ``SampleNotCachedError`` naming the fix if there is no source to compute sample ``index``."""
        if self.source is not None:
            return
        path = self.path
        state = self.store.state
        if row >= 0 and self.reader.recompute_stale and state.filled[row >> 3] >> (row & 7) & 1 and state.stale[
                row >> 3] >> (row & 7) & 1:
            raise SampleNotCachedError(
                f"sample {index} of the cache at {path} is stale (refresh() or `mmapcache build --refresh` marked it "
                "to be computed again), and this process has no source dataset to compute it: open it with "
                "MmapCachedDataset(path, dataset), or with stale='serve' to read the stored version until a writer "
                "(`mmapcache build --follow`) replaces it")
        if row < 0:
            raise SampleNotCachedError(
                f"sample {index} is not cacheable in the cache at {path} (max_bytes/cache_indices chose "
                f"{self.rows.slots} of {self.store.length} samples), and it was opened without a source dataset; "
                "open it with MmapCachedDataset(path, dataset) to compute such samples"
            )
        raise SampleNotCachedError(
            f"sample {index} is not in the cache at {path} (opened without a source dataset); fill it with "
            f"MmapCachedDataset(path, dataset) or `mmapcache build {path} --dataset SPEC`"
        )

    def kept(self, values: list[Any]) -> list[Any]:
        """A computed sample's checked values as a batch keeps them while the source computes the next samples: each
        array copied out of the source's memory where the batch's columns keep it as given (ragged ones: a fixed
        column copies the value into itself)."""
        return values if self.reader.fixed else list(map(_private, values))

    # --- one sample --------------------------------------------------------------------------------------------

    def one(self, index: int, row: int) -> Any:
        """Computes sample ``index``, checks it and stores it in ``row`` if it is cacheable (>= 0; not when
        read-only, or without heap room). A stored miss is returned as a hit would return it (a plain Tensor, an
        int...), not as the source's own objects. Every ``ds[i]`` that misses comes here: the steps are inlined."""
        source = self.source
        if source is None:
            held = self._still(self.reader.read, index, row)
            if held is not None:
                return held
            self.require_source(index, row)
        try:
            sample = source[index]  # (self.fetch)
        except Exception as exc:
            _annotate(exc, index, self.path)
            raise
        if row < 0:
            return sample  # passes through, never stored
        if not self.refills_checked:
            self._refuse_shared_refills([index], [sample])
        reader = self.reader
        values = reader.check(sample, index) if not self.check_finite else self.checked(reader, sample, index)
        if not self.store.writable:
            _warn_read_only(self.path)
        else:
            try:
                self.store.state.publish(row, index, functools.partial(self.writer.write, row, values))
            except NoRoom:  # no heap room: served uncached (counted, and warned once)
                pass
            except CacheFormatError as exc:
                self._if_removed(exc, strict=False)
        return reader.sample_from_values(values)

    def _refuse_shared_refills(self, indices: list[int], seen: list[Any]) -> None:
        """Raises ``SourceError`` if this process is one of several DataLoader workers and the source writes every
        sample into one tensor in shared memory. Once per process and cache, on its first samples computed
        (``seen``): only if they hold a tensor in shared memory are the first two of ``indices`` (with only one,
        it and the next index) computed again, to see whether the second is written over the first.

        torch moves a dataset's tensors into shared memory when it sends the dataset to spawned workers: a source
        that decodes each sample into one tensor of its own then has all its workers writing into the same memory
        at once, and a sample can hold another's bytes by the time it is stored, where the cache would keep them
        for good. Within one process the cache copies such a source's samples out one at a time (``SHARED``);
        across processes nothing can. A source returning one constant tensor for every sample writes nothing, and
        passes."""
        if self.refills_refused is not None:
            raise SourceError(self.refills_refused)
        self.refills_checked = True
        data = sys.modules.get("torch.utils.data")
        info = data.get_worker_info() if data is not None else None
        pair = indices[:2] if len(indices) > 1 else [indices[0], (indices[0] + 1) % self.store.length]
        if info is None or info.num_workers < 2 or not any(map(_shared_tensors, seen)) or pair[0] == pair[1]:
            return
        try:  # (a sample that fails here fails again, with its index, when it is asked for)
            first = _shared_tensors(self.fetch(pair[0]))
            if not first:
                return
            # Written over: by this process (an in-place write moves the tensor's version counter, which other
            # processes cannot move back), or its bytes changed (written through numpy, or by another worker).
            versions, before = [t._version for t in first], [_bytes_of(t).clone() for t in first]
            second = _shared_tensors(self.fetch(pair[1]))
        except Exception:
            return
        import torch

        written = [t._version for t in first] != versions or not all(
            torch.equal(_bytes_of(t), b) for t, b in zip(first, before))
        if written and overlaps([first, second]):
            self.refills_refused = (
                f"the source dataset of the cache at {self.path} writes every sample into one tensor of its own, "
                f"and that tensor is in shared memory: its {info.num_workers} DataLoader workers all write into it at "
                "once (torch moves a dataset's tensors there when it sends the dataset to spawned workers), so a "
                "sample can hold another's bytes. Nothing computed in this worker is stored. Make the buffer per "
                "process (create it on first use in __getitem__, or leave it out of __getstate__), or return a new "
                "tensor for each sample")
            self.refills_checked = False  # (so that every later miss of this process raises it again)
            raise SourceError(self.refills_refused)

    def _if_removed(self, exc: CacheFormatError, strict: bool) -> None:
        """``exc`` came from publishing: if the cache was removed or replaced under this process (its writer lock
        then refuses before anything is written), what was computed is served uncached (nobody else could read it),
        with a warning; otherwise, or ``strict`` (a fill, whose purpose is to store), ``exc`` is raised."""
        if not self.store.moved():
            raise exc
        if strict:
            raise CacheFormatError(removed_message(self.path)) from None
        if self.path not in _warned_removed:
            _warned_removed.add(self.path)
            warn(f"the cache at {self.path} was removed or replaced while this process used it: the samples it lacks "
                 "are computed from the source and served, not stored; open the dataset again to cache anew",
                 CacheRemovedWarning)

    # --- a batch's misses --------------------------------------------------------------------------------------

    def store_batch(self, idx: np.ndarray, rows: np.ndarray) -> int:
        """Computes the samples ``idx`` (cache rows ``rows``) and stores those whose rows are not complete or are
        stale, as a batch (``fill``'s path: ``ds.fill``, ``prefill``). Returns how many this call stored.

        Raises:
            CacheFormatError: the cache was removed or replaced (a fill has nothing to store into).
        """
        return self.fill(idx, rows, self.empty_columns(len(idx)), list(range(len(idx))), rewrite_stale=True)

    def empty_columns(self, count: int) -> list[Any]:
        """Columns for a batch of ``count`` samples to be computed: the gather's arrays with every position empty,
        or for ``max_shapes`` fields (values of their own shapes) a list per field."""
        if self.reader.variable:
            return [[None] * count for _ in self.reader.fields]
        return self.reader.gather(np.full(count, -1, np.int64))[0]

    def fill(self, idx: np.ndarray, rows: np.ndarray, columns: list[Any], missing: list[int],
             rewrite_stale: bool = False, on_error: OnError | None = None, no_room: list[int] | None = None) -> int:
        """Fills batch positions ``missing`` of the gathered ``columns`` (of source indices ``idx``, cache rows
        ``rows``): rows filled since the gather are read again, the others computed, checked and stored under one
        acquisition of the writer lock; with ``rewrite_stale`` (a fill), stale rows are computed and rewritten
        too, and a removed cache is an error. Samples computed before one that fails are kept, and the failure
        raised; with ``on_error`` (a build), ``on_error(index, exc)`` is told instead and the others are computed
        (it may raise to stop). Rows a full heap could not take are added to ``no_room``. Returns how many rows this
        call stored."""
        if self.refills_refused is not None:
            raise SourceError(self.refills_refused)
        reader, keyed, fixed = self.reader, self.rows.keyed, self.reader.fixed
        computed: Computed = []
        stale = reader.state.stale if rewrite_stale else None
        stored = 0
        try:
            if self.batched and len(missing) > 1:
                missing = self._compute_together(idx, rows, columns, missing, computed, rewrite_stale, on_error)
            # The rest one at a time (usually none left, or a handful).
            indices, row_list = idx[missing].tolist(), rows[missing].tolist()
            filled = reader.state.filled
            for k, index, row in zip(missing, indices, row_list):
                # A row that was filled but rewritten during the gather: read it again (unless a fill rewrites it).
                values = reader.read_values(row, index if keyed else -1) if row >= 0 and filled[row >> 3] >> (
                    row & 7) & 1 and (stale is None or not stale[row >> 3] >> (row & 7) & 1) else None
                if values is None and self.source is None and row >= 0 and (
                        stale is None or not stale[row >> 3] >> (row & 7) & 1):
                    values = self._still(reader.read_values, index, row)  # (read once its writer is done)
                if values is None:
                    self.require_source(index, row)
                    try:
                        sample = self.fetch(index)
                        values = self.checked(reader, sample, index, row >= 0)
                    except Exception as exc:
                        if on_error is None:
                            raise
                        on_error(index, exc)
                        continue
                    if not self.refills_checked:  # (before this sample is kept)
                        self._refuse_shared_refills(indices, [sample])
                    if not fixed:  # kept until the batch is published: not a view of a buffer the source refills
                        values = self.kept(values)
                    if row >= 0:
                        computed.append((k, index, values))
                for column, value in zip(columns, values):
                    column[k] = value
        finally:
            if computed:
                stored = self._publish_rows(rows, columns, computed, strict=rewrite_stale, no_room=no_room)
        return stored

    def _compute_together(self, idx: np.ndarray, rows: np.ndarray, columns: list[Any], missing: list[int],
                          computed: Computed, rewrite_stale: bool = False,
                          on_error: OnError | None = None) -> list[int]:
        """Computes the misses whose rows are still empty, checks them together and writes them into the batch
        ``columns`` (``RowReader.fill_batch``: one stack per field), adding the cacheable ones to ``computed``.
        When the batch check declines a sample, every computed sample is checked (or refused) one by one instead.
        Returns the positions left to the per-sample path: rows filled since the gather, to be read again."""
        reader = self.reader
        fill = reader.fill_batch
        assert fill is not None  # the caller's condition
        positions = np.array(missing, np.int64)
        targets = rows[positions]
        cacheable = targets >= 0
        safe = np.where(cacheable, targets, 0)
        refilled = cacheable & reader.state.filled_rows(safe)
        if rewrite_stale:
            refilled &= ~reader.state.stale_rows(safe)
        todo = positions[~refilled]
        if not len(todo):
            return missing
        samples: list[Any] = []
        try:
            for index in idx[todo].tolist():
                samples.append(self.fetch(index))  # noqa: PERF401 - on a failure, the ones before it count
        except Exception:
            # The samples fetched before the failure are kept, but not as fetched: a source that refills one buffer
            # may have overwritten them with the next samples, or with the failed one's half-written bytes, and
            # one sample alone cannot show it. They are computed again, each copied out before the next (with
            # on_error, the whole batch is, by the per-sample path, which tells it of each failure).
            if on_error is not None:
                return missing
            with contextlib.suppress(Exception):
                self._fetch_each(idx, rows, columns, todo[:len(samples)].tolist(), computed)
            raise
        whole = len(todo) == len(idx)
        outcome = fill(samples, columns, None if whole else todo)
        if outcome == SHARED:
            if not self.refills_checked:
                self._refuse_shared_refills(idx[todo[:2]].tolist(), samples)
            # The source refills one buffer (whole, or at shifting offsets): the samples fetched before the last may
            # be gone. From now on, each sample is copied out before the next is computed (the per-sample path),
            # starting with these again.
            self.batched = False
            return missing
        finite = not self.check_finite or all_finite(reader.fields, columns, None if whole else todo)
        if outcome == FILLED and finite:
            keep = todo[cacheable[~refilled]]
            computed.extend((k, index, None) for k, index in zip(keep.tolist(), idx[keep].tolist()))
        else:
            self._check_each(idx, rows, columns, todo.tolist(), samples, computed, on_error)
        return positions[refilled].tolist()

    def _fetch_each(self, idx: np.ndarray, rows: np.ndarray, columns: list[Any], todo: list[int],
                    computed: Computed) -> None:
        """Computes, checks and copies into the columns one sample at a time (the per-sample path)."""
        for k in todo:
            index = int(idx[k])
            self._check_each(idx, rows, columns, [k], [self.fetch(index)], computed)

    def _check_each(self, idx: np.ndarray, rows: np.ndarray, columns: list[Any], todo: list[int],
                    samples: list[Any], computed: Computed, on_error: OnError | None = None) -> None:
        """Checks computed samples one by one (refusing a bad one with its index, or telling ``on_error`` of it),
        writing each into the columns."""
        for k, sample in zip(todo, samples):
            index = int(idx[k])
            try:
                values = self.checked(self.reader, sample, index, rows[k] >= 0)
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(index, exc)
                continue
            values = self.kept(values)  # (its ragged columns keep it: not a view of the source's memory)
            if rows[k] >= 0:
                computed.append((k, index, values))
            for column, value in zip(columns, values):
                column[k] = value

    def _publish_rows(self, rows: np.ndarray, columns: list[Any], computed: Computed, strict: bool = False,
                      no_room: list[int] | None = None) -> int:
        """Stores a batch's computed misses; the batch ``columns`` already hold the values (fixed layouts store
        from them, each step vectorised; their values may be None, the columns filled by ``fill_batch``). Returns
        how many rows were stored."""
        if not self.store.writable:
            _warn_read_only(self.path)
            return 0
        reader, state = self.reader, self.store.state
        if reader.fixed:
            positions = np.array([k for k, _, _ in computed], np.int64)
            first = _first_of_each(rows[positions])
            positions = positions[first]
            keys = np.array([index for _, index, _ in computed], np.int64)[first]
            try:
                return state.publish_rows(rows[positions], keys, lambda todo: self.writer.write_rows(
                    rows, columns, positions[todo]))
            except CacheFormatError as exc:
                self._if_removed(exc, strict)
                return 0
        positions = np.array([k for k, _, _ in computed], np.int64)
        indices = [index for _, index, _ in computed]
        try:
            if reader.ragged and len(computed) > 1:
                with contextlib.suppress(Declined):
                    return self._publish_new_rows(rows, columns, positions, np.array(indices, np.int64), computed)
            return state.publish_many([(row, index, functools.partial(self.writer.write, row, values))
                                       for row, index, values in zip(rows[positions].tolist(), indices,
                                                                     _values(columns, computed))], no_room)
        except CacheFormatError as exc:
            self._if_removed(exc, strict)
            return 0

    def _publish_new_rows(self, rows: np.ndarray, columns: list[Any], positions: np.ndarray, keys: np.ndarray,
                          computed: Computed) -> int:
        """Stores a batch's computed misses (``computed``, of source indices ``keys``, at batch ``positions`` of
        ``rows`` and ``columns``), of a layout with ragged fields, at once: their ragged values packed back to back
        at the heaps' ends with one system call per field (``RowWriter.write_new_rows``), which is where storing
        them one at a time would put them, and their fixed fields from the batch's columns, one step per field.
        ``Declined``, with nothing changed, where it would not."""
        targets = rows[positions]
        keep = _first_of_each(targets)
        reader = self.reader

        def write(todo: np.ndarray) -> None:
            chosen = keep[todo]
            at = positions[chosen]
            entries = [computed[n] for n in chosen.tolist()]
            given = [values for _, _, values in entries]
            if reader.variable:  # (its columns are lists: the values are the computed ones)
                samples = _values(columns, entries)
                ragged: list[Any] = [[values[n] for values in samples] for n in reader.ragged]
                fixed: Any = samples
            elif all(values is not None for values in given):  # (computed one by one: each sample's own values)
                ragged = [[values[n] for values in given if values is not None] for n in reader.ragged]
                fixed = (rows, columns, at)
            else:
                ragged = [_ragged_values(columns[n], at) for n in reader.ragged]
                fixed = (rows, columns, at)
            self.writer.write_new_rows(targets[chosen], ragged, fixed)
        return self.store.state.publish_rows(targets[keep], keys[keep], write, new_only=True)


def _values(columns: list[Any], computed: Computed) -> list[list[Any]]:
    """Each computed miss's values: as computed, or (``None``: a batch filler put them into the columns) taken from
    the columns (a ragged column's value at the position, a fixed column's row)."""
    parts: dict[int, list[Any]] = {}

    def at(n: int, k: int) -> Any:
        column = columns[n]
        if isinstance(column, RaggedColumn):
            if n not in parts:
                parts[n] = column.parts()
            return parts[n][k]
        return column[k]
    return [values if values is not None else [at(n, k) for n in range(len(columns))] for k, _, values in computed]


def _ragged_values(column: RaggedColumn, at: np.ndarray) -> Any:
    """A ragged field's values at batch positions ``at`` (misses a batch filler filled), as
    ``RowWriter.write_new_rows`` takes them: the column's own ``(flat, shapes)`` where it holds exactly them, in order
    (a batch filled whole), else a list of arrays."""
    if not column.patches and len(at) == len(column.counts) and bool((at == np.arange(len(at))).all()):
        return column.flat, column.shapes
    parts = column.parts()
    return [parts[k] for k in at.tolist()]


def _private(value: Any) -> Any:
    """A checked value the batch may keep while the source computes its next samples: an array copied out of the
    source's memory, unless it lies in a ``bytes`` object (a str's or bytes' value, encoded by the check: nobody
    can change it)."""
    if type(value) is np.ndarray and type(value.base) is not bytes:
        return value.copy()
    return value


def _first_of_each(targets: np.ndarray) -> np.ndarray:
    """The positions of each row's first occurrence in a batch's ``targets``, in batch order (an index asked twice
    in a batch is stored once)."""
    if len(set(targets.tolist())) == len(targets):  # (the usual batch: every row once)
        return np.arange(len(targets))
    return np.sort(np.unique(targets, return_index=True)[1])


def _shared_tensors(sample: Any) -> list[Any]:
    """The tensors of a sample that lie in shared memory."""
    return [a for a in arrays_of(sample) if hasattr(a, "is_shared") and a.is_shared()]


def _bytes_of(tensor: Any) -> Any:
    """A tensor's elements as flat bytes (compared bit for bit: NaN equals itself)."""
    import torch

    return tensor.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8)


def _finite(field: Field, value: Any) -> bool:
    """Whether a field's value (as checked for storing) holds no NaN or infinity. Floating-point types numpy lacks
    (bfloat16, float8, complex32) are stored as unsigned ints: they are tested as what they are."""
    array = np.asarray(value)
    if field.torch_dtype and array.dtype.kind == "u" and field.torch_dtype.startswith(("bfloat", "float", "complex")):
        import torch

        real = torch.from_numpy(np.ascontiguousarray(array)).view(getattr(torch, field.torch_dtype))
        try:
            return bool(torch.isfinite(real).all())
        except (RuntimeError, TypeError):  # a type without isfinite in this torch: through float32
            return bool(torch.isfinite(real.to(torch.complex64 if real.is_complex() else torch.float32)).all())
    return array.dtype.kind not in "fc" or bool(np.isfinite(array).all())


def all_finite(fields: Sequence[Field], columns: list[Any], positions: np.ndarray | None) -> bool:
    """Whether the batch's columns hold no NaN or infinity at ``positions`` (None: anywhere)."""
    return all(_finite(field, _at(column, positions)) for field, column in zip(fields, columns))


def _at(column: Any, positions: np.ndarray | None) -> Any:
    """A column's values at ``positions`` (None: all) as one array (a ragged column's: its values' elements)."""
    if not isinstance(column, RaggedColumn):
        return column if positions is None else column[positions]
    if positions is None:
        return column.merged()[0]
    parts = column.parts()
    return np.concatenate([parts[k] for k in positions.tolist()], axis=None) if len(positions) else column.flat[:0]


_warned_read_only: set[str] = set()
_warned_removed: set[str] = set()


def removed_message(path: str) -> str:
    """Why a fill of a cache removed or replaced under this process stores nothing, and what to do."""
    return (f"the cache at {path} was removed (`mmapcache rm --force`), or replaced by another, while this process "
            "had it open: what this process stores could not be read by any other; open the dataset again (it "
            "creates the cache anew from its source, or opens the new one)")


def _warn_read_only(path: str) -> None:
    if path not in _warned_read_only:
        _warned_read_only.add(path)
        warn(
            f"the cache at {path} is read-only for this process (file permissions or a read-only mount): missing "
            "samples are computed from the source but not stored", CacheReadOnlyWarning,
        )
