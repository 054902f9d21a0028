"""A ``Mixture`` read by real jobs: torchrun jobs of 1, 2 and 4 ranks, and of 2 "nodes" x 2 ranks on loopback
(``helpers/mix_job_script.py``), and a real Lightning job resumed from its step checkpoints
(``helpers/lightning_script.py --mixture``). ``test_mixture.py`` proves the same properties with loaders given
``rank=``/``world_size=`` in one process; here each rank is a process that finds its place in torchrun's
environment, opens (or, first, creates) the caches beside its node's other ranks, and reads with DataLoader
workers, and a state crosses from one job to the next through ``torch.save``, as a trainer's checkpoint carries it.

The torchrun jobs run once per test run (``jobs``), each resuming from the states the one before saved; every job
starts on caches of its own, as after a restart on other machines (what a job reads must not depend on what its
caches held):

- ``nodes``: 2 nodes x 2 ranks, each node its own ``MMAPCACHE_DIR`` (its own copy of the caches). Reads 2 epochs, and
  saves rank 0's state after 1 batch of epoch 1 and after its last, with 2 workers per rank; the same for
  ``ds.loader(shuffle=True)`` over one cache.
- ``two``: 1 node x 2 ranks. Resumes ``nodes``' states (4 ranks on 2 nodes -> 2 ranks on 1), reads 2 epochs, and
  saves after 3 and 6 batches (of 7) and after the last, without workers.
- ``four``: 1 node x 4 ranks. Resumes ``two``'s states (2 -> 4) with 2 workers per rank, and reads 2 epochs.
- ``one``: 1 rank, beside ``nodes``. Reads 2 epochs.
"""

from __future__ import annotations

import collections
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.lightning_jobs import fit, records
from helpers.mix_job_script import BATCH, EPOCH_SIZE, SINGLE, SINGLE_BATCH, SINGLE_SEED, SINGLE_TAG
from helpers.mix_sources import JOB_SOURCES, STRIDE, ids_of, job_mixture
from helpers.once import once_per_run
from helpers.torchrun import TESTS, finish, results, torchrun, two_nodes

SCRIPT = os.path.join(TESTS, "helpers", "mix_job_script.py")
COUNTS = {1: 25, 2: 15, 3: 10}  # an epoch of 50 by tag, with the weights 0.5/0.3/0.2 (mix_sources.JOB_WEIGHTS)
WORLDS = {"one": 1, "two": 2, "four": 4, "nodes": 4}


