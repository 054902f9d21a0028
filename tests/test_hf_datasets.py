"""Real Hugging Face ``datasets``: a ``Dataset.from_dict`` with an image, a label, a string and a token column,
cached in its default (python lists), torch and numpy formats, with nothing changed in the dataset."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mmapcache import MmapCachedDataset, PadCollate

datasets = pytest.importorskip("datasets")  # in the test extra; skipped only where it cannot install

N = 24


def _hf() -> Any:
    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict({
        "image": [rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for _ in range(N)],
        "label": [i % 5 for i in range(N)],
        "caption": [f"a photo of {'ü' * (i % 4)} thing {i}" for i in range(N)],
        "input_ids": [list(range(i % 7 + 1)) for i in range(N)],
    })


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("fmt", [None, "torch", "numpy"])
def test_every_format_round_trips(cache_path: str, fmt: str | None) -> None:
    source = _hf() if fmt is None else _hf().with_format(fmt)
    ds = MmapCachedDataset(cache_path, source, ragged="auto")
    kinds = {f.name: (f.kind, f.ragged) for f in ds._store.layout.fields}
    assert kinds["caption"] == ("numpy_str" if fmt == "numpy" else "str", True)  # the numpy format gives np.str_
    assert kinds["input_ids"][1], kinds  # ragged: found by ragged="auto" (a python list: always)
    if fmt is None:
        assert kinds["image"] == ("pylist", False)  # one field, not 192 (8x8x3 numbers)
    for _ in range(2):  # misses, then hits
        for i in range(N):
            assert _same(ds[i], source[i]), (i, ds[i], source[i])
    batch = list(range(0, N, 2))
    assert all(_same(s, source[i]) for s, i in zip(ds.__getitems__(batch), batch))
    ds.close()


def test_torch_format_with_the_padding_collate(cache_path: str) -> None:
    source = _hf().with_format("torch")
    ds = MmapCachedDataset(cache_path, source, ragged=["input_ids"])
    batch = next(iter(ds.loader(batch_size=N, collate_fn=PadCollate(0, mask=True))))
    ids = batch["input_ids"]
    assert ids.data.shape == (N, 7) and ids.lengths.tolist() == [i % 7 + 1 for i in range(N)]
    assert batch["caption"] == [source[i]["caption"] for i in range(N)]
    assert batch["image"].dtype == torch.uint8 or batch["image"].dtype == torch.int64  # as the format gives it
    ds.close()
