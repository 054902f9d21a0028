"""Hugging Face's ``Trainer`` reading ``ds.loader`` (batches copied straight from the cache's heaps) and resuming it
exactly. Imports ``transformers``; nothing else in mmapcache does.

``Trainer`` reads the loader its ``get_train_dataloader`` returns, and calls its ``set_epoch`` each epoch. To resume
a run mid-epoch it would skip the epoch's first batches by rebuilding a DataLoader from a batch sampler, which
``ds.loader`` has not; the loader skips them itself instead: ``LoaderState`` saves its ``state_dict()`` in each
checkpoint (a file per rank) and loads it when the run resumes, with ``TrainingArguments(ignore_data_skip=True)``::

    class CacheTrainer(transformers.Trainer):
        def get_train_dataloader(self):
            return loader                  # ds.loader(batch_size=..., shuffle=True, collate_fn=TextCollate(...))

    trainer = CacheTrainer(model=model, args=TrainingArguments(..., ignore_data_skip=True),
                           train_dataset=ds, callbacks=[LoaderState(loader)])
    trainer.train(resume_from_checkpoint=True)

The resumed pass draws nothing from torch's generator (``read.order``), so with the generators ``Trainer`` restores
from the checkpoint, a resumed run reads the batches and computes the losses of the uninterrupted one. With
``gradient_accumulation_steps`` > 1, keep it a divisor of an epoch's batches: ``Trainer`` counts a resumed epoch's
steps from 0 and would not close its last short accumulation.

Resume on the number of ranks that saved the checkpoint. ``ds.loader``'s state itself resumes on any number
(``read.loader_state``), but ``Trainer`` finds the epoch a checkpoint was in by dividing its step by its own steps per
epoch: saved by 2 ranks at step 15 of 10-step epochs (epoch 1), resumed on 1 it would call ``set_epoch(0)`` and
read epoch 0 again. ``LoaderState`` refuses such a resume instead of letting it read the wrong epochs.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers

__all__ = ["LoaderState"]

STATE_FILE = "mmapcache-loader-{rank}.pt"  # in each checkpoint-<step> folder


class LoaderState(transformers.TrainerCallback):
    """Saves ``loader``'s place (``state_dict()``) in each checkpoint ``Trainer`` writes and puts it back when the run
    resumes from one (see the module docstring).

    Raises (when a run resumes):
        ValueError: ``ignore_data_skip`` is not set (``Trainer`` would skip the batches itself, and fail), or the
            checkpoint holds no state of this rank's loader (saved without ``LoaderState``: the resumed epoch would
            start over), or it was saved by another number of ranks (``Trainer`` would set another epoch).
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    @staticmethod
    def path(args: Any, state: Any) -> str:
        """This rank's state file in the checkpoint of ``state.global_step`` under ``args.output_dir``."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return os.path.join(args.output_dir, f"checkpoint-{state.global_step}", STATE_FILE.format(rank=rank))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        path = self.path(args, state)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(self.loader.state_dict(), path)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.global_step:  # a new run
            return
        if not args.ignore_data_skip:
            raise ValueError("LoaderState resumes the loader where the checkpoint left it, and Trainer would skip "
                             "that epoch's first batches again (and fail: ds.loader has no batch sampler to "
                             "rebuild); pass TrainingArguments(ignore_data_skip=True)")
        path = self.path(args, state)
        if not os.path.exists(path):
            raise ValueError(f"the checkpoint of step {state.global_step} holds no state of this rank's loader "
                             f"({path}): it was saved without LoaderState, and the resumed epoch would start over; "
                             "resume from a checkpoint saved with it")
        saved = torch.load(path, weights_only=False)
        ranks = args.world_size
        if isinstance(saved, dict) and "world_size" in saved:  # (a mixture of node shares: its node's ranks)
            ranks = saved["world_size"] * saved.get("nodes", 1)
        if ranks != args.world_size:
            raise ValueError(f"the checkpoint of step {state.global_step} was saved by a job of {ranks} rank(s) and "
                             f"this one has {args.world_size}: Trainer finds the epoch to resume by dividing the step "
                             "by its own steps per epoch, so it would set the loader to another epoch than the one "
                             f"the checkpoint was in and read samples twice or never; resume on {ranks} rank(s)")
        self.loader.load_state_dict(saved)
