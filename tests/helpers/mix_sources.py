"""Sources for the mixture tests: every sample says which source and index it is (``id = tag * 1000 + i``), in every
field, so a batch read from a mixture is checked against its sources value by value."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import Dataset

STRIDE = 1000  # ids: tag * STRIDE + index


class Rows(Dataset):
    """``(4 floats, label)``, both the sample's id."""

    def __init__(self, n: int, tag: int, width: int = 4) -> None:
        self.n, self.tag, self.width = n, tag, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        ident = self.tag * STRIDE + i
        return torch.full((self.width,), float(ident)), ident


class Texts(Dataset):
    """``{"input_ids": int64 of 1 + (i * 7) % lengths tokens, "label": int}``, all the sample's id."""

    def __init__(self, n: int, tag: int, lengths: int = 13) -> None:
        self.n, self.tag, self.lengths = n, tag, lengths

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        ident = self.tag * STRIDE + i
        return {"input_ids": torch.full((1 + (i * 7) % self.lengths,), ident, dtype=torch.int64), "label": ident}


def ids_of(batch: Any) -> list[int]:
    """The ids of a batch of ``Rows`` (a tuple) or ``Texts`` (a dict)."""
    labels = batch["label"] if isinstance(batch, dict) else batch[1]
    return labels.tolist()


def rows_intact(batch: Any) -> bool:
    """Whether every field of a ``Rows`` batch holds its sample's id."""
    x, labels = batch
    return bool((x == labels[:, None].to(x.dtype)).all())


# The mixture jobs' caches (test_mixture_jobs.py: torchrun and Lightning jobs), by name: (samples, tag). Sizes that no
# batch or job size divides; tags 1 to 3 in name order, so a sample's source number is its tag - 1. Their weights: an
# epoch of 50 holds 25/15/10 (c, of 7 samples, repeats), one of 90 45/27/18 (all three repeat).
JOB_SOURCES = {"a": (40, 1), "b": (23, 2), "c": (7, 3)}
JOB_WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}


def job_caches(directory: str = "") -> dict[str, Any]:
    """The jobs' three caches of ``Rows`` by name, at ``directory/mix-<name>`` (default: bare names, under
    ``$MMAPCACHE_DIR``): each process of a job opens them, and the first to open one creates it."""
    from mmapcache import MmapCachedDataset

    return {name: MmapCachedDataset(os.path.join(directory, f"mix-{name}"), Rows(n, tag), fingerprint=f"rows-{name}")
            for name, (n, tag) in JOB_SOURCES.items()}


def job_mixture(directory: str = "", *, epoch_size: int, seed: int, **kwargs: Any) -> Any:
    """A ``Mixture`` of the job caches (``job_caches(directory)``) with ``JOB_WEIGHTS``."""
    from mmapcache import Mixture

    return Mixture(job_caches(directory), weights=JOB_WEIGHTS, epoch_size=epoch_size, seed=seed, **kwargs)


def sources_agree(labels: torch.Tensor, sources: torch.Tensor) -> bool:
    """Whether ``return_source``'s source numbers are those of the ids' tags (the job caches: tag = number + 1)."""
    return bool(torch.equal(sources, labels // STRIDE - 1))
