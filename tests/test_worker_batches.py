"""A DataLoader worker's batch crosses to the main process as one shared-memory storage (``read.arena``).

Each storage a worker sends costs a file descriptor passed over a socket; shared memory is reserved whole when it
is made, so the one storage must be as large as the batch (or, reused from the worker's pool, a quarter more than
the largest batch before it), not larger. Small tensors (labels, lengths) are copied out on arrival, so that one
kept after its batch does not keep the batch's memory. Every batch must equal the one the same loader makes without
workers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import default_collate

from helpers.sources import ImageLabels, sample_equal
from helpers.text_sources import Tokenized
from mmapcache import Mixture, MmapCachedDataset, PadCollate, TextCollate
from mmapcache.format.batch import arrays_of

_SMALL = 64 << 10  # (read.arena's: smaller tensors are copied out on arrival)


def _tensors(batch: Any) -> list[torch.Tensor]:
    return [t for t in arrays_of(batch) if isinstance(t, torch.Tensor)]


def _stacked(samples: list[Any]) -> Any:
    return default_collate(samples)


def _check(with_workers: Any, without: Any) -> int:
    """Compares every batch; returns how many crossed as one storage."""
    one = batches = largest = 0
    without.sampler.set_epoch(0)
    expected_batches = list(without)
    with_workers.sampler.set_epoch(0)
    for batch, expected in zip(with_workers, expected_batches, strict=True):
        batches += 1
        assert sample_equal(batch, expected)
        tensors = _tensors(batch)
        big = [t for t in tensors if t.nbytes > _SMALL]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in big}
        for t in tensors:
            if t.nbytes <= _SMALL:  # copied out: holding it holds none of the big tensors' memory
                assert t.untyped_storage().data_ptr() not in storages, t.shape
        if len(storages) <= 1:  # (a batch of small tensors only: each copied out)
            one += 1
            # Made to the batch's size (shared memory is reserved whole), or, reused from the worker's pool
            # (read.lending), to a quarter more than the largest batch before it: its tensors and the small ones'.
            largest = max(largest, sum(-(-t.nbytes // 64) * 64 for t in big) + _SMALL)
            size = sum(storages.values())
            assert size <= largest * 5 // 4 + _SMALL, (size, [t.shape for t in big])
    assert batches
    return batches if one == batches else one


@pytest.mark.parametrize("form", ["padded", "flat", "pad_collate", "images", "samples"])
def test_a_workers_batch_crosses_as_one_storage_and_equals_the_batch_read_here(cache_path: str, form: str) -> None:
    if form in ("images", "samples"):
        ds = MmapCachedDataset(cache_path, ImageLabels(44, shape=(3, 64, 64)))  # 12 KB a sample; a short last batch
        kwargs: dict[str, Any] = {"collate_fn": _stacked} if form == "samples" else {}
        batch = 12
    else:
        ds = MmapCachedDataset(cache_path, Tokenized(44, longest=4000))  # (the last batch short)
        collate = {"padded": TextCollate(0, labels="input_ids"), "flat": TextCollate(0, flatten=True,
                   labels="input_ids"), "pad_collate": PadCollate(0, mask=True)}[form]
        kwargs = {"collate_fn": collate}
        batch = 8
    ds.fill()
    loaders = [ds.loader(batch_size=batch, shuffle=True, seed=3, num_workers=w, **kwargs) for w in (2, 0)]
    whole = _check(*loaders)
    assert whole == len(loaders[0]), f"{whole} of {len(loaders[0])} batches crossed as one storage"
    if form == "flat":  # one tensor in two places (as Hugging Face's collator gives it) stays one
        batch = next(iter(loaders[0]))
        assert batch["cu_seq_lens_q"] is batch["cu_seq_lens_k"]
    ds.close()


def test_a_mixtures_worker_batch_crosses_as_one_storage(cache_path: str) -> None:
    sources = [MmapCachedDataset(f"{cache_path}-{k}", Tokenized(23, longest=4000, seed=k)) for k in range(2)]
    for ds in sources:
        ds.fill()
    mix = Mixture(sources, seed=1)
    loaders = [mix.loader(batch_size=8, collate_fn=TextCollate(0), num_workers=w) for w in (2, 0)]
    assert _check(*loaders) == len(loaders[0])
    for ds in sources:
        ds.close()


def test_a_label_kept_after_its_batch_holds_only_itself(cache_path: str) -> None:
    """Labels gathered over an epoch (for metrics) must not keep every batch's images alive."""
    ds = MmapCachedDataset(cache_path, ImageLabels(32, shape=(3, 64, 64)))
    ds.fill()
    kept = [labels for _, labels in ds.loader(batch_size=8, num_workers=2)]
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in kept)
    assert torch.equal(torch.cat(kept), torch.tensor([i * 7 % 10 for i in range(32)]))
    ds.close()


def test_a_small_view_copied_out_on_arrival_keeps_what_it_was() -> None:
    """The main process copies each small view of a worker's storage out (``arena.detach_small``): the copy must be
    what arrived, a leaf that requires grad included (a worker's carved tensor arrives as one), not a clone in a
    graph."""
    from mmapcache.read import arena

    big = torch.zeros(1 << 16)  # (the storage a worker's batch was carved from)
    weights = big[8:16].requires_grad_()
    twice = arena.detach_small({"weights": weights, "again": weights, "label": big[:4].to(torch.int64)})
    copy = twice["weights"]
    assert copy is twice["again"] and copy.untyped_storage().nbytes() == copy.nbytes
    assert copy.is_leaf and copy.requires_grad and copy.grad_fn is None
    assert torch.equal(copy.detach(), weights.detach())
