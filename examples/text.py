"""A small language model trained on text a real tokenizer tokenizes once: the cache keeps the token ids.

The corpus is Python's own standard library (its ``.py`` files, cut at blank lines into documents of 3..80
lines): real text on every machine, nothing to download. A byte-level BPE tokenizer is trained on it (Hugging Face
``tokenizers``, a few seconds), and the source dataset tokenizes a document every time it is asked for one, as a
``datasets.map`` would once per run. The first epoch tokenizes every document and stores its ids; every later
epoch, and every later run, reads them from ``/dev/shm``.

    python examples/text.py                        # 3 epochs over 2,000 documents, padded batches
    python examples/text.py --flatten              # padding-free batches (position_ids, cu_seq_lens)

Padding-free batches pay off on a GPU with flash-attention's variable-length kernels; on a CPU (``sdpa``) the model
attends over the whole row under a mask per document, so the steps are slower there than padded ones grouped by
length (30 s against 5 s an epoch on the 2-core development machine). The model sees the same tokens either way;
its losses match where dropout is off (GPT-2's 0.1 draws its masks over other shapes in a flat row).

The cache stores the ids as int32 and the all-ones mask not at all (``store_as``), and hands back int64.
``TextCollate(columns=["input_ids"])`` makes the batch a GPT-2 takes as it is: ``input_ids`` padded with the pad
id, the mask padded with 0, causal-LM ``labels`` padded with -100, not the text (``flatten=True``: one row of tokens,
``position_ids`` restarting at each document, ``labels`` masked at each document's first token, the boundaries, and
``use_cache=False``, without which a model on ``sdpa`` attention lets each document attend to the ones before it).
``group_by_length`` batches documents of similar lengths. Each epoch prints the time spent waiting for batches
(tokenizing when cold) apart from the model's steps, and the loss. Needs ``transformers`` (``pip install
transformers``: it brings ``tokenizers``). The cache persists; remove it with ``mmapcache rm NAME``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import sysconfig
import time

import torch
from torch.utils.data import Dataset

import mmapcache
from mmapcache import MmapCachedDataset, TextCollate


def stdlib_documents(count: int) -> list[str]:
    """The first ``count`` documents of the standard library's sources: each file (sorted paths) cut at blank lines
    into runs of 3..80 lines."""
    root = sysconfig.get_paths()["stdlib"]
    documents: list[str] = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
                lines: list[str] = []
                for line in f:
                    lines.append(line)
                    if (not line.strip() and len(lines) >= 3) or len(lines) >= 80:
                        documents.append("".join(lines))
                        lines = []
                        if len(documents) == count:
                            return documents
    return documents


def train_tokenizer(documents: list[str], vocab: int):
    """A byte-level BPE tokenizer of ``vocab`` tokens trained on ``documents``, as a ``transformers`` fast tokenizer
    whose pad and end-of-text token is ``<|endoftext|>`` (GPT-2's)."""
    import tokenizers
    import transformers

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(documents, vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                                pad_token="<|endoftext|>")


class Tokenized(Dataset):
    """Document ``i`` tokenized on every access: ``{"input_ids", "attention_mask", "text"}``, as a tokenizer returns
    them (int64 tensors), truncated to ``max_length`` tokens."""

    def __init__(self, documents: list[str], tokenizer, max_length: int) -> None:
        self.documents, self.tokenizer, self.max_length = documents, tokenizer, max_length

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor | str]:
        text = self.documents[i]
        encoded = self.tokenizer(text, truncation=True, max_length=self.max_length, return_tensors="pt")
        return {"input_ids": encoded["input_ids"][0], "attention_mask": encoded["attention_mask"][0], "text": text}

    def fingerprint(self) -> str:
        """What the cached ids depend on: the documents, the tokenizer's vocabulary and the truncation."""
        digest = hashlib.sha256(str(self.max_length).encode())
        for document in self.documents:
            digest.update(document.encode())
        digest.update(self.tokenizer.backend_tokenizer.to_str().encode())
        return digest.hexdigest()[:16]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--vocab", type=int, default=2000, help="the tokenizer's vocabulary size")
    parser.add_argument("--max-length", type=int, default=256, help="tokens a document is truncated to")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--flatten", action="store_true", help="padding-free batches")
    parser.add_argument("--cache", default="text-example",
                        help="cache path, or a bare name under $MMAPCACHE_DIR (default /dev/shm/mmapcache)")
    args = parser.parse_args(argv)
    for name in ("documents", "vocab", "max_length", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("this example needs transformers: pip install transformers", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    documents = stdlib_documents(args.documents)
    started = time.perf_counter()
    tokenizer = train_tokenizer(documents, args.vocab)
    print(f"corpus: {len(documents)} documents of Python's standard library; a {len(tokenizer)}-token BPE "
          f"tokenizer trained in {time.perf_counter() - started:.1f} s")
    source = Tokenized(documents, tokenizer, args.max_length)
    ds = MmapCachedDataset(args.cache, source, fingerprint=source.fingerprint(),
                           store_as={"input_ids": "int32", "attention_mask": "ones"})
    already = ds.num_cached
    print(f"cache:  {ds.path} ({already} of {len(ds)} documents cached)")

    collate = TextCollate(pad=tokenizer.pad_token_id, labels="input_ids", columns=["input_ids"],
                          flatten=args.flatten)
    loader = ds.loader(batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                       group_by_length=None if already < len(ds) else "input_ids")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=len(tokenizer),
                                     n_positions=args.max_length, bos_token_id=tokenizer.eos_token_id,
                                     eos_token_id=tokenizer.eos_token_id)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    times = []
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        waited, steps, losses = 0.0, 0, []
        start = time.perf_counter()
        batches = iter(loader)
        while True:
            before = time.perf_counter()
            batch = next(batches, None)
            waited += time.perf_counter() - before
            if batch is None:
                break
            loss = model(**batch).loss  # (flattened: its use_cache=False makes sdpa attention keep to each document)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            losses.append(loss.item())
        times.append(waited)
        state = "warm" if epoch > 0 or already == len(ds) else "cold: tokenizing"
        print(f"epoch {epoch + 1}: data {waited:6.2f} s, {len(ds) / max(waited, 1e-9):9.0f} documents/s "
              f"({state}); {steps} steps in {time.perf_counter() - start:.1f} s, mean loss {sum(losses) / steps:.3f}")
        if epoch == 0 and already < len(ds):  # every length is known now: batch similar lengths from here on
            loader = ds.loader(batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                               group_by_length="input_ids")
    del loader

    lengths = ds.lengths("input_ids")
    used = {f["name"]: f["heap"]["used"] for f in mmapcache.describe(ds.path)["fields"] if f["heap"] is not None}
    print(f"\nsummary: {ds.num_cached} of {len(ds)} documents cached, {int(lengths.sum()):,} tokens (mean "
          f"{lengths.mean():.0f}): the ids in {used['input_ids'] / 2**10:.0f} KiB (int32; as int64 "
          f"{lengths.sum() * 8 / 2**10:.0f} KiB), the mask in {used['attention_mask']} B, the texts in "
          f"{used['text'] / 2**10:.0f} KiB")
    if len(times) > 1:
        warm = sum(times[1:]) / len(times[1:])
        print(f"waiting for data: first epoch {times[0]:.2f} s, later epochs {warm:.2f} s on average")
    print(f"run again to start warm; remove the cache with `mmapcache rm {ds.path}`")
    ds.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
