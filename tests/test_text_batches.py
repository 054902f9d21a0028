"""``TextCollate``: batches a model takes as they come, padded or padding-free, equal to the source's values whatever
path made them (straight from the heaps of a warm cache, from a checked gather of a cold or partial one, from the
samples of any dataset), under workers, ranks, streams, mixtures and a resume at every step; and taken as they come
by a Hugging Face model and its ``Trainer``."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from helpers.text_sources import Tokenized, expected_padded, same
from mmapcache import Mixture, MmapCachedDataset, TextCollate

N = 37


def _samples(source: Any, indices: list[int]) -> list[dict[str, Any]]:
    return [source[i] for i in indices]


def _indices(batch: dict[str, Any]) -> list[int]:
    return [int(row[0]) // 1000 for row in batch["input_ids"]]


@pytest.mark.parametrize("state", ["warm", "cold", "partial"])
@pytest.mark.parametrize("workers", [0, 2])
def test_padded_batches_equal_the_source_whatever_path_made_them(cache_path: str, state: str, workers: int) -> None:
    """Warm: copied from the heaps; cold: computed, stored and gathered with checks; partial (max_bytes): the
    uncached samples from the source: every batch is the plain padding of the source's samples, in order."""
    source = Tokenized(N)
    ds = MmapCachedDataset(cache_path, source, max_bytes=6000 if state == "partial" else None)
    if state == "warm":
        ds.fill()
    collate = TextCollate({"input_ids": 0})
    seen = []
    for batch in ds.loader(batch_size=8, shuffle=True, collate_fn=collate, num_workers=workers):
        indices = _indices(batch)
        assert same(batch, expected_padded(_samples(source, indices))), indices
        seen += indices
    assert sorted(seen) == list(range(N))
    ds.close()


def test_a_collate_over_any_dataset_gives_the_same_batches(cache_path: str) -> None:
    source = Tokenized(N)
    collate = TextCollate({"input_ids": 0})
    plain = torch.utils.data.DataLoader(source, batch_size=8, collate_fn=collate)
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        cached = ds.loader(batch_size=8, collate_fn=collate)
        for a, b in zip(plain, cached):
            assert same(a, b)
        for a, b in zip(plain, torch.utils.data.DataLoader(ds, batch_size=8, collate_fn=collate)):
            assert same(a, b)


def test_pad_values_labels_and_a_multiple(cache_path: str) -> None:
    source = Tokenized(N, mask=False)
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        collate = TextCollate({"input_ids": 7}, labels="input_ids", pad_to_multiple_of=8)
        for batch in ds.loader(batch_size=5, collate_fn=collate):
            samples = _samples(source, _indices(batch))
            expected = expected_padded(samples, pad=7, labels=True)
            width = batch["input_ids"].shape[1]
            assert width % 8 == 0 and width - expected["input_ids"].shape[1] < 8
            for key in ("input_ids", "attention_mask", "labels"):
                cut = batch[key][:, :expected[key].shape[1]]
                assert torch.equal(cut, expected[key]), key
                assert bool((batch[key][:, expected[key].shape[1]:] == {"input_ids": 7, "attention_mask": 0,
                                                                          "labels": -100}[key]).all())


def test_a_stored_mask_is_built_not_read_and_can_be_padded_instead(cache_path: str) -> None:
    """The stored all-ones mask is not read (the batch's is built from input_ids' lengths); with
    attention_mask=None it is padded as stored, with 0."""
    source = Tokenized(N)
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        built = next(iter(ds.loader(batch_size=9, collate_fn=TextCollate())))
        stored = next(iter(ds.loader(batch_size=9, collate_fn=TextCollate(attention_mask=None))))
        assert torch.equal(built["attention_mask"], stored["attention_mask"])
        assert torch.equal(built["input_ids"], stored["input_ids"])


