"""``ds.loader()`` and ``__getitems__`` yield exactly what ``DataLoader(ds)`` with default collation yields.

Equality is exact (``sample_equal``: structure, container types, dtypes, bytes) for every kind of leaf, every
batching option, in-process and in worker processes (fork and spawn), fully cached, partly cached and with misses
inside batches. Also: recycled batch buffers never overwrite a batch the caller still holds, and gathers split
over threads copy the same bytes as one thread.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler, SubsetRandomSampler

from helpers.loader_sources import Mixed
from helpers.sources import sample_equal
from mmapcache import MmapCachedDataset


def _both(ds: MmapCachedDataset, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    """Batches of ``ds.loader(**kwargs)`` and of ``DataLoader(ds, **kwargs)``; a ``seed`` kwarg becomes a fresh
    generator seeded alike for each (so both shuffle identically)."""
    seed = kwargs.pop("seed", None)
    fast = ds.loader(**kwargs, **({"generator": torch.Generator().manual_seed(seed)} if seed is not None else {}))
    plain = DataLoader(ds, **kwargs, **({"generator": torch.Generator().manual_seed(seed)} if seed is not None else {}))
    return list(fast), list(plain)


def _zero_d_as_1_d(x: Any) -> Any:
    """0-d tensors as 1-element ones (``sample_equal`` compares bytes through a view that 0-d tensors refuse);
    containers keep their types."""
    if isinstance(x, torch.Tensor):
        return x.reshape(1) if x.dim() == 0 else x
    if isinstance(x, dict):
        return {k: _zero_d_as_1_d(v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*[_zero_d_as_1_d(v) for v in x])
    if isinstance(x, (list, tuple)):
        return type(x)(_zero_d_as_1_d(v) for v in x)
    return x


def _assert_same(fast: list[Any], plain: list[Any]) -> None:
    assert len(fast) == len(plain) > 0
    for k, (a, b) in enumerate(zip(fast, plain)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            assert a.dim() == b.dim(), f"batch {k}: {a.dim()}-d vs {b.dim()}-d"
        assert sample_equal(_zero_d_as_1_d(a), _zero_d_as_1_d(b)), f"batch {k} differs:\n{a!r}\nvs\n{b!r}"


@pytest.mark.parametrize("kind", ["pair", "dict", "nested"])
def test_every_structure_and_leaf_kind_matches_default_collate(cache_path: str, kind: str) -> None:
    with MmapCachedDataset(cache_path, Mixed(40, kind)) as ds:
        ds.fill()
        fast, plain = _both(ds, batch_size=8, shuffle=True, seed=3)
        _assert_same(fast, plain)
        if kind == "pair":
            assert type(fast[0]) is list and fast[0][1].dtype == torch.int64
        if kind == "nested":
            record = fast[0][0]
            assert type(record).__name__ == "Record" and fast[0][1]["half"].dtype == torch.bfloat16
            assert record.flag.dtype == torch.bool and record.score.dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 7},
        {"batch_size": 7, "drop_last": True},
        {"batch_size": 6, "shuffle": True, "seed": 11, "drop_last": True},
        {"batch_size": 5, "sampler": "subset"},
        {"batch_sampler": "custom"},
        {"batch_size": None},
    ],
    ids=["sequential", "drop_last", "shuffle_drop_last", "sampler", "batch_sampler", "no_batching"],
)
def test_batching_options_match(cache_path: str, kwargs: dict[str, Any]) -> None:
    kwargs = dict(kwargs)
    if kwargs.get("sampler") == "subset":
        kwargs["sampler"] = SubsetRandomSampler(list(range(3, 30)), generator=torch.Generator().manual_seed(5))
    if kwargs.get("batch_sampler") == "custom":
        kwargs["batch_sampler"] = [[4, 1, 1], [30, 2], [0], list(range(9, 20))]
    with MmapCachedDataset(cache_path, Mixed(33, "dict")) as ds:
        ds.fill()
        if "sampler" in kwargs:  # a sampler's iteration consumes its generator: give each loader its own copy
            fast = list(ds.loader(**kwargs))
            kwargs["sampler"] = SubsetRandomSampler(list(range(3, 30)), generator=torch.Generator().manual_seed(5))
            plain = list(DataLoader(ds, **kwargs))
        else:
            fast, plain = _both(ds, **kwargs)
        _assert_same(fast, plain)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_match_in_order(cache_path: str, context: str) -> None:
    with MmapCachedDataset(cache_path, Mixed(48, "nested")) as ds:
        ds.fill()
        kwargs = {"batch_size": 8, "shuffle": True, "seed": 7, "num_workers": 2, "multiprocessing_context": context,
                  "persistent_workers": context == "spawn", "timeout": 120}
        fast, plain = _both(ds, **kwargs)
        _assert_same(fast, plain)


def test_persistent_workers_serve_every_epoch(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Mixed(24, "pair")) as ds:
        ds.fill()
        loader = ds.loader(batch_size=5, num_workers=2, persistent_workers=True, multiprocessing_context="fork",
                           timeout=120)
        plain = list(DataLoader(ds, batch_size=5))
        for _ in range(3):
            _assert_same(list(loader), plain)


@pytest.mark.parametrize("workers", [0, 2])
def test_partial_cache_and_misses_inside_batches(cache_path: str, workers: int) -> None:
    source = Mixed(40, "pair", shape=(3, 16, 16))
    row_bytes = 3 * 16 * 16 + 8
    with MmapCachedDataset(cache_path, source, max_bytes=25 * row_bytes) as ds:
        cacheable = ds.num_cacheable
        assert 20 < cacheable < 40  # (the budget also pays for per-row state, so not exactly 25)
        for i in (1, 5, 6, 7, 20):  # a few hits scattered among misses; the last samples are never cacheable
            ds[i]
        context = {"multiprocessing_context": "fork", "timeout": 120} if workers else {}
        fast = list(ds.loader(batch_size=9, num_workers=workers, **context))
        expected = DataLoader(source, batch_size=9)  # the source itself: what every batch must hold
        _assert_same(fast, list(expected))
        assert ds.num_cached == cacheable  # the misses of cacheable samples were stored, the others passed through
        _assert_same(list(ds.loader(batch_size=9)), list(expected))  # and read back from the cache


def test_getitems_equals_per_sample_reads(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Mixed(30, "nested")) as ds:
        for i in range(0, 30, 3):
            ds[i]  # some filled, the rest are misses inside the batch
        indices = [29, 0, 3, 3, 14, 7, -1, 27]
        batch = ds.__getitems__(indices)
        assert len(batch) == len(indices)
        for i, sample in zip(indices, batch):
            assert sample_equal(_zero_d_as_1_d(sample), _zero_d_as_1_d(ds[i])), f"sample {i}"
            assert sample_equal(_zero_d_as_1_d(sample), _zero_d_as_1_d(Mixed(30, "nested")[i % 30])), f"sample {i}"
            assert sample[1]["count"].dim() == 0


def test_held_batches_are_never_overwritten_by_recycled_buffers(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Mixed(64, "pair", shape=(3, 32, 32))) as ds:
        ds.fill()
        expected = list(DataLoader(ds, batch_size=8))
        kept = list(ds.loader(batch_size=8))  # every batch held: none may be reused
        _assert_same(kept, expected)
        views = []
        for k, batch in enumerate(ds.loader(batch_size=8)):  # hold only a view of one sample of each batch
            views.append((k, batch[0][3]))
        for k, view in views:
            assert torch.equal(view, expected[k][0][3]), f"batch {k} was overwritten after it was handed out"
        # Batches that were dropped are recycled: the same data comes out again, intact.
        for _ in range(2):
            _assert_same([[b[0].clone(), b[1].clone()] for b in ds.loader(batch_size=8)], expected)


def test_large_batches_split_over_threads_copy_the_same_bytes(cache_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMAPCACHE_GATHER_THREADS", "3")
    shape = (4, 128, 128)  # 64 KiB rows: a 48-row batch is 3 MiB, enough to be split
    with MmapCachedDataset(cache_path, Mixed(96, "pair", shape=shape)) as ds:
        ds.fill()
        order = torch.randperm(96, generator=torch.Generator().manual_seed(1)).tolist()
        batches = list(ds.loader(batch_size=48, sampler=order))
        for k, batch in enumerate(batches):
            for j, i in enumerate(order[48 * k: 48 * (k + 1)]):
                assert torch.equal(batch[0][j], Mixed(96, "pair", shape=shape)[i][0]), f"row {j} of batch {k}"
        samples = ds.__getitems__(order[:48])
        assert all(torch.equal(s[0], Mixed(96, "pair", shape=shape)[i][0]) for s, i in zip(samples, order))
    monkeypatch.setenv("MMAPCACHE_GATHER_THREADS", "many")
    with pytest.raises(ValueError, match="MMAPCACHE_GATHER_THREADS"):  # read once, when the cache is opened
        MmapCachedDataset(cache_path)


def test_array_batches_follow_batch_sampler_order(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Mixed(50, "pair")) as ds:
        ds.fill()
        for drop_last in (False, True):
            fast = [b[1].tolist() for b in ds.loader(batch_size=16, shuffle=True, drop_last=drop_last,
                                                      generator=torch.Generator().manual_seed(9))]
            plain = [b[1].tolist() for b in DataLoader(ds, batch_size=16, shuffle=True, drop_last=drop_last,
                                                       generator=torch.Generator().manual_seed(9))]
            assert fast == plain and [len(b) for b in fast] == ([16] * 3 if drop_last else [16, 16, 16, 2])
        labels = np.concatenate([b[1].numpy() for b in ds.loader(batch_size=16)])
        assert np.array_equal(labels, np.arange(50) * 7 % 10)  # sequential: every index once, in order
        unseeded = [b[1] for b in ds.loader(batch_size=16, shuffle=True)]
        assert sum(len(b) for b in unseeded) == 50


def test_spawn_workers_and_an_interactive_main_get_a_clear_error(cache_path: str) -> None:
    """``python -c`` defines the source in a ``__main__`` that spawned workers cannot import: the loader says so
    instead of torch's "DataLoader worker exited unexpectedly"."""
    code = textwrap.dedent(f"""
        import torch
        from torch.utils.data import Dataset
        from mmapcache import MmapCachedDataset, WorkerStartError
        class Src(Dataset):
            def __len__(self): return 8
            def __getitem__(self, i): return torch.full((3,), i), i
        ds = MmapCachedDataset({cache_path!r}, Src())
        assert len(list(ds.loader(batch_size=4, num_workers=1, multiprocessing_context="fork"))) == 2
        try:
            ds.loader(batch_size=4, num_workers=1, multiprocessing_context="spawn")
        except WorkerStartError as exc:
            print("refused:", exc)
    """)
    for how in (["-c", code], ["-"]):  # python -c, and a script piped to stdin (__file__ is '<stdin>')
        out = subprocess.run([sys.executable, *how], input=code if how == ["-"] else None, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "refused: the source dataset (Src) is defined in an interactive __main__" in out.stdout
        assert "define it in a module" in out.stdout


def test_default_collate_of_getitems_copies_each_byte_once(cache_path: str) -> None:
    """DataLoader(ds) collates what __getitems__ gathered: the rows are views of one batch tensor, which
    default_collate hands back instead of stacking a second copy; anything else is stacked as usual."""
    from torch.utils.data import default_collate

    with MmapCachedDataset(cache_path, Mixed(40, "pair")) as ds:
        ds.fill()
        samples = ds.__getitems__([5, 1, 30, 2])
        images, labels = default_collate(samples)
        assert images.data_ptr() == samples[0][0].data_ptr()  # the gather's tensor itself: no second copy
        assert torch.equal(images, torch.stack([s[0] for s in samples])) and labels.tolist() == [s[1] for s in samples]
        reordered = default_collate(samples[::-1])[0]  # not the gathered order: stacked, in the order given
        assert reordered.data_ptr() != images.data_ptr() and torch.equal(reordered, images.flip(0))
        subset = default_collate(samples[:2])[0]
        assert torch.equal(subset, images[:2]) and subset.data_ptr() != images.data_ptr()
        mine = [torch.zeros(3), torch.ones(3)]
        assert torch.equal(default_collate(mine), torch.stack(mine))  # tensors of anyone else: unchanged


def test_default_collation_of_a_ragged_field_is_a_list(cache_path: str) -> None:
    rows = [{"ids": torch.arange(i % 5 + 1), "y": i} for i in range(20)]
    with MmapCachedDataset(cache_path, rows, ragged=["ids"]) as ds:
        for _ in range(2):  # misses, then hits
            plain = list(DataLoader(ds, batch_size=8))
            fused = list(ds.loader(batch_size=8))
            for a, b, start in zip(plain, fused, range(0, 20, 8)):
                assert isinstance(a["ids"], list) and [t.tolist() for t in a["ids"]] == [
                    list(range(i % 5 + 1)) for i in range(start, min(start + 8, 20))]
                assert [t.tolist() for t in a["ids"]] == [t.tolist() for t in b["ids"]]
                assert torch.equal(a["y"], b["y"])


@pytest.mark.parametrize("collate", [None, "list"])
def test_a_loader_rebuilt_with_another_sampler_batches_that_samplers_indices(cache_path: str,
                                                                            collate: str | None) -> None:
    # Trainers rebuild a loader from its attributes with their own sampler (PyTorch Lightning's overfit_batches puts
    # in SequentialSampler(loader.dataset)): the batches must be that sampler's indices, cut as before.
    with MmapCachedDataset(cache_path, Mixed(30, "pair")) as ds:
        collate_fn = (lambda samples: samples) if collate else None
        loader = ds.loader(batch_size=8, shuffle=True, collate_fn=collate_fn)
        rebuilt = type(loader)(loader.dataset, batch_size=None, sampler=SequentialSampler(loader.dataset),
                               collate_fn=loader.collate_fn)
        expected = list(DataLoader(ds, batch_size=8, collate_fn=collate_fn))
        got = list(rebuilt)
        assert len(got) == len(expected) == 4
        assert all(sample_equal(a, b) for a, b in zip(got, expected))
        own = DataLoader(ds, batch_size=8, sampler=DistributedSampler(range(30), 1, 0, seed=ds.seed),
                         collate_fn=collate_fn)
        assert all(sample_equal(a, b) for a, b in zip(list(loader), list(own), strict=True))  # the original's own
        with pytest.raises(TypeError, match=r"ds\.loader\(\)'s dataset is read by \(epoch, indices\) keys .* use "
                                            r"the MmapCachedDataset itself \(ds\[i\]\)"):
            loader.dataset[3]


def test_an_iteration_has_a_length_as_dataloaders_does(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, Mixed(30, "pair")) as ds:
        for workers in (0, 2):
            loader = ds.loader(batch_size=8, num_workers=workers)
            batches = iter(loader)
            assert len(batches) == len(loader) == len(iter(DataLoader(ds, batch_size=8))) == 4
            assert len(list(batches)) == 4


def test_held_padded_batches_are_never_overwritten_by_recycled_buffers() -> None:
    # PadCollate pads 1-D values into recycled buffers (read.gather.BufferPool.bytes): a batch, or a view of it, that
    # the caller still holds is never reused; dropped ones are, and pad what they are given again, wholly.
    from mmapcache import PadCollate

    rng = np.random.default_rng(4)
    batches = [[torch.from_numpy(rng.integers(1, 9, int(n))) for n in rng.integers(0, 40, 6)] for _ in range(12)]
    pad = PadCollate(-1, mask=True)
    expected = [torch.nn.utils.rnn.pad_sequence(b, batch_first=True, padding_value=-1) for b in batches]
    held = [pad(b) for b in batches]  # every batch held: none may be reused
    views = [pad(b).data[1:] for b in batches]  # only a view of each held
    for got, view, want, b in zip(held, views, expected, batches):
        assert torch.equal(got.data, want) and torch.equal(view, want[1:])
        assert torch.equal(got.mask, want != -1) and got.lengths.tolist() == [len(v) for v in b]
    for _ in range(3):  # dropped at once: recycled, refilled
        for b, want in zip(batches, expected):
            assert torch.equal(pad(b).data, want)


class _ReadInWorkers(torch.utils.data.Dataset):
    """Item ``k``: the cache's batch of rows ``4k .. 4k + 3`` as ``read_batch`` makes it in a DataLoader worker, and
    whether each of its tensors is in shared memory there (what a worker sends without copying it again)."""

    def __init__(self, ds: MmapCachedDataset, pad: Any = None) -> None:
        self.ds, self.pad = ds, pad

    def __len__(self) -> int:
        return len(self.ds) // 4

    def __getitem__(self, k: int) -> Any:
        batch = self.ds.read_batch(list(range(4 * k, 4 * k + 4)), pad=self.pad)
        leaves = list(batch.values()) if isinstance(batch, dict) else list(batch)
        return batch, [leaf.is_shared() for leaf in leaves if isinstance(leaf, torch.Tensor)]


def test_a_workers_batch_tensors_are_made_in_shared_memory(cache_path: str) -> None:
    """A worker's batch columns are gathered into shared memory and handed on as those tensors: torch.from_numpy of
    them made tensors torch did not know were shared, which it copied into new shared memory to send (every batch
    copied twice). Fixed fields (images, labels), and token batches of TextCollate (padded) read from the heaps."""
    from helpers.sources import ImageLabels
    from helpers.text_sources import Tokenized, same
    from mmapcache import TextCollate

    images = MmapCachedDataset(cache_path + "-images", ImageLabels(16))
    tokens = MmapCachedDataset(cache_path + "-tokens", Tokenized(16))
    for ds, pad in ((images, None), (tokens, TextCollate(0))):
        ds.fill()
        loader = DataLoader(_ReadInWorkers(ds, pad), batch_size=None, num_workers=2)
        for k, (batch, shared) in enumerate(loader):
            assert shared and all(shared), (ds.path, shared)
            expected = ds.read_batch(list(range(4 * k, 4 * k + 4)), pad=pad)  # (this process: not in a worker)
            if pad is None:
                assert all(torch.equal(a, b) for a, b in zip(batch, expected))
            else:
                assert same(batch, expected)
        ds.close()
