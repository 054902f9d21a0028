"""The guide's recipe for Hugging Face's ``Trainer`` reading ``ds.loader``, as the tests run it: ``CacheTrainer``
returns the loader from ``get_train_dataloader`` and records each batch's sample indices; ``mmapcache.hf.LoaderState``
saves the loader's ``state_dict()`` in each checkpoint (a file per rank) and loads it when a run resumes, with
``ignore_data_skip=True``."""

from __future__ import annotations

from typing import Any

import torch

from mmapcache import TextCollate


def indices(batch: dict[str, Any]) -> list[int]:
    """A ``helpers.text_sources.Tokenized`` batch's sample indices (token ``i * 1000 + position``)."""
    return [int(row[0]) // 1000 for row in batch["input_ids"]]


def train(transformers: Any, ds: Any, out: str, resume: str | None, seen: list[list[int]],
          batch_size: int = 8, ignore_data_skip: bool = True) -> list[float]:
    """Two epochs of a tiny BERT classifier over ``ds`` (a ``Tokenized`` cache) through ``ds.loader``, a checkpoint
    every 2 steps in ``out``, resumed from ``resume`` if given; appends each batch's indices to ``seen`` and returns
    the losses logged (a resumed run's begin with the checkpoint's)."""
    loader = ds.loader(batch_size=batch_size, shuffle=True, seed=42,
                       collate_fn=TextCollate(columns=["input_ids", "label"]))

    class CacheTrainer(transformers.Trainer):
        def get_train_dataloader(self) -> Any:
            return loader

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            seen.append(indices(inputs))
            return super().training_step(model, inputs, num_items_in_batch)

    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                     intermediate_size=16, vocab_size=len(ds) * 1000, num_labels=7)
    torch.manual_seed(0)
    args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=batch_size, num_train_epochs=2,
                                          report_to=[], use_cpu=True, save_steps=2, logging_steps=1,
                                          disable_tqdm=True, ignore_data_skip=ignore_data_skip)
    from mmapcache.hf import LoaderState

    trainer = CacheTrainer(model=transformers.BertForSequenceClassification(config), args=args, train_dataset=ds,
                           data_collator=loader.dataset.pad, callbacks=[LoaderState(loader)])
    trainer.train(resume_from_checkpoint=resume)
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]
