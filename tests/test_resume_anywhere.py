"""Resume at every point of a pass: a state taken after ``k`` batches, for every ``k`` from 0 (after ``iter()``,
before the first batch) to all of them (after the last batch, before the iterator is exhausted), and after the pass
ended, loaded into a new loader in the same process and in a new one, yields exactly what the original loader went on
to yield: the rest of that pass and the next two, with 0 workers (every point) and 2 (every edge: after ``iter()``,
the first batch, the last two, the end), 1 and 2 ranks, and ``set_epoch`` called
before ``load_state_dict``, after it, after ``iter()`` as PyTorch Lightning does (which moves on to the next epoch
from a state taken after an epoch's last batch), or never (each pass a new order).

Found by users: from a state taken after an epoch's last batch, a trainer that moved on to the next epoch read
nothing (Lightning resumed from a step checkpoint on the last step skipped the whole next epoch); states taken at the
boundaries of a pass, in a process that had read that epoch before, resumed another order.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from helpers.processes import another_process, collect, join_all, running
from helpers.resume_points import Case, N, cases, options, original, resume, resume_all
from helpers.sources import Numbered
from mmapcache import MmapCachedDataset


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = os.path.join("/dev/shm", f"mmapcache-test-resume-{os.getpid()}-{os.urandom(4).hex()}")
    with MmapCachedDataset(path, Numbered(N), fingerprint="numbered", delete_on_close=True) as ds:
        ds.fill()
        yield path


def _in_a_new_process(path: str, opts: dict[str, Any], todo: list[Case]) -> list[Any]:
    """What each case's resumed loader yields in another process (``helpers.processes.another_process``), one that
    never read the cache or held a loader."""
    ctx = another_process()
    results = ctx.Queue()
    proc = ctx.Process(target=resume_all, args=(path, opts, todo, results))
    with running([proc]):
        (got,) = collect(results, 1, 300)
        assert join_all([proc], 60) == [0]
    return got


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_taken_anywhere_resumes_what_the_loader_went_on_to_read(filled: str, workers: int, ranks: int,
                                                                        tmp_path: Any) -> None:
    opts = options(workers, ranks)
    todo: list[Case] = []
    with MmapCachedDataset(filled, Numbered(N), fingerprint="numbered") as ds:
        for set_epoch in (True, False):
            with MmapCachedDataset(filled, Numbered(N), fingerprint="numbered") as fresh:  # no pass read yet
                read, states = original(fresh, opts, set_epoch)
            # Every pass its own order (in a job of ranks, a loop without set_epoch reads DistributedSampler's again).
            assert len({str(p) for p in read}) == (len(read) if set_epoch or ranks == 1 else 1)
            # With workers, the edges of one pass (each worker's start costs what the order's checks cost whole):
            # workers change when an order is drawn, not how, and the edges are where the drawing time matters.
            todo += cases(read, states, set_epoch, edges_only=workers > 0)
        # In the same process, after the original loader went on: one dataset object, its passes recorded.
        read, _ = original(ds, opts, True)
        for case in todo:
            assert resume(ds, opts, case) == case.expected, f"same process, {case.name}"
        assert len(todo) >= (16 if workers else 36)
    for case, got in zip(todo, _in_a_new_process(filled, opts, todo)):
        assert got == case.expected, f"new process, {case.name}"


def test_set_epoch_repeats_its_epochs_order_in_one_process(filled: str) -> None:
    # DistributedSampler's order is a function of (seed, epoch): set_epoch(0) again after reading epoch 0 gave
    # another order (a pass counter meant for loops that never call set_epoch).
    with MmapCachedDataset(filled, Numbered(N), fingerprint="numbered") as ds:
        loader = ds.loader(batch_size=BATCH_ONE, shuffle=True)
        loader.sampler.set_epoch(0)
        first = [b[1].tolist() for b in loader]
        for again in (lambda: loader.sampler.set_epoch(0), lambda: ds.set_epoch(0)):
            again()
            assert [b[1].tolist() for b in loader] == first
            again()
            assert [b[1].tolist() for b in ds.loader(batch_size=BATCH_ONE, shuffle=True)] == first  # a new loader
        assert [b[1].tolist() for b in loader] != first  # read again without set_epoch: a new order
        ds.set_epoch(1)
        ds.set_epoch(0)
        assert [b[1].tolist() for b in loader] == first


BATCH_ONE = 5
