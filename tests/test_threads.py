"""Threads of one process missing at once: they finish, and other processes' misses are not blocked.

The writer lock's per-process state is opened lazily; threads racing to open it each replaced the descriptor and
the thread lock, so one thread unlocked another's descriptor and a flock stayed held for good: the threads hung,
and so did every other process's miss on that cache. The race needs threads to interleave inside the lazy open,
so the test shrinks the interpreter's switch interval and repeats on freshly opened datasets.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}

_THREADS = textwrap.dedent("""
    import sys, time
    from concurrent.futures import ThreadPoolExecutor
    from helpers.sources import ImageLabels
    from mmapcache import MmapCachedDataset
    path = sys.argv[1]
    MmapCachedDataset(path, ImageLabels(4000)).close()  # created by another object
    sys.setswitchinterval(1e-6)  # interleave threads as often as possible
    source = ImageLabels(4000, delay=0.01)
    for r in range(30):
        ds = MmapCachedDataset(path, source)  # opened afresh: the lock is opened lazily by the first miss
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ds.__getitem__, range(1 + 8 * r, 9 + 8 * r)))
        assert [label for _, label in got] == [i * 7 % 10 for i in range(1 + 8 * r, 9 + 8 * r)]
        ds.close()
    print("threads done", flush=True)
""")

_OTHER_MISS = textwrap.dedent("""
    import sys, time
    from helpers.sources import ImageLabels
    from mmapcache import MmapCachedDataset
    ds = MmapCachedDataset(sys.argv[1], ImageLabels(4000))
    start = time.monotonic()
    ds[3999]  # a miss: takes the writer lock
    print(f"other miss {time.monotonic() - start:.3f}", flush=True)
""")


def test_threads_missing_at_once_finish_and_do_not_block_other_processes(shm_dir: str) -> None:
    path = os.path.join(shm_dir, "c")
    threads = subprocess.Popen([sys.executable, "-c", _THREADS, path], env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        out, err = threads.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        threads.kill()
        out, err = threads.communicate()
        raise AssertionError(f"threads missing at once hung (killed after 120 s): {err[-2000:]}") from None
    assert threads.returncode == 0 and "threads done" in out, err[-2000:]
    started = time.monotonic()
    other = subprocess.run([sys.executable, "-c", _OTHER_MISS, path], env=ENV, capture_output=True, text=True,
                           timeout=60)
    assert other.returncode == 0 and "other miss" in other.stdout, other.stderr[-2000:]
    assert time.monotonic() - started < 60


def test_closing_a_cache_under_another_threads_loader_stops_it_with_a_clear_error(cache_path: str) -> None:
    """Found by review: ``ds.close()`` while another thread's cold loader filled the cache killed that thread with
    ``AttributeError: 'SlotState' object has no attribute 'changes'``. It says the cache was closed under it now, and
    what was stored is sound."""
    import threading

    import torch

    from mmapcache import MmapCachedDataset

    reached, closed = threading.Event(), threading.Event()

    class Waits(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 200

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            if i == 40:
                reached.set()
                closed.wait(30)
            return {"input_ids": torch.arange(1 + i % 17) + i}

    ds = MmapCachedDataset(cache_path, Waits())
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in ds.loader(batch_size=8):
                pass
        except BaseException as exc:  # (reported to the test)
            errors.append(exc)

    thread = threading.Thread(target=read)
    thread.start()
    assert reached.wait(30)
    ds.close()
    closed.set()
    thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], ValueError), errors
    assert "was closed (ds.close()) while this process still read or filled it" in str(errors[0])
    with MmapCachedDataset(cache_path, Waits()) as again:
        assert all(torch.equal(again[i]["input_ids"], torch.arange(1 + i % 17) + i) for i in range(200) if i != 40)


def test_a_closed_caches_state_says_it_is_closed_to_whatever_reads_it(cache_path: str) -> None:
    """Review: the closed state's stand-ins raised the closed error only when indexed; a count or mask over them
    (numpy's conversions, comparisons, bit operations) failed with numpy's TypeError."""
    import numpy as np
    import pytest

    from mmapcache import MmapCachedDataset

    ds = MmapCachedDataset(cache_path, list(range(10)))
    state = ds._ensure_open().state
    ds.close()
    for look in (state.filled_mask, state.stale_mask, state.complete_rows, state.all_complete,
                 lambda: state.filled_rows(np.arange(3))):
        with pytest.raises(ValueError, match=r"was closed \(ds.close\(\)\) while this process still read"):
            look()