def test_flattened_batches_match_hugging_faces_flattening_collator(cache_path: str) -> None:
    transformers = pytest.importorskip("transformers")
    source = Tokenized(N, mask=False)
    reference = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        for workers in (0, 2):
            loader = ds.loader(batch_size=6, shuffle=True, num_workers=workers,
                               collate_fn=TextCollate(flatten=True, labels="input_ids", fields=["input_ids"]))
            for batch in loader:
                indices = [int(i) for i in torch.unique_consecutive(batch["input_ids"][0] // 1000)]
                theirs = reference([{"input_ids": source[i]["input_ids"].tolist()} for i in indices])
                for key, value in theirs.items():
                    assert (torch.equal(batch[key], value) if isinstance(value, torch.Tensor) else
                            batch[key] == value), key
                assert batch["text"] == [source[i]["text"] for i in indices]
                assert torch.equal(batch["label"], torch.tensor([source[i]["label"] for i in indices]))


def test_ranks_and_a_resume_at_every_step_serve_the_sources_values(cache_path: str) -> None:
    source = Tokenized(N)
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        collate = TextCollate()
        for rank in range(2):
            loader = ds.loader(batch_size=4, shuffle=True, rank=rank, world_size=2, collate_fn=collate)
            full = [_indices(b) for b in loader]
            for k in range(len(full) + 1):
                ds.set_epoch(0)  # the same epoch again (DistributedSampler's order of (seed, epoch))
                it = iter(loader)
                for _ in range(k):
                    next(it)
                state = loader.state_dict()
                again = ds.loader(batch_size=4, shuffle=True, rank=rank, world_size=2, collate_fn=collate)
                again.load_state_dict(state)
                rest = list(again)
                assert [_indices(b) for b in rest] == full[k:]
                assert all(same(b, expected_padded(_samples(source, _indices(b)))) for b in rest)


def test_a_mixture_and_a_stream_pad_as_a_cache_does(shm_dir: str) -> None:
    from helpers.stream_sources import Fresh

    sources = {name: Tokenized(20 + 5 * k, seed=k) for k, name in enumerate(("a", "b"))}
    caches = {name: MmapCachedDataset(os.path.join(shm_dir, name), src) for name, src in sources.items()}
    mix = Mixture(caches, seed=1)
    for batch, which in mix.loader(batch_size=6, collate_fn=TextCollate(), return_source=True):
        samples = [sources[mix.names[s]][i] for s, i in zip(which.tolist(), _indices(batch))]
        assert same(batch, expected_padded(samples))

    class Tokens(Fresh):
        def __getitem__(self, index: int) -> Any:
            sample = super().__getitem__(index)
            return {"input_ids": torch.arange(1 + index % 9), "token": sample["token"]}

    with MmapCachedDataset(os.path.join(shm_dir, "stream"), Tokens(40), stream=True, seed=3) as stream:
        for batch in stream.loader(batch_size=5, collate_fn=TextCollate(fields=["input_ids"])):
            lengths = batch["attention_mask"].sum(1)
            for row, length in zip(batch["input_ids"], lengths.tolist()):
                assert torch.equal(row[:length], torch.arange(length)) and not row[length:].any()


def test_bad_arguments_are_refused_naming_the_fix(cache_path: str) -> None:
    with pytest.raises(TypeError, match="pad must be an int or a dict"):
        TextCollate("zero")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"fields must be a list of field names, got the str 'input_ids'"):
        TextCollate(fields="input_ids")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pad_to_multiple_of must be an int >= 1"):
        TextCollate(pad_to_multiple_of=0)
    with MmapCachedDataset(cache_path, Tokenized(N)) as ds:
        with pytest.raises(ValueError, match=r"TextCollate names \['input_idz'\], which the samples do not have"):
            ds.loader(batch_size=4, collate_fn=TextCollate({"input_idz": 0}))
        with pytest.raises(ValueError, match=r"labels='text'\) must name a padded field"):
            next(iter(ds.loader(batch_size=4, collate_fn=TextCollate(labels="text"))))
    with pytest.raises(TypeError, match="takes samples that are dicts"):
        TextCollate()([(torch.arange(3), 1)])


# --- a real model ---------------------------------------------------------------------------------------------------


def _tiny_model(transformers: Any) -> Any:
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=128,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class _Ids(torch.utils.data.Dataset):
    """Token ids a 64-word model can take: ``input_ids`` of 3..40 tokens below 64, a ``text``."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = 3 + (i * 7) % 38
        return {"input_ids": (torch.arange(n) * (i + 1)) % 64, "text": f"sample {i}"}


def test_a_model_takes_the_batches_as_they_come(cache_path: str) -> None:
    transformers = pytest.importorskip("transformers")
    model = _tiny_model(transformers)
    with MmapCachedDataset(cache_path, _Ids()) as ds:
        ds.fill()
        loader = ds.loader(batch_size=8, collate_fn=TextCollate(labels="input_ids", fields=["input_ids"]))
        for batch in loader:
            text = batch.pop("text")
            assert len(text) == 8
            out = model(**batch)
            assert torch.isfinite(out.loss)
        flat = ds.loader(batch_size=8, collate_fn=TextCollate(labels="input_ids", flatten=True,
                                                              fields=["input_ids"]))
        batch = next(iter(flat))
        batch.pop("text")
        kwargs = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
        assert torch.isfinite(model(**kwargs).loss)  # (flash-attention's varlen kernels take the cu_seq_lens too)


def test_hugging_faces_trainer_trains_on_the_cache_with_the_collate(cache_path: str, tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    model = _tiny_model(transformers)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 48

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": _Ids()[i]["input_ids"]}

    with MmapCachedDataset(cache_path, Tokens()) as ds:
        args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                              max_steps=6, learning_rate=1e-2, report_to=[], use_cpu=True,
                                              logging_steps=1, save_strategy="no", dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                       data_collator=TextCollate(labels="input_ids"))
        result = trainer.train()
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        assert result.global_step == 6 and len(losses) == 6 and all(np.isfinite(losses))
        assert losses[-1] < losses[0]
