"""``ds.loader()`` under real PyTorch Lightning jobs (2 CPU ranks, gloo), and torchdata's ``StatefulDataLoader`` as
the reference of the resume protocol.

Lightning replaces a loader's sampler with a ``DistributedSampler`` unless it already is one; before, it wrapped the
loader's own shuffled order, drawn differently on each rank, and each epoch trained on about three quarters of the
data, a quarter of it on both ranks. Each job runs ``helpers/lightning_script.py`` in a subprocess (Lightning's
``ddp`` starts rank 1 by running the script again), which records every batch each rank trained on.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.lightning_jobs import fit
from helpers.lightning_jobs import records as _records
from helpers.once import once_per_run
from helpers.sources import ImageLabels
from mmapcache import MmapCachedDataset

N = 96  # 6 batches of 8 per rank and epoch
ONE = ("--devices", "1", "--strategy", "auto", "--epochs", "3")  # one device, no seed


def _fit(*jobs: tuple[str, ...]) -> None:
    """Runs the jobs ``(out, cache, *options)``, each over ``N`` samples, one after the other in one new process."""
    fit(*((out, cache, "--n", str(N), *args) for out, cache, *args in jobs))


def _covered_once(records: list[dict[str, Any]], out: str, epochs: int) -> None:
    """Each epoch covers the dataset once across the 2 ranks, each epoch in its own order, and the source computed
    each sample once, on one rank or the other."""
    for epoch in range(epochs):
        ranks = [[i for r in records if r["epoch"] == epoch and r["rank"] == rank for i in r["indices"]]
                 for rank in range(2)]
        assert len(ranks[0]) == len(ranks[1]) == N // 2
        assert sorted(ranks[0] + ranks[1]) == list(range(N)), f"epoch {epoch}: not each sample once"
    orders = [[i for r in records if r["epoch"] == epoch and r["rank"] == 0 for i in r["indices"]]
              for epoch in range(epochs)]
    assert len({str(order) for order in orders}) == epochs  # Lightning's set_epoch reached the order
    with open(os.path.join(out, "calls")) as f:
        calls = sorted(int(line) for line in f)
    assert calls == list(range(N))


@pytest.fixture
def whole_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The uninterrupted jobs the resumed ones are compared with (``{name: output folder}``), run once per test run,
    one after the other in one new process (a Lightning start-up costs about 9 CPU-seconds on the suite's machine):

    - ``ranks``: 2 ranks under ``ddp_spawn`` (the resumed jobs run under ``ddp``: how the ranks were started must
      not matter), 3 epochs of 6 steps, a checkpoint every 3 steps (step 6 is taken on epoch 0's last step, before
      the loader is exhausted);
    - ``one``: 1 device, unseeded (each run's global generator differs), 3 epochs, a checkpoint at each epoch's end.

    Their caches are removed once they end: each resumed job starts on a new cache, as after a restart on another
    machine (what a job reads does not depend on what its cache held).
    """
    def run(folder: Path) -> None:
        shm = os.path.join("/dev/shm", f"mmapcache-test-lightning-{uuid.uuid4().hex[:12]}")
        try:
            _fit((str(folder / "ranks"), os.path.join(shm, "ranks"), "--strategy", "ddp_spawn", "--every", "3",
                  "--epochs", "3"),
                 (str(folder / "one"), os.path.join(shm, "one"), *ONE, "--epoch-end"))
        finally:
            shutil.rmtree(shm, ignore_errors=True)

    folder = once_per_run(tmp_path_factory, "lightning-whole", run)
    return {name: str(folder / name) for name in ("ranks", "one")}


