"""The basic contract: miss then hit, types preserved, a second process reads by path."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers.sources import Counting, ImageLabels, sample_equal
from mmapcache import MmapCachedDataset, SampleNotCachedError


def test_miss_then_hit_does_not_call_source_again(cache_path: str, tmp_path) -> None:
    source = Counting(ImageLabels(16), str(tmp_path / "calls"))
    with MmapCachedDataset(cache_path, source) as ds:
        stored = ds.num_cached  # sample 0 and the layout probes, stored by the creator
        assert not ds.is_cached(3)
        first = ds[3]
        calls = len(source.calls())
        second = ds[3]
        assert len(source.calls()) == calls  # the hit did not touch the source
        assert sample_equal(first, second)
        assert type(second[1]) is int and second[0].dtype == torch.uint8
        assert ds.is_cached(3) and ds.num_cached == stored + 1


def test_bare_name_resolves_under_mmapcache_dir(shm_dir: str) -> None:
    with MmapCachedDataset("named", ImageLabels(4)) as ds:
        assert ds.path == f"{shm_dir}/named"


def test_unrelated_process_reads_by_path(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, ImageLabels(8)) as ds:
        for i in range(8):
            ds[i]
    code = (
        "import sys; from mmapcache import MmapCachedDataset; from helpers.sources import ImageLabels, sample_equal\n"
        f"ds = MmapCachedDataset({cache_path!r})\n"
        "assert all(sample_equal(ds[i], ImageLabels(8)[i]) for i in range(8)); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": __import__("os").path.dirname(__file__)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_without_source_an_unfilled_index_raises(cache_path: str) -> None:
    MmapCachedDataset(cache_path, ImageLabels(8), ragged=None).close()  # stores sample 0 only (no probes)
    with MmapCachedDataset(cache_path) as ds:
        with pytest.raises(SampleNotCachedError, match="sample 5 is not in the cache"):
            ds[5]
