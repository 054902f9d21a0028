"""Every byte-range lock a process holds on a cache's ``lock`` file stays held whatever else that process opens and
closes: a stream reader's rank, a stream reader's wait for a row, a build worker's chunk.

They were POSIX record locks, which the kernel drops, every one the process holds on the file, when *any*
descriptor of it is closed: after ``mmapcache.verify(path)`` in a stream reader's process (which opens and closes
its own descriptor of ``lock``), a second reader of the same rank was admitted (4 of 4 runs of a hostile suite),
the two split the rank's part, and were served the same computations. Each lock here is taken in a real process,
which then makes every call a user makes beside its training loop; another process then finds the lock held.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import pytest

import mmapcache
from helpers.processes import join_all, running
from helpers.sources import ImageLabels
from helpers.stream_sources import Fresh
from mmapcache import CacheInUseError, MmapCachedDataset
from mmapcache.cli import main as cli
from mmapcache.store.lock import ChunkClaims
from mmapcache.store.ring import Ring
from mmapcache.store.store import Store


def _users_calls(path: str) -> list[Callable[[], Any]]:
    """What a user runs beside a training loop, in its process: each opens and closes a descriptor of ``lock``."""
    def another_dataset() -> None:
        MmapCachedDataset(path).close()

    def cli_verify() -> None:
        assert cli(["verify", path]) == 0

    return [lambda: mmapcache.verify(path), lambda: mmapcache.describe(path), cli_verify, another_dataset,
            lambda: mmapcache.gc(os.path.dirname(path)), lambda: mmapcache.list_caches(os.path.dirname(path))]


def _read_rank_0_then_call(path: str, ready: Any, done: Any) -> None:
    with MmapCachedDataset(path, Fresh(120), stream=True, seed=1) as ds:
        batches = iter(ds.loader(batch_size=4, rank=0, world_size=1))
        next(batches)
        for call in _users_calls(path):
            call()
        next(batches)  # (still reading)
        ready.set()
        done.wait(60)


def test_a_stream_readers_rank_lock_survives_verify_and_every_call_beside_it(cache_path: str) -> None:
    ctx = multiprocessing.get_context("fork")
    MmapCachedDataset(cache_path, Fresh(120), stream=True, seed=1).close()
    ready, done = ctx.Event(), ctx.Event()
    first = ctx.Process(target=_read_rank_0_then_call, args=(cache_path, ready, done))
    with running([first]):
        assert ready.wait(60)
        with MmapCachedDataset(cache_path, Fresh(120), stream=True, seed=1) as ds:
            with pytest.raises(CacheInUseError, match=f"is being read by process {first.pid}: two readers of one"):
                next(iter(ds.loader(batch_size=4, rank=0, world_size=1)))
        done.set()
        assert join_all([first], 60) == [0]


def _hold_then_call(path: str, what: str, ready: Any, done: Any) -> None:
    store = Store(path)
    if what == "wait":
        ring = Ring(store)
        assert ring.wait_for(5)  # a reader waiting for position 5's value
    else:
        claims = ChunkClaims(path)
        assert claims.try_claim(3)  # a build worker's chunk 3
    for call in _users_calls(path):
        call()
    ready.set()
    done.wait(60)


@pytest.mark.parametrize("what", ["wait", "chunk"])
def test_a_wait_lock_and_a_build_chunk_claim_survive_every_call_beside_them(shm_dir: str, what: str) -> None:
    path = os.path.join(shm_dir, "cache")
    if what == "wait":
        MmapCachedDataset(path, Fresh(120), stream=True, seed=1).close()
    else:
        MmapCachedDataset(path, ImageLabels(40)).close()
    ctx = multiprocessing.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_then_call, args=(path, what, ready, done))
    with running([holder]):
        assert ready.wait(60)
        store = Store(path)
        try:
            if what == "wait":
                ring = Ring(store)
                assert ring.waited_for(5), "the reader's wait lock was dropped"
                assert not ring.waited_for(6)
                ring.close()
            else:
                claims = ChunkClaims(path)
                assert not claims.try_claim(3), "the worker's chunk claim was dropped"
                assert claims.try_claim(4)
                claims.close()
        finally:
            store.close()
        done.set()
        assert join_all([holder], 60) == [0]


def _claim_in_child(path: str, chunk: int, result: Any) -> None:
    claims = ChunkClaims(path)
    result.put(claims.try_claim(chunk))


def test_claims_are_the_claimers_own_not_a_forked_childs(cache_path: str) -> None:
    """A forked child (a DataLoader worker, a producer) must not share its parent's claims: it would take a chunk
    its parent holds (the same open file description) or release the parent's by unlocking it."""
    MmapCachedDataset(cache_path, ImageLabels(8)).close()
    claims = ChunkClaims(cache_path)
    assert claims.try_claim(7)
    ctx = multiprocessing.get_context("fork")
    result = ctx.Queue()
    child = ctx.Process(target=_claim_in_child, args=(cache_path, 7, result))
    with running([child]):
        assert result.get(timeout=60) is False
        assert join_all([child], 60) == [0]
    other = ChunkClaims(cache_path)
    assert not other.try_claim(7)  # held by `claims`, also within this process (another descriptor)
    claims.close()
    assert other.try_claim(7)
    other.close()
