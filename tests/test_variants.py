"""Variants: K independently computed versions of each sample, chosen per epoch, in every kind of process."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from helpers.feature_workers import RandomAugment, read_calls
from helpers.sources import sample_equal
from mmapcache import CacheMismatchError, MmapCachedDataset

N, K = 12, 3


def _images(batches: Any) -> dict[int, torch.Tensor]:
    """``{index: image}`` from DataLoader batches of ``(images, indices)``."""
    out = {}
    for images, indices in batches:
        for image, index in zip(images, indices.tolist()):
            out[index] = image.clone()
    return out


def test_each_sample_has_k_distinct_versions_repeated_every_k_epochs(cache_path: str, tmp_path: Any) -> None:
    log = str(tmp_path / "calls")
    with MmapCachedDataset(cache_path, RandomAugment(N, log), variants=K) as ds:
        assert ds.variants == K and ds.num_cacheable == N
        seen: list[list[Any]] = []
        for epoch in range(2 * K):
            ds.set_epoch(epoch)
            assert ds.epoch == epoch
            if epoch % 2:
                seen.append(ds.__getitems__(list(range(N))))
            else:
                seen.append([ds[i] for i in range(N)])
        for i in range(N):
            versions = [seen[e][i][0] for e in range(K)]
            assert all(not torch.equal(versions[a], versions[b]) for a in range(K) for b in range(a + 1, K))
            for j in range(K):
                assert sample_equal(seen[K + j][i], seen[j][i])  # epoch K+j serves version j again
        calls = read_calls(log)
        # Exactly K source calls per sample over 2K epochs (the layout probe at creation was version 0 of 0).
        assert sorted(calls) == sorted(list(range(N)) * K)
        for epoch in range(K):  # num_cached counts samples whose variant for the current epoch is stored
            ds.set_epoch(epoch)
            assert ds.num_cached == N


def test_random_choice_is_seeded_per_sample_and_covers_versions(cache_path: str, tmp_path: Any) -> None:
    log = str(tmp_path / "calls")
    with MmapCachedDataset(cache_path, RandomAugment(N, log), variants=K, variant_choice="random", seed=3) as ds:
        rows = {e: [ds._rows.row(i, e) for i in range(N)] for e in range(8)}
        variants = {e: [r % K for r in rows[e]] for e in rows}
        # Per sample, not one version for everyone: some epoch serves different versions to different samples.
        assert any(len(set(v)) > 1 for v in variants.values())
        assert {v for vs in variants.values() for v in vs} == set(range(K))
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            first = [ds[i] for i in range(N)]
            assert all(sample_equal(a, b) for a, b in zip(first, ds.__getitems__(list(range(N)))))
        other = MmapCachedDataset(cache_path, RandomAugment(N), variant_choice="random", seed=3)
        assert [[other._rows.row(i, e) for i in range(N)] for e in range(8)] == [rows[e] for e in range(8)]
        other.close()
        # The batch path chooses exactly as the single-sample path does.
        idx = np.arange(N)
        assert all(ds._rows.rows_of(idx, e).tolist() == rows[e] for e in range(8))


def _epoch_images(loader: DataLoader, ds: MmapCachedDataset, epochs: list[int]) -> dict[int, dict[int, torch.Tensor]]:
    out = {}
    for epoch in epochs:
        ds.set_epoch(epoch)
        out[epoch] = _images(loader)
    return out


def _check_versions(per_epoch: dict[int, dict[int, torch.Tensor]], log: str) -> None:
    """Epochs with the same ``epoch % K`` got the same version of every sample, others different ones, and the
    source computed each sample once per version used."""
    epochs = list(per_epoch)
    for i in range(N):
        for a in epochs:
            for b in epochs:
                if a < b:
                    assert torch.equal(per_epoch[a][i], per_epoch[b][i]) == (a % K == b % K), (i, a, b)
    assert sorted(read_calls(log)) == sorted(list(range(N)) * len({e % K for e in epochs}))


# Spawned workers start a fresh interpreter per epoch (seconds each here): fewer epochs, one worker.
@pytest.mark.parametrize("start, workers, epochs", [("fork", 2, [0, 1, 2, 3, 4, 5]), ("spawn", 1, [0, 1, K + 1])])
def test_non_persistent_dataloader_workers_see_the_epoch(cache_path: str, tmp_path: Any, start: str, workers: int,
                                                         epochs: list[int]) -> None:
    log = str(tmp_path / "calls")
    with MmapCachedDataset(cache_path, RandomAugment(N, log), variants=K) as ds:
        loader = DataLoader(ds, batch_size=4, num_workers=workers, multiprocessing_context=start, timeout=120)
        _check_versions(_epoch_images(loader, ds, epochs), log)


def test_loader_with_persistent_workers_sees_the_epoch_change(cache_path: str, tmp_path: Any) -> None:
    log = str(tmp_path / "calls")
    with MmapCachedDataset(cache_path, RandomAugment(N, log), variants=K) as ds:
        loader = ds.loader(batch_size=4, num_workers=2, persistent_workers=True, shuffle=True,
                           multiprocessing_context="spawn", timeout=120)
        per_epoch = _epoch_images(loader, ds, list(range(2 * K)))
        _check_versions(per_epoch, log)
        # And the same versions as the main process reads for those epochs.
        for epoch in range(K):
            ds.set_epoch(epoch)
            assert all(torch.equal(ds[i][0], per_epoch[epoch][i]) for i in range(N))


def test_variants_are_recorded_and_checked_on_reopen(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, RandomAugment(N), variants=K):
        pass
    with MmapCachedDataset(cache_path, RandomAugment(N)) as ds:
        assert ds.variants == K  # the recorded number when none is given
    with MmapCachedDataset(cache_path) as ds:
        assert ds.variants == K
    with pytest.raises(CacheMismatchError, match=f"variants={K} in the cache, variants=2 given"):
        MmapCachedDataset(cache_path, RandomAugment(N), variants=2)
    with MmapCachedDataset(cache_path, RandomAugment(N), variants=2, overwrite=True) as ds:
        assert ds.variants == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_bad_variants_are_rejected(cache_path: str, bad: Any) -> None:
    with pytest.raises(ValueError, match="variants must be an integer >= 1"):
        MmapCachedDataset(cache_path, RandomAugment(N), variants=bad)


def test_bad_variant_choice_is_rejected(cache_path: str) -> None:
    with pytest.raises(ValueError, match="variant_choice must be one of 'epoch', 'random'"):
        MmapCachedDataset(cache_path, RandomAugment(N), variants=2, variant_choice="round-robin")


class _Identity:
    """A transform that changes nothing (module level: spawned workers import it); it sends ``ds.loader`` down its
    fallback path, a plain DataLoader over the dataset."""

    def __call__(self, sample: Any) -> Any:
        return sample


@pytest.mark.parametrize("start", ["fork", "spawn"])
@pytest.mark.parametrize("how", ["plain", "loader-transform", "loader-collate"])
def test_persistent_workers_see_set_epoch_in_every_configuration(cache_path: str, tmp_path: Any, start: str,
                                                                  how: str) -> None:
    """set_epoch reaches persistent workers of a plain DataLoader, and of ds.loader with transform= or collate_fn=
    (which fall back to a plain DataLoader): every copy of the dataset reads one shared epoch cell."""
    log = str(tmp_path / "calls")
    transform = _Identity() if how == "loader-transform" else None
    with MmapCachedDataset(cache_path, RandomAugment(N, log), variants=K, transform=transform) as ds:
        ds.fill()  # every version stored first, so the workers only read
        for epoch in range(1, K):
            ds.set_epoch(epoch)
            ds.fill()
        kwargs: dict[str, Any] = {"batch_size": 4, "num_workers": 1, "persistent_workers": True,
                                      "multiprocessing_context": start, "timeout": 120}
        if how == "plain":
            loader = DataLoader(ds, **kwargs)
        elif how == "loader-collate":
            loader = ds.loader(collate_fn=torch.utils.data.default_collate, **kwargs)
        else:
            loader = ds.loader(**kwargs)
        epochs = [0, 1, K, K + 1]
        per_epoch = _epoch_images(loader, ds, epochs)
        for epoch in epochs:
            ds.set_epoch(epoch)
            assert all(torch.equal(ds[i][0], per_epoch[epoch][i]) for i in range(N)), (epoch, how, start)
        assert not all(torch.equal(per_epoch[0][i], per_epoch[1][i]) for i in range(N))  # versions do differ
