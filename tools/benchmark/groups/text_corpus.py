"""The text group's corpus (issue 40): HF-shaped samples written to ``/dev/shm``, the sources that read them back
(importable by build workers: ``benchmark.groups.text_corpus:cpu_text``), and the collate LLM users write.

A sample is ``{"input_ids", "attention_mask", "text", "label"}``: int64 token ids of 16..2048 tokens (lognormal,
mean 298), a mask of ones as long, a str of 4 characters a token, an int label.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from benchmark.sources import spin

TEXT_N, TEXT_QUICK_N = 50000, 1000
LENGTHS = (16, 2048)
LOGNORMAL = (5.222, 1.0)  # mu, sigma: a mean of 298 tokens once clipped to LENGTHS
CHARS_PER_TOKEN = 4
VOCAB = 50257
SOURCE_DELAY = 20e-6
SEED = 40  # the corpus's, and every side's shuffle


@dataclass(frozen=True)
class Corpus:
    """The samples, back to back: token ids and mask values (int64) with their ``offsets`` (n + 1), the texts' UTF-8
    bytes with theirs, and the labels. ``paths`` holds the same arrays as ``.npy`` files (for other processes)."""

    ids: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    text: np.ndarray
    text_offsets: np.ndarray
    labels: np.ndarray
    paths: dict[str, str]

    @property
    def n(self) -> int:
        return len(self.labels)

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    def sample(self, i: int) -> dict[str, Any]:
        """Sample ``i`` as the source gives it: private tensors, a str and an int."""
        s, e = int(self.offsets[i]), int(self.offsets[i + 1])
        return {"input_ids": torch.from_numpy(self.ids[s:e].copy()),
                "attention_mask": torch.from_numpy(self.mask[s:e].copy()),
                "text": self.text[int(self.text_offsets[i]):int(self.text_offsets[i + 1])].tobytes().decode(),
                "label": int(self.labels[i])}


def write_corpus(directory: str, n: int) -> Corpus:
    rng = np.random.default_rng(SEED)
    lengths = np.clip(np.rint(rng.lognormal(*LOGNORMAL, n)), *LENGTHS).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz    ", np.uint8)
    arrays = {"ids": rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int64),
              "mask": np.ones(int(offsets[-1]), np.int64), "offsets": offsets,
              "text": alphabet[rng.integers(0, len(alphabet), int(offsets[-1]) * CHARS_PER_TOKEN)],
              "text_offsets": offsets * CHARS_PER_TOKEN, "labels": rng.integers(0, 10, n, dtype=np.int64)}
    paths = {}
    for name, array in arrays.items():
        paths[name] = os.path.join(directory, f"{name}.npy")
        np.save(paths[name], array)
    return Corpus(**arrays, paths=paths)


def open_corpus(paths: dict[str, str]) -> Corpus:
    return Corpus(**{name: np.load(path, mmap_mode="r") for name, path in paths.items()}, paths=dict(paths))


class TextSource(Dataset):
    """The corpus as a map-style source: ``delay`` seconds of busy CPU a sample (a stand-in for tokenizing)."""

    def __init__(self, paths: dict[str, str], delay: float = SOURCE_DELAY, n: int | None = None) -> None:
        self.paths, self.delay = dict(paths), delay
        self.n = n if n is not None else int(np.load(paths["labels"], mmap_mode="r").shape[0])
        self._corpus: Corpus | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._corpus is None:
            self._corpus = open_corpus(self.paths)
        if self.delay:
            spin(self.delay)
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for {self.n} samples")
        return self._corpus.sample(i)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_corpus": None}


class CpuText(TextSource):
    """A CPU-bound text source: it tokenizes its text in Python (an FNV-1a hash of each 4-character piece, a few
    microseconds a token, holding the GIL as a Python tokenizer does). The build benchmark's source."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = super().__getitem__(i)
        text = sample["text"]
        ids = []
        for k in range(0, len(text), CHARS_PER_TOKEN):
            h = 0x811C9DC5
            for ch in text[k:k + CHARS_PER_TOKEN]:
                h = ((h ^ ord(ch)) * 0x01000193) & 0xFFFFFFFF
            ids.append(h % VOCAB)
        sample["input_ids"] = torch.tensor(ids, dtype=torch.int64)
        return sample


def cpu_text(paths: dict[str, str], n: int) -> CpuText:
    """The build's dataset spec (``benchmark.groups.text_corpus:cpu_text``)."""
    return CpuText(paths, delay=0.0, n=n)


def pad_collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """What users write: each ragged field padded with ``pad_sequence``, the labels stacked, the texts listed."""
    return {"input_ids": pad_sequence([s["input_ids"] for s in batch], batch_first=True, padding_value=0),
            "attention_mask": pad_sequence([s["attention_mask"] for s in batch], batch_first=True, padding_value=0),
            "labels": torch.tensor([s["label"] for s in batch]), "text": [s["text"] for s in batch]}
