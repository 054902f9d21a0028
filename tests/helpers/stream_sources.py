"""Sources for stream tests: every computation of a sample is unique and self-checking.

``Fresh(n)[i]`` returns ``{"x": int64 tensor of 16 copies of a token, "i": i, "token": token}`` where the token is
random per call: a value served twice, or torn between two computations, shows (its tokens repeat, or ``x`` and
``token`` disagree). ``delay`` seconds of busy work per sample imitate an augmentation.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


class Fresh(Dataset):
    def __init__(self, n: int = 200, delay: float = 0.0, width: int = 16) -> None:
        self.n, self.delay, self.width = n, delay, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if self.delay:
            end = time.perf_counter() + self.delay
            while time.perf_counter() < end:
                pass
        token = int.from_bytes(os.urandom(7), "little")
        return {"x": torch.full((self.width,), token, dtype=torch.int64), "i": index, "token": token}


class Growing(Fresh):
    """``Fresh`` whose ``x`` grows with the index (``base + 37 * i`` elements): a ragged field whose values outgrow
    the extents of the rows they are written into."""

    def __init__(self, n: int = 32, base: int = 20_000) -> None:
        super().__init__(n)
        self.base = base

    def __getitem__(self, index: int) -> Any:
        token = int.from_bytes(os.urandom(7), "little")
        return {"x": torch.full((self.base + 37 * index,), token, dtype=torch.int64), "i": index, "token": token}


def fresh(n: int = 200, delay: float = 0.0) -> Dataset:
    return Fresh(n, delay)


class Refills(Dataset):
    """A cheap source that writes every sample into one buffer and returns a view of it (as some decoders do): a
    producer computes runs of many positions before it publishes them. Samples ``failing`` raise in every process
    but ``creator`` (the producers fail them; the reader that then computes them does not)."""

    def __init__(self, n: int, failing: set[int], creator: int) -> None:
        self.n, self.failing, self.creator = n, failing, creator
        self.buf = np.zeros(16, np.int64)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if index in self.failing and os.getpid() != self.creator:
            raise ValueError(f"sample {index} cannot be read in this process")
        self.buf[:] = index
        return {"x": self.buf, "i": index}


class RefillsRagged(Refills):
    """``Refills`` with ragged values: ``{"x": index % 7 + 1 int64 (a view of the one buffer, or with
    ``refill=False`` an array of its own), "text": the index written out index % 5 times, "i": index}``."""

    def __init__(self, n: int, failing: set[int], creator: int, refill: bool = True) -> None:
        super().__init__(n, failing, creator)
        self.refill = refill

    def __getitem__(self, index: int) -> Any:
        x = super().__getitem__(index)["x"][:index % 7 + 1]
        return {"x": x if self.refill else x.copy(), "text": f"{index};" * (index % 5), "i": index}


def intact(batch: dict[str, Any]) -> bool:
    """Every sample of a collated batch is one computation (``x`` holds its token)."""
    return bool((batch["x"] == batch["token"][:, None]).all())


class Augmented(Dataset):
    """An augmentation drawn from the global generators, as most pipelines draw it (``torch.rand``, numpy's
    ``np.random``, Python's ``random``): ``{"torch": (4,), "numpy": (4,), "python": (1,), "i": index}``."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        import random

        return {"torch": torch.rand(4, dtype=torch.float64), "numpy": torch.from_numpy(np.random.rand(4)),
                "python": torch.tensor([random.random()], dtype=torch.float64), "i": index}


class Captioned(Dataset):
    """Ragged values whose sizes change with every computation (a random crop's caption): ``{"text": 80..1600
    characters, "tok": 1..20 int64, "i": index}``, drawn from Python's ``random``."""

    def __init__(self, n: int = 120) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        import random

        words = 1 + int(random.random() * 20)
        return {"text": f"{index:>79};" * words, "tok": torch.full((words,), index, dtype=torch.int64), "i": index}


class Swelling(Captioned):
    """``Captioned`` whose first ``small`` computations in a process (the probes its stream is planned from) are of
    one word, and every later one of 10..20 words: a ring planned from the probes has room in its heaps for a
    fraction of the values its slots could hold. (A forked producer goes on counting from its parent's count.)"""

    def __init__(self, n: int = 120, small: int = 9) -> None:
        super().__init__(n)
        self.small, self.calls = small, 0

    def __getitem__(self, index: int) -> Any:
        import random

        self.calls += 1
        words = 1 if self.calls <= self.small else 10 + int(random.random() * 11)
        return {"text": f"{index:>79};" * words, "tok": torch.full((words,), index, dtype=torch.int64), "i": index}