@pytest.fixture
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each job's ranks' results (``mix_job_script.py``'s), by job (see the module docstring)."""
    def run(folder: Path) -> None:
        shm = os.path.join("/dev/shm", f"mmapcache-test-mixjobs-{uuid.uuid4().hex[:12]}")
        for name in (*WORLDS, "states-nodes", "states-two"):
            (folder / name).mkdir()

        def script(job: str, *args: str) -> list[str]:
            return [SCRIPT, "--results", str(folder / job), *args]

        def one_node(job: str, *args: str) -> Any:
            return torchrun(["--standalone", f"--nproc-per-node={WORLDS[job]}", *script(job, *args)],
                            {"MMAPCACHE_DIR": os.path.join(shm, job)})

        try:
            one = one_node("one", "--cover")
            try:
                two_nodes(lambda node: script("nodes", "--cover", "--save", str(folder / "states-nodes"), "--save-at",
                                              "1,last", "--single", "--workers", "2"), os.path.join(shm, "nodes"))
            finally:
                finish(one)
            finish(one_node("two", "--resume", str(folder / "states-nodes"), "--cover", "--save",
                            str(folder / "states-two"), "--save-at", "3,6,last"))
            finish(one_node("four", "--resume", str(folder / "states-two"), "--cover", "--workers", "2"))
        finally:
            shutil.rmtree(shm, ignore_errors=True)

    folder = once_per_run(tmp_path_factory, "mixture-jobs", run)
    return {job: results(str(folder / job)) for job in WORLDS}


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _padded(order: list[int], start: int, world: int) -> collections.Counter:
    """The rest of ``order`` from ``start`` as a job of ``world`` ranks reads it: padded by repeating the order's
    start, as ``DistributedSampler`` pads, to a multiple of ``world``."""
    rest = order[start:]
    return collections.Counter(rest + order[:math.ceil(len(rest) / world) * world - len(rest)])


def _check_drawn(order: list[int]) -> None:
    """An epoch's order holds each source's count, each sample of a source as often as the others (within one)."""
    per_sample = collections.Counter(order)
    assert dict(sorted(collections.Counter(i // STRIDE for i in order).items())) == COUNTS
    for n, tag in JOB_SOURCES.values():
        times = [per_sample[tag * STRIDE + i] for i in range(n)]
        assert max(times) - min(times) <= 1, f"source {tag}: drawn {times} times"


@pytest.mark.parametrize("job", list(WORLDS))
def test_each_epoch_is_read_once_across_the_ranks_with_and_without_workers(jobs: dict[str, Any], job: str) -> None:
    ranks, world = jobs[job], WORLDS[job]
    assert [(r["rank"], r["world"]) for r in ranks] == [(rank, world) for rank in range(world)]
    assert not [bad for r in ranks for bad in r["bad"]], "a batch's values or sources were not its samples'"
    orders = ranks[0]["cover"]["orders"]
    assert orders == jobs["one"][0]["cover"]["orders"]  # a function of the seed and epoch, not of the job
    assert orders[0] != orders[1]  # set_epoch reached the order
    assert all(r["cover"]["counts"] == {"a": 25, "b": 15, "c": 10} for r in ranks)
    steps = math.ceil(math.ceil(EPOCH_SIZE / world) / BATCH)
    for epoch, order in enumerate(orders):
        _check_drawn(order)
        for workers in (0, 2):
            read = [r["cover"][f"workers{workers}"]["epochs"][epoch] for r in ranks]
            where = f"epoch {epoch}, {workers} workers"
            assert [len(r) for r in read] == [steps] * world, f"{where}: not every rank the same number of batches"
            assert all(r["cover"][f"workers{workers}"]["batches"] == steps for r in ranks)  # len(loader)
            assert collections.Counter(_flat(_flat(read))) == _padded(order, 0, world), f"{where}: not the epoch once"
    for r in ranks:
        assert r["cover"]["workers0"]["epochs"] == r["cover"]["workers2"]["epochs"], "workers changed the batches"


def _single_order(epoch: int) -> list[int]:
    """The single cache's order of an epoch: DistributedSampler's permutation of (seed, epoch), as ids."""
    generator = torch.Generator()
    generator.manual_seed(SINGLE_SEED + epoch)
    return [SINGLE_TAG * STRIDE + i for i in torch.randperm(SINGLE, generator=generator).tolist()]


@pytest.mark.parametrize(("saved", "resumed", "case"), [("nodes", "two", "mix"), ("two", "four", "mix"),
                                                        ("nodes", "two", "single")])
def test_a_state_saved_by_one_job_continues_on_another_number_of_ranks(jobs: dict[str, Any], saved: str,
                                                                       resumed: str, case: str) -> None:
    # Job A's ranks read k batches of epoch 1 and rank 0's state was saved; job B, of other ranks, loaded it and read
    # on: over both jobs the epoch is read once (plus the padding of the job that read its end), every rank of B the
    # same number of batches, and B's next epoch is what a job that never resumed reads.
    a, b = jobs[saved], jobs[resumed]
    wa, wb = WORLDS[saved], WORLDS[resumed]
    assert not [bad for r in a + b for bad in r["bad"]], "a batch's values or sources were not its samples'"
    order, batch = (a[0]["saved"]["order"], BATCH) if case == "mix" else (_single_order(1), SINGLE_BATCH)
    tokens = a[0]["saved"][case]
    assert sorted(tokens) == sorted(b[0]["resumed"][case]) and tokens
    for token, at in tokens.items():
        where = f"{case}: a state of {wa} ranks after {at['k']} of {at['batches']} batches, on {wb} ranks"
        heads = [r["saved"][case][token]["head"] for r in a]
        rests = [r["resumed"][case][token]["rest"] for r in b]
        ended = at["k"] == at["batches"]
        offset = len(order) if ended else at["k"] * batch * wa
        assert collections.Counter(_flat(_flat(heads))) == (_padded(order, 0, wa) if ended else collections.Counter(
            order[:offset])), f"{where}: job A did not read the order's first positions"
        assert len({len(r) for r in rests}) == 1, f"{where}: batches per rank {[len(r) for r in rests]}"
        assert collections.Counter(_flat(_flat(rests))) == _padded(order, offset, wb), f"{where}: not the rest, once"
        for r in b:
            assert r["resumed"][case][token]["after"] == r["resumed"][case][token]["fresh"], f"{where}: next epoch"


# --- Lightning -------------------------------------------------------------------------------------------------------

LIGHTNING = ("--mixture", "--n", "90", "--epochs", "2")  # 2 ranks: 45 samples, 6 steps (5 of 8 and 1 of 5) an epoch


def _mixture_batches(folder: str) -> dict[tuple[int, int], list[list[int]]]:
    """What each rank of 2 reads of each epoch of the Lightning jobs' mixture, read here (``rank=``/``world_size=``)."""
    mix = job_mixture(folder, epoch_size=90, seed=5)
    batches = {}
    for rank in range(2):
        loader = mix.loader(batch_size=8, rank=rank, world_size=2)
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            batches[rank, epoch] = [ids_of(batch) for batch in loader]
    return batches


def test_a_lightning_job_resumed_from_a_step_checkpoint_trains_on_the_uninterrupted_jobs_batches(
        shm_dir: str, tmp_path: Path) -> None:
    # The uninterrupted job (ddp, 2 ranks, 2 epochs of 6 steps, a checkpoint every 3 steps) trains on the mixture's
    # own split of each epoch: Lightning keeps the loader's sampler (a DistributedSampler) and its set_epoch reaches
    # the mixture.
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    # Then, in the same process, a job of its own on caches of its own, SIGKILLed (every rank) as its step 5 begins,
    # after its step-3 checkpoint: it is resumed below on those caches, as a job killed mid-epoch is.
    fit((whole, os.path.join(shm_dir, "whole"), *LIGHTNING, "--every", "3"),
        (killed, os.path.join(shm_dir, "killed"), *LIGHTNING, "--every", "3", "--kill-at", "4"), killed=True)
    trained = records(whole)
    expected = _mixture_batches(os.path.join(shm_dir, "here"))
    assert [r["step"] for r in trained if r["rank"] == 0] == list(range(12))
    for r in trained:
        assert r["indices"] == expected[r["rank"], r["epoch"]][r["batch"]], f"{r}: not the mixture's batch"
        assert r["sources"] == [i // STRIDE - 1 for i in r["indices"]]
    for epoch in range(2):
        assert collections.Counter(i // STRIDE for r in trained if r["epoch"] == epoch for i in r["indices"]) == {
            1: 45, 2: 27, 3: 18}
    # Resumed from the killed job's step 3 (mid epoch 0) with 2 workers per rank, on its caches; from the
    # uninterrupted job's step 6 (epoch 0's last step: the loader's state says its pass ended) and step 9 (mid epoch
    # 1), each on new caches: three jobs, one after the other in one new process, each a new Trainer. Each trains
    # from its step on what the uninterrupted job did, batch for batch.
    # (On the same 2 devices: Lightning's own batch counters are not elastic. It continues the restored batch index
    # and ends an epoch when that index reaches the new len(loader), so a checkpoint of 1 device resumed mid-epoch on
    # 2 trains part of the epoch's rest, and one of 2 devices taken on an epoch's last step, resumed on 1, trains
    # half of the next epoch; the loader yields the whole rest either way.)
    reference = {(r["rank"], r["epoch"], r["batch"]): r["indices"] for r in trained}
    assert [r["step"] for r in records(killed) if r["rank"] == 0] == list(range(4))  # (killed before step 4's batch)
    assert sorted(os.listdir(os.path.join(killed, "ckpt"))) == ["step=3.ckpt"]
    resumes = {step: (str(tmp_path / f"from{step}"), workers) for step, workers in ((3, 2), (6, 0), (9, 0))}
    fit(*((out, os.path.join(shm_dir, "killed" if step == 3 else f"from{step}"), *LIGHTNING, "--workers",
           str(workers), "--resume", os.path.join(killed if step == 3 else whole, "ckpt", f"step={step}.ckpt"))
          for step, (out, workers) in resumes.items()))
    for step, (out, workers) in resumes.items():
        after = records(out)
        where = f"resumed from step {step} with {workers} workers"
        assert [r["step"] for r in after if r["rank"] == 0] == list(range(step, 12)), where
        for r in after:
            key = (r["rank"], r["epoch"], r["batch"])
            assert r["indices"] == reference[key], f"{where}: batch {key} differs"
