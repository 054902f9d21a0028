"""A field whose shape varies needs no option: the creator probes 8 samples spread over the dataset (stored, so none
is computed twice) and stores ragged every field whose shape differs among them (``ragged="auto"``, the default).

Detection boxes, token ids and audio of any length work as a user wraps them; a probe the source fails on is left
out (it fails again, with its index, when read); a stream stores its probes as the next positions of its order; a
cache made before (fixed fields) still opens; ``ragged=None`` keeps the first sample's shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from helpers.sources import Counting, sample_equal
from mmapcache import LayoutError, MmapCachedDataset

TESTS = os.path.dirname(os.path.abspath(__file__))


class Detection(Dataset):
    """An image, 1..8 boxes of 4 floats, their labels, and a waveform of any length."""

    def __init__(self, n: int = 60, fail: int | None = None) -> None:
        self.n, self.fail = n, fail

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.fail:
            raise OSError(f"unreadable annotation file for sample {i}")
        g = torch.Generator().manual_seed(i)
        boxes = i % 8 + 1
        return {"image": torch.randint(0, 255, (3, 16, 16), dtype=torch.uint8, generator=g),
                "boxes": torch.rand(boxes, 4, generator=g), "labels": torch.arange(boxes) + i,
                "audio": torch.randn(100 + 37 * (i % 11), generator=g), "ids": list(range(i % 5))}


def test_varying_fields_need_no_option(cache_path: str, tmp_path: Any) -> None:
    source = Counting(Detection(), str(tmp_path / "calls"))
    with MmapCachedDataset(cache_path, source) as ds:
        ragged = {f.name for f in ds._store.layout.fields if f.ragged}
        assert ragged == {"boxes", "labels", "audio", "ids"}  # the image keeps its fixed rows
        created = ds.num_cached
        assert created == 8  # the first sample and 7 more probes (index 0 is both)
        for batch in ds.loader(batch_size=8, shuffle=True, collate_fn=lambda samples: samples):
            assert all(sample_equal(s, Detection()[_index(s)]) for s in batch)
        assert sorted(source.calls()) == list(range(60))  # the probes were stored: nothing computed twice
    with MmapCachedDataset(cache_path) as reader:  # another process, by path, without the source
        assert all(sample_equal(reader[i], Detection()[i]) for i in range(60))


def _index(sample: dict[str, Any]) -> int:
    """The index of a ``Detection`` sample (its labels start at it)."""
    return int(sample["labels"][0])


def test_a_probe_the_source_fails_on_is_left_out(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Detection(fail=16)) as ds:
        assert not ds.is_cached(16) and ds.num_cached == 7  # 16 is one of the 8 probes spread over 0..59
        with pytest.raises(OSError, match="unreadable annotation file for sample 16"):
            ds[16]
        assert sample_equal(ds[15], Detection()[15])


def test_without_probes_a_varying_field_is_a_layout_error_naming_the_fix(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Detection(), ragged=None) as ds:
        assert ds.num_cached == 1
        with pytest.raises(LayoutError, match=r"sample 1, field 'boxes': expected shape \(1, 4\), found \(2, 4\).*"
                                              r"ragged=\['boxes'\]"):
            ds[1]
    # A cache made that way (or by mmapcache 0.2) opens with today's default, and keeps its layout.
    with MmapCachedDataset(cache_path, Detection()) as ds:
        assert not any(f.ragged for f in ds._store.layout.fields if f.name == "boxes")


def test_a_stream_stores_its_probes_as_the_next_positions(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Detection(), stream=True, seed=4) as ds:
        assert ds.stream_stats["produced"] == 9  # positions 0..8 of epoch 0
        order = ds._ring.order(0).tolist()
        read = [_index(s) for batch in ds.loader(batch_size=10, collate_fn=lambda samples: samples) for s in batch]
        assert read == order
        assert ds.stream_stats["served"] == 9 and ds.stream_stats["computed"] == 51


def test_the_command_line_builds_a_varying_source_with_no_option(shm_dir: str) -> None:
    path = os.path.join(shm_dir, "ragged")
    spec = os.path.join(TESTS, "helpers", "cli_sources.py") + ":Ragged"
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "mmapcache", "build", path, "--dataset", spec, "--workers", "1"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "filled 20, skipped 0" in done.stdout, done.stdout + done.stderr
    with open(os.path.join(path, "meta.json")) as f:
        assert [f["ragged"] for f in json.load(f)["fields"]] == [True, False]  # tokens ragged, the label not
