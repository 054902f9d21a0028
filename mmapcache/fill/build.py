"""Parallel fill of a cache: ``build()``, shared by ``mmapcache build`` and by code.

The cache is opened (or created) through ``fill.open``, the protocol the dataset uses too, so a cache of another
source or layout is refused before any worker starts; the build is a registered user of the cache while it runs.
Workers (``fill.workers``) claim chunks of rows and fill them; the driver (``fill.driver``) runs them, keeps the report
and finds a sample that kills its worker.

``shard=(i, n)`` keeps the chunks ``c`` with ``c % n == i``: ``n`` disjoint parts that together cover every row,
each spread over the whole index range (so a partly filled cache still splits evenly). Under ``torchrun``
(``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` set), ``shard="auto"`` takes the local rank's part: each node has its own
``/dev/shm``, so the ranks of one node share the work of filling that node's cache.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import CacheNotFoundError, CacheReadOnlyError, SourceError, UsageError
from ..store.files import is_cache, read_meta
from ..store.paths import resolve_path
from ..store.ring import Ring
from ..store.share import Share, local_rank_and_size, share_option
from ..store.split import StreamSplit, stream_split_option
from ..store.store import Store
from .create import Request, Source
from .driver import BuildReport, Driver, Failure
from .misses import checker
from .open import open_cache
from .options import CreateOptions
from .producer import Producer
from .specs import DatasetSpec
from .workers import Plan, chunk_rows

__all__ = ["build", "BuildReport", "Failure", "auto_shard"]



def auto_shard() -> tuple[int, int] | None:
    """The local rank's part under torchrun (``LOCAL_RANK``/``LOCAL_WORLD_SIZE``), else None."""
    rank, size = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if rank is None or size is None:
        return None
    try:
        shard = (int(rank), int(size))
    except ValueError:
        return None
    return shard if 0 <= shard[0] < shard[1] else None


# --- the driver, in the calling process ------------------------------------------------------------------------