def test_a_step_checkpoint_resumes_exactly_mid_epoch_and_on_an_epochs_last_step(
        whole_jobs: dict[str, str], shm_dir: str, tmp_path: Any) -> None:
    # The uninterrupted job once ran under ddp_spawn with a worker per rank: Lightning wrapped the loader's own
    # shuffled order, drawn differently on each rank, and each epoch trained on about three quarters of the data, a
    # quarter of it twice. Resumed from step 6 (epoch 0's last step), a job trained 0 steps of epoch 1 and ended (the
    # loader's state said "epoch 0, all batches yielded", and Lightning, moving on to epoch 1, got its empty rest);
    # torchdata's StatefulDataLoader does the same. A resumed job must train what the uninterrupted one did from
    # that step on, batch for batch, here under ddp, with and without workers (the loader's order depends neither on
    # its workers nor on how the ranks were started: one reference serves all).
    whole, cache = whole_jobs["ranks"], os.path.join(shm_dir, "c")
    records = _records(whole)
    _covered_once(records, whole, 3)  # each epoch once across the ranks, each in its own order
    reference = {(r["rank"], r["epoch"], r["batch"]): r["indices"] for r in records}
    assert len(reference) == 2 * 18
    # Epoch 0's last step, with and without workers, and mid epoch 2: three jobs, one after the other in one new
    # process (the first resumes in a process that never ran the job; each job has its own Trainer and dataset).
    resumes = {(step, workers): str(tmp_path / f"from{step}-{workers}") for step, workers in ((6, 0), (6, 2), (15, 0))}
    _fit(*((out, cache, "--epochs", "3", "--workers", str(workers), "--resume",
            os.path.join(whole, "ckpt", f"step={step}.ckpt")) for (step, workers), out in resumes.items()))
    for (step, workers), out in resumes.items():
        after = _records(out)
        where = f"resumed from step {step} with {workers} workers"
        assert [r["step"] for r in after if r["rank"] == 0] == list(range(step, 18)), where
        for record in after:
            key = (record["rank"], record["epoch"], record["batch"])
            assert record["indices"] == reference[key], f"{where}: batch {key} differs"


def test_a_restart_from_an_end_of_epoch_checkpoint_reads_the_same_epochs(whole_jobs: dict[str, str], shm_dir: str,
                                                                        tmp_path: Any) -> None:
    # ModelCheckpoint's default saves at each epoch's end, and from there Lightning restores no loader state, only
    # calls set_epoch: on one device the resumed epochs replayed the first one's order, and later, unseeded, read
    # orders drawn from the restarted process's global generator.
    whole, cache = whole_jobs["one"], os.path.join(shm_dir, "c")
    reference = [[r["indices"] for r in _records(whole, 1) if r["epoch"] == epoch] for epoch in range(3)]
    assert len({str(epoch) for epoch in reference}) == 3
    resumed = str(tmp_path / "resumed")
    _fit((resumed, cache, *ONE, "--resume", os.path.join(whole, "ckpt", "epoch=0.ckpt")))
    after = _records(resumed, 1)
    assert [[r["indices"] for r in after if r["epoch"] == epoch] for epoch in (1, 2)] == reference[1:]


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11's own, at construction
def test_resume_matches_torchdatas_stateful_dataloader(cache_path: str) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    with MmapCachedDataset(cache_path, ImageLabels(50)) as ds:
        for rank in range(2):
            def ours() -> Any:
                return ds.loader(batch_size=4, shuffle=True, rank=rank, world_size=2, seed=7)

            def reference() -> Any:
                sampler = StatefulDistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=7)
                return StatefulDataLoader(ds, batch_size=4, sampler=sampler)

            for make in (ours, reference):
                loader = make()
                loader.sampler.set_epoch(1)
                batches = iter(loader)
                head = [next(batches)[1] for _ in range(3)]
                state = loader.state_dict()
                again = make()
                again.load_state_dict(state)
                again.sampler.set_epoch(1)  # where Lightning calls it on resume: after the state is loaded
                rest = [b[1] for b in again]
                if make is ours:
                    expected = head + rest
                else:
                    assert len(head + rest) == len(expected)
                    assert all(torch.equal(a, b) for a, b in zip(head + rest, expected)), f"rank {rank}"


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's advice on workers, shuffling off for overfitting
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
# Lightning's own use of a torch 2.13 deprecation:
@pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning")
def test_overfit_batches_trains_on_the_first_batches_as_with_dataloader(cache_path: str) -> None:
    # Trainer(overfit_batches=n) rebuilds the loader with SequentialSampler(loader.dataset); ds.loader's dataset is
    # read by whole batches, and the rebuilt loader failed on its first batch.
    import lightning as L  # noqa: N812 - the name Lightning's own documentation uses
    from torch.utils.data import DataLoader

    from helpers.sources import Numbered

    class Record(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.seen = torch.nn.Linear(4, 1), []

        def training_step(self, batch: Any, _: int) -> Any:
            self.seen.append(batch[1].tolist())
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with MmapCachedDataset(cache_path, Numbered(40)) as ds:
        seen = []
        for loader in (ds.loader(batch_size=8, shuffle=True), DataLoader(ds, batch_size=8, shuffle=True)):
            model = Record()
            L.Trainer(accelerator="cpu", devices=1, max_epochs=2, overfit_batches=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model,
                                                                                                            loader)
            seen.append(model.seen)
        assert seen[0] == seen[1] == [list(range(8)), list(range(8, 16))] * 2
