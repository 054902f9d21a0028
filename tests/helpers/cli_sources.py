"""Factories used as ``tests/helpers/cli_sources.py:name`` dataset specs by the CLI and build tests."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
from torch.utils.data import Dataset

from helpers.sources import Counting, ImageLabels


def images(n: int = 64, log: str | None = None, delay: float = 0.0, shape: list[int] | None = None) -> Dataset:
    """``ImageLabels(n)``; with ``log``, every source call appends its index to that file."""
    source = ImageLabels(n, tuple(shape or (3, 8, 8)), delay)
    return Counting(source, log) if log else source


class Failing(Dataset):
    """``ImageLabels`` whose samples in ``bad`` raise ``ValueError``."""

    def __init__(self, n: int = 32, bad: list[int] | None = None) -> None:
        self.inner, self.bad = ImageLabels(n), set(bad or [])

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        if index in self.bad:
            raise ValueError(f"corrupt image file for sample {index}")
        return self.inner[index]


class NotFinite(Dataset):
    """``{"x": 6 float32 values, "i": index}``: sample ``k`` of ``nan`` holds a NaN, of ``inf`` an infinity."""

    def __init__(self, n: int = 32, nan: list[int] | None = None, inf: list[int] | None = None) -> None:
        self.n, self.nan, self.inf = n, set(nan or []), set(inf or [])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        x = torch.arange(6, dtype=torch.float32) + index
        if index in self.nan:
            x[2] = float("nan")
        if index in self.inf:
            x[5] = -float("inf")
        return {"x": x, "i": index}


class Drifting(Dataset):
    """Samples that change with a counter file: ``version`` is added to every label (to see refills)."""

    def __init__(self, n: int = 16, version_file: str = "") -> None:
        self.inner, self.version_file = ImageLabels(n), version_file

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        with open(self.version_file) as f:
            version = int(f.read() or 0)
        image, label = self.inner[index]
        return image, label + 100 * version


def not_a_dataset() -> int:
    return 42


def broken_factory() -> Dataset:
    raise RuntimeError("the data root /nonexistent does not exist")


def empty() -> list[Any]:
    return []




class Gated(Dataset):
    """Start barrier: each process's first sample announces itself (``waiting-<pid>`` next to ``gate``) and waits
    until the file ``gate`` exists (at most 60 s), so concurrent builds really overlap."""

    def __init__(self, inner: Dataset, gate: str) -> None:
        self.inner, self.gate, self.pid = inner, gate, -1

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        if self.pid != os.getpid():
            self.pid = os.getpid()
            open(os.path.join(os.path.dirname(self.gate), f"waiting-{self.pid}"), "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.01)
        return self.inner[index]


def gated(n: int, log: str, gate: str) -> Dataset:
    return Gated(images(n, log), gate)


class Noisy(Dataset):
    """``ImageLabels`` plus fresh random noise on every call (random augmentation: variants differ)."""

    def __init__(self, n: int = 16) -> None:
        self.inner = ImageLabels(n)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        image, label = self.inner[index]
        return image ^ torch.randint(0, 256, image.shape, dtype=torch.uint8), label


def noisy(n: int = 16) -> Dataset:
    return Noisy(n)


class Crashing(Dataset):
    """``ImageLabels`` whose sample ``crash_at`` (or each of a list) kills the process computing it: ``how="kill"``
    (SIGKILL, like the OOM killer) or ``"exit"`` (``os._exit(3)``, like a crash in native code)."""

    def __init__(self, n: int = 32, crash_at: int | list[int] = 10, how: str = "kill") -> None:
        self.inner, self.how = ImageLabels(n), how
        self.crash_at = {crash_at} if isinstance(crash_at, int) else set(crash_at)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        if index in self.crash_at:
            if self.how == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner[index]


class Ragged(Dataset):
    """Token sequences of varying length (``index % 7 + 1``): a variable-shape field."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> Any:
        return {"tokens": torch.arange(index % 7 + 1, dtype=torch.int32) + index, "label": index}
