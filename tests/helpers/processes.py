"""The one process runner of the tests: start, collect reports, join with a timeout, kill stragglers.

A test must never hang: every wait here is bounded, and every child still running when a test leaves (passing or
failing) is killed. Works with ``multiprocessing`` processes and ``subprocess.Popen`` alike.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import subprocess
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

# What the forkserver of ``another_process`` imports once: what every such process's target needs.
_PRELOAD = ["numpy", "torch", "mmapcache", "helpers.sources"]


def another_process() -> Any:
    """The ``multiprocessing`` context for processes that stand for another program using the cache (an unrelated
    script, another job's writer or reader), where the test is not about a start method: ``forkserver``, whose
    server imports torch, numpy and mmapcache once per test worker. Each process is a fork of that server, a fresh
    interpreter that never opened a cache, and starts in milliseconds instead of the 3 CPU-seconds an interpreter
    takes to import torch on the suite's 2-core machine (about half the suite's CPU went to such start-ups).

    Tests of start methods themselves (DataLoader workers, ``spawn``ed readers) name theirs. A process started here
    has the server's environment, not the test's: give it paths, not ``MMAPCACHE_DIR``.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # (no effect once this worker's server runs: it already has them)
    return context


def _alive(proc: Any) -> bool:
    return proc.poll() is None if isinstance(proc, subprocess.Popen) else proc.is_alive()


def _wait(proc: Any, timeout: float) -> None:
    if isinstance(proc, subprocess.Popen):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
    else:
        proc.join(timeout)


def kill_alive(procs: Iterable[Any]) -> list[Any]:
    """Kills (SIGKILL) and reaps every process still running; returns those it killed."""
    killed = [p for p in procs if _alive(p)]
    for p in killed:
        p.kill()
        _wait(p, 10)
    return killed


def join_all(procs: Iterable[Any], timeout: float) -> list[int | None]:
    """Waits for every process within ``timeout`` seconds in total and returns their exit codes; a straggler is
    killed and fails the test."""
    procs = list(procs)
    end = time.monotonic() + timeout
    for p in procs:
        _wait(p, max(0.1, end - time.monotonic()))
    stuck = kill_alive(procs)
    if stuck:
        pytest.fail(f"{len(stuck)} process(es) did not finish within {timeout} s (killed)")
    return [p.returncode if isinstance(p, subprocess.Popen) else p.exitcode for p in procs]


@contextlib.contextmanager
def running(procs: Iterable[Any]) -> Iterator[list[Any]]:
    """Starts ``multiprocessing`` processes (``Popen`` ones are already running) and kills any still running when
    the block ends, however it ends."""
    procs = list(procs)
    try:
        for p in procs:
            if not isinstance(p, subprocess.Popen):
                p.start()
        yield procs
    finally:
        kill_alive(procs)


def collect(reports: Any, count: int, timeout: float) -> list[Any]:
    """``count`` reports from a multiprocessing queue within ``timeout`` seconds in total, or a failed test."""
    end = time.monotonic() + timeout
    out = []
    try:
        for _ in range(count):
            out.append(reports.get(timeout=max(0.1, end - time.monotonic())))
    except queue.Empty:
        pytest.fail(f"{count - len(out)} of {count} child process(es) reported nothing within {timeout} s")
    return out
