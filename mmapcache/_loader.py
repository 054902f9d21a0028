"""``ds.loader()``: a DataLoader whose batches are gathered straight into their final, collated tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler

if TYPE_CHECKING:
    from .dataset import MmapCachedDataset

# DataLoader arguments that describe batching; the rest pass through unchanged.
_BATCHING = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "generator")


def make_loader(ds: MmapCachedDataset, **kwargs: Any) -> DataLoader:
    reader = ds._ensure_open()
    if kwargs.get("collate_fn") is not None or ds.transform is not None or reader.variable:
        return DataLoader(ds, **kwargs)
    batch_size = kwargs.pop("batch_size", 1)
    shuffle = kwargs.pop("shuffle", False)
    sampler = kwargs.pop("sampler", None)
    batch_sampler = kwargs.pop("batch_sampler", None)
    drop_last = kwargs.pop("drop_last", False)
    generator = kwargs.pop("generator", None)
    kwargs.pop("collate_fn", None)
    if batch_sampler is None:
        if batch_size is None:
            return DataLoader(ds, batch_size=None, shuffle=shuffle, sampler=sampler, generator=generator, **kwargs)
        if sampler is None:
            sampler = RandomSampler(ds, generator=generator) if shuffle else SequentialSampler(ds)
        elif shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if type(sampler) in (RandomSampler, SequentialSampler):
            batch_sampler = _ArrayBatches(sampler, batch_size, drop_last)
        else:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
    elif batch_size != 1 or shuffle or sampler is not None or drop_last:
        raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last")
    # The generator also goes to the outer DataLoader: it draws the workers' base seed from it before the sampler
    # draws the permutation, exactly as DataLoader(ds, generator=...) does, so both shuffle alike.
    return DataLoader(
        _Batches(ds), batch_size=None, sampler=_EpochBatches(batch_sampler, ds), collate_fn=_identity,
        generator=generator, **kwargs
    )


def _identity(batch: Any) -> Any:
    return batch


class _ArrayBatches(BatchSampler):
    """``BatchSampler`` over torch's own finite samplers, yielding numpy arrays: the epoch's indices are drawn in
    one C loop (``numpy.fromiter``) instead of one Python ``next`` per index, in exactly the order (and with the
    same random draws) that ``BatchSampler(sampler, ...)`` would produce."""

    def __iter__(self) -> Iterator[np.ndarray]:  # type: ignore[override]
        count = len(self.sampler)
        indices = np.fromiter(iter(self.sampler), np.int64, count=count)
        size = self.batch_size
        stop = count - count % size if self.drop_last else count
        for start in range(0, stop, size):
            yield indices[start:start + size]


class _EpochBatches(Sampler):
    """Yields ``(epoch, indices)``: the epoch is read in the main process when iteration starts, so the variant
    choice reaches persistent workers too."""

    def __init__(self, batch_sampler: Any, ds: MmapCachedDataset) -> None:
        self.batch_sampler = batch_sampler
        self.ds = ds

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        epoch = self.ds.epoch
        for batch in self.batch_sampler:
            yield epoch, batch

    def __len__(self) -> int:
        return len(self.batch_sampler)


class _Batches(Dataset):
    """Maps ``(epoch, indices)`` to the collated batch."""

    def __init__(self, ds: MmapCachedDataset) -> None:
        self.ds = ds

    def __getitem__(self, key: tuple[int, list[int]]) -> Any:
        epoch, indices = key
        ds = self.ds
        reader = ds._ensure_open()
        in_worker = torch.utils.data.get_worker_info() is not None
        columns = ds._gather(ds._indices(indices), epoch, _alloc_shared if in_worker else np.empty)
        return reader.collate(columns)

    def __len__(self) -> int:
        return len(self.ds)


def _alloc_shared(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A numpy array over a fresh shared-memory tensor storage: a worker's batch then crosses to the main process
    without the copy that sending an ordinary tensor costs (torch's default collate does the same)."""
    tensor = torch.from_numpy(np.empty(0, dtype))
    count = int(np.prod(shape, dtype=np.int64))
    storage = tensor.untyped_storage()._new_shared(count * dtype.itemsize)  # noqa: SLF001 - as torch's collate does
    return tensor.new(storage).view(-1)[:count].view(shape).numpy() if count else np.empty(shape, dtype)