def build(
    path: str | os.PathLike[str],
    source: str | Callable[[], Any] | DatasetSpec,
    *,
    kwargs: dict[str, Any] | None = None,
    workers: int | None = None,
    shard: tuple[int, int] | str | None = "auto",
    indices: tuple[int, int | None] | None = None,
    fingerprint: str | None = None,
    max_bytes: int | str | None = None,
    variants: int | None = None,
    max_shapes: Mapping[str, Sequence[int]] | None = None,
    ragged: Sequence[str] | str | None = "auto",
    store_as: Mapping[str, str] | None = None,
    refresh: float | None = None,
    node_share: bool | tuple[int, int] = False,
    rotate_every: int | None = None,
    share_seed: int = 0,
    stream: bool = False,
    stream_seed: int = 0,
    follow: bool = False,
    fail_fast: bool = False,
    check_finite: bool = False,
    deterministic: bool = True,
    seed: int | None = None,
    progress: bool = False,
    out: Any = None,
) -> BuildReport:
    """Fills every unfilled (or stale) row of a cache in parallel, creating the cache if it is missing.

    Safe to run while other builds and training processes use the cache: chunk claims keep builds from
    computing the same samples, and the cache's publication protocol keeps every row consistent. Interrupting a
    build (Ctrl-C, SIGKILL) leaves a consistent cache; running it again fills only what is missing.

    Args:
        path: the cache directory (a bare name resolves under ``$MMAPCACHE_DIR``).
        source: a spec (``package.module:name`` or ``path/to/file.py:name``) or a callable returning the
            source dataset; each worker calls it to make its own copy.
        kwargs: keyword arguments for the spec or callable.
        workers: worker processes (default: usable CPUs, divided among local ranks under torchrun).
        shard: ``(i, n)``: fill only the i-th of n disjoint parts (see the module docstring); ``"auto"``: the
            local rank's part under torchrun, else everything; None: everything.
        indices: ``(start, stop)``: only source indices in ``[start, stop)`` (stop None: to the end).
        fingerprint, max_bytes, variants, max_shapes, ragged, store_as: as for ``MmapCachedDataset``: used when
            the cache is created; checked against an existing cache (fingerprint, variants, ragged fields, store_as).
        refresh: first mark this fraction of the filled rows stale, then refill them.
        node_share, rotate_every, share_seed: as ``MmapCachedDataset``'s ``node_share``, ``rotate_every`` and
            ``seed``: under torchrun or SLURM, create (or check) this node's share and fill only it. A rotating
            share is filled for its first generation (epochs ``0 .. rotate_every-1``).
        seed: the seed of ``refresh``'s choice of rows; None (default) draws a fresh one (``report.refresh_seed``),
            so that repeated refreshes cover different rows.
        stream, stream_seed: create a stream (``MmapCachedDataset(stream=True, seed=stream_seed)``, its ring sized
            by ``max_bytes``) if the path holds no cache. A stream is not filled once but produced continuously:
            with ``follow``, ``workers`` producer processes keep its ring full ahead of its readers until
            interrupted (``mmapcache._producer``).
        follow: after filling, keep refilling rows that become unfilled or stale (another process's
            ``refresh``), polling every 0.5 s, until interrupted (KeyboardInterrupt; the CLI maps SIGTERM to it).
            For a stream: produce until interrupted (required).
        fail_fast: stop at the first sample whose source raises.
        check_finite: as ``MmapCachedDataset``'s: a sample holding NaN or infinite floating-point values is not
            stored but reported as failed (``report.failed``), like one whose source raises; a stream's producers
            leave it to its reader, which computes it and raises.
        deterministic: whether the source returns the same sample for the same index every time; recorded when
            this call creates the cache. Without a fingerprint, opening an existing cache recomputes its first
            sample and a few other stored ones and refuses the cache if the bytes differ (a changed source); a
            source with random augmentation, or one that changed on purpose before a ``refresh``, is declared
            ``deterministic=False`` (its layout is still checked), here or when the cache was created.
        progress: print progress to ``out`` (a tqdm bar on a terminal, else a line every 5 s).
        out: stream for progress (default ``sys.stdout``).

    Returns:
        A ``BuildReport``; ``report.interrupted`` is set when a KeyboardInterrupt ended the build.
    """
    started = time.monotonic()
    path = resolve_path(path)
    spec = source if isinstance(source, DatasetSpec) else DatasetSpec(source, kwargs)
    if shard == "auto":
        shard = auto_shard()
        if shard is not None and workers is None:
            workers = max(1, len(os.sched_getaffinity(0)) // shard[1])
    elif isinstance(shard, str):
        raise ValueError(f"shard must be (i, n), 'auto' or None, got {shard!r}")
    if workers is None:
        workers = len(os.sched_getaffinity(0))
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if refresh is not None and (isinstance(refresh, bool) or not 0 <= refresh <= 1):
        raise ValueError(f"refresh must be a fraction in [0, 1], got {refresh!r}")
    existing = read_meta(path) if is_cache(path) else None
    if existing is not None and existing["mode"] == "stream":
        stream, stream_seed = True, existing["stream"]["seed"]  # an existing stream: produce for it as it is
    # A stream is per node: under a job of several nodes, its node's part (store.split), as the job's ranks make it.
    share = share_option(node_share, rotate_every, share_seed) if not stream else None
    split = stream_split_option(node_share, path) if stream and existing is None else None
    if stream and existing is not None and existing["mode"] != "stream":
        raise UsageError(f"{path} holds a cache, not a stream: leave out --stream (stream=True) to fill it, or give "
                         "the stream another path")
    if stream and not follow:
        what = f"{path} is a stream" if existing is not None else "a stream (--stream, stream=True)"
        raise UsageError(f"{what}: it is produced continuously, ahead of its readers, not filled once; run the "
                         "build with --follow (follow=True) next to training")
    store, created = _open_or_create(path, spec, fingerprint=fingerprint, max_bytes=max_bytes, variants=variants,
                                     max_shapes=max_shapes, ragged=ragged, store_as=store_as,
                                     deterministic=deterministic,
                                     share=share, stream=stream, stream_seed=stream_seed, split=split,
                                     check_finite=check_finite)
    report = BuildReport(path)
    local = local_rank_and_size(path)
    if stream and local[0] != 0:
        # Under torchrun or SLURM with several processes per node: one set of producers per node, on local rank 0.
        _release(store)
        report.stream = True
        report.share = f"local rank {local[0]} of {local[1]}: this node's producers run on local rank 0"
        return report
    if stream:
        try:
            _produce(store, spec, workers, report, progress, out or sys.stdout, check_finite)
        finally:
            _release(store)
            report.elapsed = time.monotonic() - started
        return report
    if store.meta["share"] is not None:
        report.share = Share.from_json(store.meta["share"]).describe(store.length)
    try:
        start, stop = indices if indices is not None else (0, None)
        if start >= store.length:
            raise ValueError(f"indices {start}:{'' if stop is None else stop} start beyond the dataset's "
                             f"{store.length} samples; pass a range within 0:{store.length}")
        if refresh:
            report.refresh_seed = secrets.randbits(32) if seed is None else seed
            report.marked_stale = _mark_stale(store, refresh, report.refresh_seed)
        # Ragged values' sizes are not the cache's to know: such layouts keep chunks of at most 64 rows.
        row_bytes = max(sum(field.nbytes for field in store.layout.fields),
                        (64 << 10) if any(field.ragged for field in store.layout.fields) else 0)
        plan = Plan(path, spec, chunk_rows(store.rows, row_bytes), start, stop, fail_fast, check_finite)
        driver = Driver(store, plan, workers, shard, report, progress, out or sys.stdout, started)
        if created:
            driver.created()
        driver.run(follow)
    finally:
        _release(store)
        report.elapsed = time.monotonic() - started
    return report


def _open_or_create(path: str, spec: DatasetSpec, *, fingerprint: str | None, max_bytes: Any,
                    variants: int | None, max_shapes: Mapping[str, Sequence[int]] | None,
                    ragged: Sequence[str] | str | None, deterministic: bool,
                    store_as: Mapping[str, str] | None = None,
                    share: Share | None, stream: bool, stream_seed: int,
                    split: StreamSplit | None = None, check_finite: bool = False) -> tuple[Store, bool]:
    """Opens the cache, checking that it matches the source (its first sample's layout, and its bytes without a
    fingerprint: before any worker starts), or creates it. Returns it registered as used by this process."""
    dataset = spec()

    def fetch(index: int) -> Any:
        try:
            return dataset[index]
        except Exception as exc:
            # Before any worker starts: one clear error (the CLI prints one line), the traceback chained.
            raise SourceError(f"the source raised computing sample {index} while opening the cache at {path}: "
                              f"{type(exc).__name__}: {exc}; fix the source (--debug shows the traceback)") from exc

    request = Request(path, fingerprint, CreateOptions(max_bytes, None, variants, max_shapes, ragged, share, stream,
                                                       split, store_as), seed=stream_seed)
    store, created = open_cache(request, Source(len(dataset), fetch, checker(check_finite),
                                                deterministic=deterministic))
    if not store.writable:
        _release(store)
        raise CacheReadOnlyError(f"the cache at {path} is read-only for this process (file permissions or a "
                                 "read-only mount); run the build as the cache's owner")
    return store, created


def _produce(store: Store, spec: DatasetSpec, workers: int, report: BuildReport, progress: bool, out: Any,
             check_finite: bool) -> None:
    """Runs ``workers`` producers for the stream until KeyboardInterrupt (or the cache's removal); counts what
    they produced in ``report.filled`` (and ``skipped``), printing the ring's state every 5 s with ``progress``."""
    ring = Ring(store)
    before = ring.stats()
    producer = Producer.start(store.path, spec, workers, check_finite=check_finite)
    last = time.monotonic()
    restarts: list[float] = []
    try:
        while True:
            time.sleep(0.2)
            if store.moved():  # (before replacing producers: those that saw it have stopped)
                raise CacheNotFoundError(f"the stream at {store.path} was removed while this build produced for it "
                                         "(`mmapcache rm --force`?); its producers stopped. Create it again to "
                                         "produce for a new one")
            restarted = producer.replace_dead()  # a producer killed (OOM killer, SIGKILL): start another
            if restarted:
                now = time.monotonic()
                restarts = [t for t in restarts if now - t < 10] + [now] * restarted
                if len(restarts) > 3 * workers:
                    raise RuntimeError(f"the stream's producers keep dying ({len(restarts)} restarts in 10 s): "
                                       "run one in the foreground to see why: produce(path, spec) in "
                                       "mmapcache._producer, or check the source")
            if progress and time.monotonic() - last >= 5:
                last = time.monotonic()
                stats = ring.stats()
                print(f"{store.path}: produced {stats['produced'] - before['produced']}, {stats['ahead']} ready "
                      f"ahead of the readers; readers were served {stats['served']} and computed "
                      f"{stats['computed']} themselves", file=out, flush=True)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        producer.stop()
        after = ring.stats()
        report.filled = after["produced"] - before["produced"]
        report.skipped = after["skipped"] - before["skipped"]
        report.stream = True
        ring.close()


def _release(store: Store) -> None:
    store.close()
    store.detach()


def _mark_stale(store: Store, fraction: float, seed: int | None) -> int:
    """Marks a random ``fraction`` of the filled rows stale (``seed`` None: a fresh choice every call)."""
    filled = np.flatnonzero(store.state.filled_mask())
    rows = np.random.default_rng(seed).choice(filled, size=round(fraction * len(filled)), replace=False)
    return store.state.mark_stale(rows)


