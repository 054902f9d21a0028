"""Kills aimed at the windows between two stores of a multi-word update: what they leave must be a sound cache,
which ``verify`` accepts and the next writer goes on with (``docs/guarantees.md``, "crash-consistent counters").

The writer processes kill themselves right after a chosen store (``helpers.crash_points``), so every window is hit
on purpose: between a free list's head and the free counter (a value freed or popped), between the heap's end and
its abandoned bytes (room appended), between a sweep's emptied lists, its new heads and its counters.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import warnings

import pytest
import torch

import mmapcache
from helpers.crash_points import open_resized, rewrite_until_killed
from helpers.processes import another_process, join_all
from mmapcache import UncachedFieldWarning

N = 200
# (kind of counter word, the store after which the writer dies): each kind's first stores and later ones, in the
# first round's moves and in the rounds whose values no longer fit the heap budget (splits and sweeps). The end
# moves only while the heap grows to its budget: in the first writer's first round.
KILLS = [("end", 1)] + [(kind, n) for kind in ("heads", "free", "abandoned") for n in (1, 2, 3, 7, 30, 90, 250)]


def _filled(path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncachedFieldWarning)
        with open_resized(path, N, seed=0) as ds:
            ds.fill()


def test_writers_killed_between_two_counter_stores_leave_a_cache_verify_calls_sound(cache_path: str) -> None:
    """22 writers, each killed right after a store to a heap's counters (a list head, the free counter, the end,
    the abandoned bytes), one after the other on the same cache: after every kill, ``verify`` finds no damage (a
    kill between a list's head and its counter had it report "free lists hold X bytes, its counter says Y" for
    good); the next writer recounts what the dead one left half changed, and the cache ends whole."""
    _filled(cache_path)
    ctx = another_process()
    landed = []
    for k, (kind, n) in enumerate(KILLS):
        writer = ctx.Process(target=rewrite_until_killed, args=(cache_path, N, k + 1, kind, n, 12))
        writer.start()
        (code,) = join_all([writer], timeout=120)
        assert code in (0, -signal.SIGKILL), (kind, n, code)
        if code == -signal.SIGKILL:
            landed.append((kind, n))
        result = mmapcache.verify(cache_path)
        assert result.ok, (kind, n, result.problems)
    missed = sorted(set(KILLS) - set(landed))
    assert not missed, f"these kills never came (no such store in 12 rounds): {missed}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncachedFieldWarning)
        with open_resized(cache_path, N, seed=99) as ds:
            for _ in range(3):
                ds.refresh(fraction=0.5)
                ds.fill()
            assert all(bool((ds[i] == i).all()) for i in range(N))
            heap = ds._store.heaps[0]
            assert heap is not None
            free, problem = heap.free_extents()
            assert problem is None and sum(size for _, size in free) == int(heap.counters[4])
    assert mmapcache.verify(cache_path).ok


def _free_lists_and_counter(path: str) -> tuple[int, int]:
    from mmapcache.store.heap import FREE
    from mmapcache.store.store import Store

    store = Store(path, writable=False)
    try:
        heap = store.heaps[0]
        assert heap is not None
        free, problem = heap.free_extents()
        assert problem is None
        return sum(size for _, size in free), int(heap.counters[FREE])
    finally:
        store.close()


@pytest.mark.parametrize("stores", [1, 4])
def test_the_writer_after_a_kill_between_a_list_and_its_counter_recounts_it(cache_path: str, stores: int) -> None:
    """Killed right after a free list's head moved (an extent freed or popped), before the free counter did: the
    two disagree, which ``verify`` (CLI too) notes as the dead writer's, not as damage;
    the next writer's first change recounts the counter from the lists, and every value stays right."""
    _filled(cache_path)
    writer = another_process().Process(target=rewrite_until_killed, args=(cache_path, N, 5, "heads", stores, 12))
    writer.start()
    assert join_all([writer], timeout=120) == [-signal.SIGKILL]
    listed, counted = _free_lists_and_counter(cache_path)
    assert listed != counted, "the kill did not land between a list's head and the free counter"
    result = mmapcache.verify(cache_path)
    assert result.ok and len(result.recounts) == 1 and "killed between the two stores" in result.recounts[0]
    cli = subprocess.run([sys.executable, "-m", "mmapcache", "verify", cache_path], capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 0 and "the next writer recounts it (not damage)" in cli.stdout, cli.stdout + cli.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncachedFieldWarning)
        with open_resized(cache_path, N, seed=7) as ds:
            ds.refresh(indices=[0])
            ds.fill([0])
            assert _free_lists_and_counter(cache_path)[0] == _free_lists_and_counter(cache_path)[1]
            assert int(ds._store.state.changes[0]) % 2 == 0
            for _ in range(4):
                ds.refresh(fraction=0.5)
                ds.fill()
            assert all(torch.equal(ds[i], torch.full_like(ds[i], i)) for i in range(N))
    result = mmapcache.verify(cache_path)
    assert result.ok and not result.recounts
