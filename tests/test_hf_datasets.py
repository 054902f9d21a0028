"""Real Hugging Face ``datasets``: a ``Dataset.from_dict`` with an image, a label, a string and a token column,
cached in its default (python lists), torch and numpy formats, with nothing changed in the dataset."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mmapcache import MmapCachedDataset, PadCollate

datasets = pytest.importorskip("datasets")  # in the test extra; skipped only where it cannot install

N = 24


def _hf() -> Any:
    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict({
        "image": [rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for _ in range(N)],
        "label": [i % 5 for i in range(N)],
        "caption": [f"a photo of {'ü' * (i % 4)} thing {i}" for i in range(N)],
        "input_ids": [list(range(i % 7 + 1)) for i in range(N)],
    })


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("fmt", [None, "torch", "numpy"])
def test_every_format_round_trips(cache_path: str, fmt: str | None) -> None:
    source = _hf() if fmt is None else _hf().with_format(fmt)
    ds = MmapCachedDataset(cache_path, source, ragged="auto")
    kinds = {f.name: (f.kind, f.ragged) for f in ds._store.layout.fields}
    assert kinds["caption"] == ("numpy_str" if fmt == "numpy" else "str", True)  # the numpy format gives np.str_
    assert kinds["input_ids"][1], kinds  # ragged: found by ragged="auto" (a python list: always)
    if fmt is None:
        assert kinds["image"] == ("pylist", False)  # one field, not 192 (8x8x3 numbers)
    for _ in range(2):  # misses, then hits
        for i in range(N):
            assert _same(ds[i], source[i]), (i, ds[i], source[i])
    batch = list(range(0, N, 2))
    assert all(_same(s, source[i]) for s, i in zip(ds.__getitems__(batch), batch))
    ds.close()


def test_torch_format_with_the_padding_collate(cache_path: str) -> None:
    source = _hf().with_format("torch")
    ds = MmapCachedDataset(cache_path, source, ragged=["input_ids"])
    batch = next(iter(ds.loader(batch_size=N, collate_fn=PadCollate(0, mask=True))))
    ids = batch["input_ids"]
    assert ids.data.shape == (N, 7) and ids.lengths.tolist() == [i % 7 + 1 for i in range(N)]
    assert batch["caption"] == [source[i]["caption"] for i in range(N)]
    assert batch["image"].dtype == torch.uint8 or batch["image"].dtype == torch.int64  # as the format gives it
    ds.close()


def test_a_classifier_trains_on_the_cache_as_on_the_tokenized_dataset(cache_path: str, tmp_path: Any) -> None:
    """The GLUE recipe: a ``datasets.map``-tokenized dataset (a sentence, a class ``label``, an ``idx``) trained and
    evaluated by ``Trainer`` with ``DataCollatorWithPadding``, and the same dataset cached, with ``TextCollate``: the
    same losses, step by step, and the same evaluation (the label comes back as ``labels``; the other columns reach
    the model's ``**kwargs`` only)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from mmapcache import TextCollate

    texts = [f"the film was {('good', 'bad')[i % 2]} and {('short', 'long', 'odd')[i % 3]} " * (1 + i % 4)
             for i in range(96)]
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=300, special_tokens=["<pad>"], show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>")
    raw = datasets.Dataset.from_dict({"sentence": texts, "label": [i % 2 for i in range(96)], "idx": list(range(96))})
    encoded = raw.map(lambda b: tokenizer(b["sentence"], truncation=True, max_length=48), batched=True)

    def run(train: Any, evaluate: Any, collator: Any, out: str) -> tuple[list[float], dict[str, float]]:
        config = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                         intermediate_size=32, vocab_size=len(tokenizer), num_labels=2,
                                         pad_token_id=tokenizer.pad_token_id, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(config)
        args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=8, num_train_epochs=2,
                                              report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
                                              learning_rate=5e-3, seed=3, dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluate,
                                       data_collator=collator)
        trainer.train()
        return [log["loss"] for log in trainer.state.log_history if "loss" in log], trainer.evaluate()

    theirs = run(encoded, encoded.select(range(32)), transformers.DataCollatorWithPadding(tokenizer),
                 str(tmp_path / "hf"))
    with MmapCachedDataset(cache_path, encoded.with_format("torch")) as ds, \
            MmapCachedDataset(cache_path + "-eval", encoded.select(range(32)).with_format("torch")) as held_out:
        ours = run(ds, held_out, TextCollate(pad=tokenizer.pad_token_id), str(tmp_path / "ours"))
    assert len(theirs[0]) == 24 and ours[0] == theirs[0]
    assert ours[1]["eval_loss"] == theirs[1]["eval_loss"]


def test_every_field_a_tokenizer_returns_is_padded_as_its_pad_pads_it(cache_path: str) -> None:
    """Sentence pairs tokenized with ``token_type_ids`` and ``special_tokens_mask``, and a pad id that is not 0:
    ``TextCollate(pad=pad_id)`` pads each field as ``DataCollatorWithPadding`` (the tokenizer's ``pad()``) does,
    over the samples and through ``ds.loader``: token types with 0 (a pad id there is a token type a model may not
    have), the special-tokens mask with 1."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from mmapcache import TextCollate

    texts = [f"a pair of {('short', 'longer and longer')[i % 2]} sentences, number {i}" for i in range(16)]
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=300, special_tokens=["<s>", "<pad>"], show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>")
    assert tokenizer.pad_token_id == 1
    encoded = datasets.Dataset.from_dict(tokenizer(texts[::2], texts[1::2], return_token_type_ids=True,
                                                   return_special_tokens_mask=True).data)
    samples = [encoded.with_format("torch")[i] for i in range(8)]
    assert {int(t) for s in samples for t in s["token_type_ids"]} == {0, 1}
    theirs = transformers.DataCollatorWithPadding(tokenizer, return_tensors="pt")(
        [encoded[i] for i in range(8)])
    collate = TextCollate(pad=tokenizer)  # (its pad id, as HF's collators take the tokenizer)
    with MmapCachedDataset(cache_path, encoded.with_format("torch")) as ds:
        for batch in (collate(samples), next(iter(ds.loader(batch_size=8, collate_fn=collate))),
                      next(iter(ds.loader(batch_size=8, collate_fn=collate)))):
            assert sorted(batch) == sorted(theirs)
            for key in theirs:
                assert torch.equal(batch[key], theirs[key]), key


def test_a_tokenizer_given_as_pad_must_have_a_pad_token_and_pad_on_the_right() -> None:
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from mmapcache import TextCollate

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(["some text to train on"] * 4, vocab_size=280, special_tokens=["<pad>"],
                            show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    with pytest.raises(ValueError, match="the tokenizer has no pad token; give it one"):
        TextCollate(pad=tokenizer)
    tokenizer.pad_token = "<pad>"
    assert TextCollate(pad=tokenizer).default_pad == tokenizer.pad_token_id == 0
    tokenizer.padding_side = "left"
    with pytest.raises(ValueError, match="pads on the left"):
        TextCollate(pad=tokenizer)
