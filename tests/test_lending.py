"""A worker's batch storages come back to it once the main process drops them, and never before (``read.lending``).

A new shared-memory storage is reserved and zeroed page by page when it is made; a worker that reuses a few saves
that for every batch. Reusing one that the caller still holds would overwrite a batch it is reading: the worst
defect this cache can have, silent. So each test compares what the caller kept with a copy taken on arrival, after
the workers have gone on filling storages, and counts the storages (by their shared-memory inode) to see that they
were reused at all.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch.utils.data import default_collate

from helpers.sources import ImageLabels, sample_equal
from helpers.text_sources import Tokenized
from mmapcache import Mixture, MmapCachedDataset, PadCollate, TextCollate
from mmapcache.format.batch import arrays_of
from mmapcache.read import lending

_SLOTS = 6  # (read.lending's: storages per worker)


def _inode(t: torch.Tensor) -> int:
    """The worker's storage under ``t``: its address here (the main process maps each pool storage once)."""
    return t.untyped_storage().data_ptr()


def _biggest(batch: Any) -> torch.Tensor:
    return max((t for t in arrays_of(batch) if isinstance(t, torch.Tensor)), key=lambda t: t.nbytes)


def _cloned(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: _cloned(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # (PadCollate's Padded)
        return type(batch)(*(_cloned(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_cloned(v) for v in batch)
    return batch


def _loaders(cache_path: str, form: str, **kwargs: Any) -> tuple[Any, Any, list[MmapCachedDataset]]:
    """A loader with two workers and the same one without, over 240 samples in batches of 8 (30 a pass)."""
    if form == "mixture":
        sources = [MmapCachedDataset(f"{cache_path}-{k}", Tokenized(120, longest=3000, seed=k)) for k in range(2)]
        for ds in sources:
            ds.fill()
        mix = Mixture(sources, seed=1)
        made = [mix.loader(batch_size=8, collate_fn=TextCollate(0), num_workers=w, **(kwargs if w else {}))
                for w in (2, 0)]
        return made[0], made[1], sources
    if form == "images":
        ds = MmapCachedDataset(cache_path, ImageLabels(240, shape=(3, 64, 64)))  # 98 KB a batch
        collate: dict[str, Any] = {}
    else:
        ds = MmapCachedDataset(cache_path, Tokenized(240, longest=3000))
        collate = {"collate_fn": TextCollate(0, labels="input_ids") if form == "padded" else PadCollate(0, mask=True)}
    ds.fill()
    made = [ds.loader(batch_size=8, shuffle=True, seed=3, num_workers=w, **collate, **(kwargs if w else {}))
            for w in (2, 0)]
    return made[0], made[1], [ds]


def _all_free(loader: Any) -> None:
    """Every storage of the loader's (persistent) workers is free, the caller holding no batch."""
    gc.collect()
    lending.received(None)  # (sweeps)
    flags = loader._iterator._mmapcache_lending.flags
    assert int(flags.count_nonzero()) == 0, flags


def _set_epoch(loader: Any, epoch: int) -> None:
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)
    else:  # (a mixture's)
        loader.sampler.mixture.set_epoch(epoch)


@pytest.mark.parametrize("form", ["padded", "pad_collate", "images", "mixture"])
def test_a_workers_storages_are_reused_once_the_caller_drops_its_batches(cache_path: str, form: str) -> None:
    workers, plain, sources = _loaders(cache_path, form)
    for epoch in range(2):  # (new workers each pass: new pools)
        _set_epoch(plain, epoch)
        expected = list(plain)
        _set_epoch(workers, epoch)
        inodes = set()
        for batch, want in zip(workers, expected, strict=True):
            assert sample_equal(batch, want)
            inodes.add(_inode(_biggest(batch)))
        assert len(expected) == 30
        assert len(inodes) <= 2 * _SLOTS, f"{len(inodes)} storages for {len(expected)} batches: none reused"
    for ds in sources:
        ds.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_batch_the_caller_keeps_is_never_written_over(cache_path: str, context: str) -> None:
    """Whole batches, a row (a view), a numpy array of a field (its tensor dropped) are kept over three passes
    of persistent workers, which meanwhile reuse every storage the caller let go."""
    workers, plain, sources = _loaders(cache_path, "padded", persistent_workers=True,
                                       multiprocessing_context=context)
    kept: list[tuple[Any, Any]] = []
    inodes, batches = set(), 0
    for epoch in range(3):
        _set_epoch(plain, epoch)
        expected = list(plain)
        _set_epoch(workers, epoch)
        for k, (batch, want) in enumerate(zip(workers, expected, strict=True)):
            assert sample_equal(batch, want)
            batches += 1
            inodes.add(_inode(batch["input_ids"]))
            if k in (5, 20):  # two a pass (their storages stay lent: the workers go on with the rest)
                kind = len(kept) % 3
                if kind == 0:
                    kept.append((batch, _cloned(batch)))
                elif kind == 1:
                    kept.append((batch["input_ids"][1], batch["input_ids"][1].clone()))
                else:
                    kept.append((batch["attention_mask"].numpy(), batch["attention_mask"].clone().numpy()))
            del batch
            gc.collect()
    assert len(inodes) < batches / 2, f"{len(inodes)} storages for {batches} batches: the pool was not reused"
    for held, copy in kept:
        assert sample_equal(held, copy)
    for ds in sources:
        ds.close()


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="pin_memory needs an accelerator: without one DataLoader turns it off")
@pytest.mark.parametrize("form", ["padded", "pad_collate"])
def test_pinned_batches_equal_the_plain_ones_and_give_their_storages_back(cache_path: str, form: str) -> None:
    """``pin_memory=True``: DataLoader's pin thread copies each lent batch into pinned memory (``Lent.pin_memory``)
    and drops the lent one, whose storage must then come back to its worker. Batches kept over three passes of
    persistent workers never change, and after each pass every storage is free although the caller keeps batches
    (what it keeps are the pinned copies)."""
    workers, plain, sources = _loaders(cache_path, form, persistent_workers=True, pin_memory=True)
    kept: list[tuple[Any, Any]] = []
    for epoch in range(3):
        _set_epoch(plain, epoch)
        expected = list(plain)
        _set_epoch(workers, epoch)
        for k, (batch, want) in enumerate(zip(workers, expected, strict=True)):
            assert _biggest(batch).is_pinned()
            assert sample_equal(batch, want)
            if k in (3, 17):
                kept.append((batch, _cloned(batch)))
            del batch
        _all_free(workers)
    for held, copy in kept:
        assert sample_equal(held, copy)
    for ds in sources:
        ds.close()


def test_an_abandoned_passs_prefetched_batches_come_back(cache_path: str) -> None:
    """A pass left after two batches: the batches its workers had prefetched are discarded unread, and their
    storages must still come back (each worker would otherwise lose the room for them, pass after pass)."""
    workers, plain, sources = _loaders(cache_path, "padded", persistent_workers=True)
    for epoch in range(3):
        _set_epoch(workers, epoch)
        for k, _batch in enumerate(workers):
            if k == 1:
                break
    del _batch  # (the one the loop held on)
    _set_epoch(plain, 3)
    expected = list(plain)
    _set_epoch(workers, 3)
    for batch, want in zip(workers, expected, strict=True):
        assert sample_equal(batch, want)
    del batch
    _all_free(workers)
    for ds in sources:
        ds.close()


def test_a_batch_sent_on_to_another_process_is_never_written_over(cache_path: str) -> None:
    """A tensor of a batch put on a multiprocessing queue is mapped by whoever takes it, which this process cannot
    see: its storage is never lent again, though this process drops it."""
    workers, _, sources = _loaders(cache_path, "padded", persistent_workers=True)
    queue: Any = torch.multiprocessing.Queue()
    sent = []
    for epoch in range(3):
        _set_epoch(workers, epoch)
        for k, batch in enumerate(workers):
            if k == 3:
                queue.put(batch["input_ids"])
                sent.append(batch["input_ids"].clone())
            del batch
            gc.collect()
    for copy in sent:  # (taken here, after the workers went on: mapped again from the shared memory)
        assert torch.equal(queue.get(timeout=60), copy)
    _all_free(workers)  # (each worker let go of the storages sent on, and made others)
    for ds in sources:
        ds.close()


class _Tokens(torch.Tensor):
    """A user's tensor subclass with an attribute (as torchvision's tv_tensors carry theirs)."""

    source: str


class _Wrapping:
    """A user's collate around ``inner`` (TextCollate's, unless a subclass sets another), whose attributes it hands
    on (``read_parts``: the warm path); subclasses change its batch in ``__call__``."""

    def __init__(self) -> None:
        self.inner = TextCollate(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)


class _AsSubclass(_Wrapping):
    """Wraps TextCollate's batch as a user's collate might: the ids as a subclass with an attribute, a view of the
    worker's lent storage. (Not a plain tensor given an attribute: torch's own worker batches drop those.)"""

    def __call__(self, samples: Any) -> Any:
        batch = self.inner(samples)
        batch["input_ids"] = batch["input_ids"].as_subclass(_Tokens)
        batch["input_ids"].source = f"rows of {len(samples)}"
        return batch


def test_a_subclass_with_attributes_crosses_whole_and_is_never_written_over(cache_path: str) -> None:
    """A lent batch's tensors cross as their places in the worker's storage: a subclass with an attribute must
    arrive as it left, and one kept must stay as it arrived while the pool is reused."""
    ds = MmapCachedDataset(cache_path, Tokenized(240, longest=3000))
    ds.fill()
    workers = ds.loader(batch_size=8, shuffle=True, seed=3, num_workers=2, persistent_workers=True,
                        collate_fn=_AsSubclass())
    plain = ds.loader(batch_size=8, shuffle=True, seed=3, collate_fn=TextCollate(0))
    kept: list[tuple[Any, Any]] = []
    for epoch in range(2):
        plain.sampler.set_epoch(epoch)
        expected = list(plain)
        workers.sampler.set_epoch(epoch)  # (after the pass above: an epoch read again unset is its next pass)
        for k, (batch, want) in enumerate(zip(workers, expected, strict=True)):
            ids, mask = batch["input_ids"], batch["attention_mask"]
            assert type(ids) is _Tokens and ids.source == f"rows of {len(want['input_ids'])}"
            assert type(mask) is torch.Tensor
            assert torch.equal(ids.as_subclass(torch.Tensor), want["input_ids"])
            assert torch.equal(mask, want["attention_mask"])
            if k in (4, 17):
                kept.append((ids, ids.as_subclass(torch.Tensor).clone()))
            del batch, ids, mask
            gc.collect()
    assert len(kept) == 4
    for held, copy in kept:
        assert torch.equal(held.as_subclass(torch.Tensor), copy)
    del held
    kept.clear()
    _all_free(workers)  # (given back once the caller dropped them)
    ds.close()


class _SendsTheLastAgain(_Wrapping):
    """Wraps TextCollate as a user's fallback might: every fourth call, the worker sends its last batch again (marked
    ``again``) instead of a new one, a batch carved from an earlier storage of its pool. Each batch also carries a
    subclass with an attribute, a leaf that requires grad and a ``Parameter``, all views of the lent storage."""

    def __init__(self) -> None:
        self.inner, self.last, self.calls = TextCollate(0), None, 0

    def __call__(self, samples: Any) -> Any:
        self.calls += 1
        if self.last is not None and self.calls % 4 == 0:
            again, self.last = {**self.last, "again": True}, None
            return again
        batch = self.inner(samples)
        floats = batch["input_ids"].view(torch.float64)  # (the same bytes: a view of the lent storage)
        tokens = batch["input_ids"].as_subclass(_Tokens)
        tokens.source = "ids"
        self.last = {**batch, "tokens": tokens, "weights": floats[0].requires_grad_(),
                     "parameter": torch.nn.Parameter(floats[1], requires_grad=False)}
        return self.last


def test_a_batch_a_worker_sends_again_is_never_written_over(cache_path: str) -> None:
    """A worker that sends an earlier batch's tensors again (its storage no longer this batch's): the main process
    drops the first and keeps the second, and its pool must not fill that storage under it; each tensor arrives
    as the kind it left as."""
    ds = MmapCachedDataset(cache_path, Tokenized(240, longest=3000))
    ds.fill()
    workers = ds.loader(batch_size=8, shuffle=True, seed=3, num_workers=2, persistent_workers=True,
                        collate_fn=_SendsTheLastAgain())
    kept: list[tuple[Any, Any]] = []
    for epoch in range(3):
        workers.sampler.set_epoch(epoch)
        for batch in workers:
            tokens, weights, parameter = batch["tokens"], batch["weights"], batch["parameter"]
            assert type(tokens) is _Tokens and tokens.source == "ids"
            assert weights.is_leaf and weights.requires_grad
            assert type(parameter) is torch.nn.Parameter and not parameter.requires_grad
            assert torch.equal(tokens.as_subclass(torch.Tensor), batch["input_ids"])
            if batch.get("again"):
                kept.append((batch, _cloned(batch)))
            del batch, tokens, weights, parameter
            gc.collect()
    assert len(kept) > 10
    for held, copy in kept:
        for name in ("input_ids", "attention_mask", "weights", "parameter"):
            assert torch.equal(held[name].detach(), copy[name].detach()), name
    del held
    kept.clear()
    _all_free(workers)
    ds.close()


class _Box:
    def __init__(self, *contents: Any) -> None:
        self.contents = contents


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class _LendsParts(_Wrapping):
    """Wraps TextCollate's batch with a box holding a sparse tensor whose values are a row of the lent ids, and the
    lent storage itself: pickled as their parts, never as a carved tensor."""

    def __call__(self, samples: Any) -> Any:
        batch = self.inner(samples)
        row = batch["input_ids"][0]
        sparse = torch.sparse_coo_tensor(torch.arange(row.numel())[None], row, (row.numel(),))
        return {**batch, "box": _Box(sparse, batch["input_ids"].untyped_storage())}


@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
def test_a_lent_storage_reached_through_its_parts_is_never_written_over(cache_path: str) -> None:
    """A sparse tensor's values, or the storage itself, kept without the batch's carved tensors: the storage is
    given back once those are dropped, so what is kept must be a copy of its own."""
    ds = MmapCachedDataset(cache_path, Tokenized(240, longest=3000))
    ds.fill()
    workers = ds.loader(batch_size=8, shuffle=True, seed=3, num_workers=2, persistent_workers=True,
                        collate_fn=_LendsParts())
    kept = []
    for epoch in range(2):
        workers.sampler.set_epoch(epoch)
        for batch in workers:
            sparse, storage = batch["box"].contents
            assert torch.equal(sparse.to_dense(), batch["input_ids"][0])
            kept.append((sparse, sparse.to_dense(), storage, _bytes(storage).clone()))
            del batch, sparse, storage
            gc.collect()
    for sparse, dense, storage, data in kept:
        assert torch.equal(sparse.to_dense(), dense) and torch.equal(_bytes(storage), data)
    kept.clear()
    _all_free(workers)
    ds.close()


class _Entwined(_Wrapping):
    """Wraps TextCollate's batch so that its tensors refer to each other: the ids (a subclass) carry the mask and
    themselves as attributes, and appear twice in the batch."""

    def __call__(self, samples: Any) -> Any:
        batch = self.inner(samples)
        ids, mask = batch["input_ids"].as_subclass(_Tokens), batch["attention_mask"].as_subclass(_Tokens)
        ids.mask, ids.me, ids.source, mask.source = mask, ids, "ids", "mask"
        return {"input_ids": ids, "attention_mask": mask, "again": ids, "both": [mask, ids]}


def test_tensors_that_refer_to_each_other_arrive_as_the_same_objects(cache_path: str) -> None:
    """A carved tensor's attributes may hold tensors of the batch, itself included: each must arrive as the one
    object it was in the worker, wherever it appears."""
    ds = MmapCachedDataset(cache_path, Tokenized(120, longest=3000))
    ds.fill()
    workers = ds.loader(batch_size=8, num_workers=2, collate_fn=_Entwined())
    plain = ds.loader(batch_size=8, collate_fn=TextCollate(0))
    for batch, want in zip(workers, plain, strict=True):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        assert (ids.source, mask.source) == ("ids", "mask")
        assert ids.mask is mask and ids.me is ids and batch["again"] is ids
        assert batch["both"][0] is mask and batch["both"][1] is ids
        assert torch.equal(ids.as_subclass(torch.Tensor), want["input_ids"])
        assert torch.equal(mask.as_subclass(torch.Tensor), want["attention_mask"])
    ds.close()


class _WithSpectrum(_Wrapping):
    """Wraps TextCollate's batch with a large complex tensor made in the worker, as a conjugate view (its storage the
    worker's own, not the lent one), and its negative view."""

    def __call__(self, samples: Any) -> Any:
        batch = self.inner(samples)
        spectrum = torch.fft.rfft(batch["input_ids"].to(torch.float64))  # (larger than a packed small tensor)
        return {**batch, "conj": spectrum.conj(), "neg": spectrum.real._neg_view()}


def test_conjugate_and_negative_views_arrive_as_their_values(cache_path: str) -> None:
    ds = MmapCachedDataset(cache_path, Tokenized(64, longest=3000))
    ds.fill()
    for batch, want in zip(ds.loader(batch_size=8, num_workers=2, collate_fn=_WithSpectrum()),
                           ds.loader(batch_size=8, collate_fn=_WithSpectrum()), strict=True):
        assert batch["conj"].nbytes > 64 << 10
        assert torch.equal(batch["conj"].resolve_conj(), want["conj"].resolve_conj())
        assert torch.equal(batch["neg"].resolve_neg(), want["neg"].resolve_neg())
    ds.close()


def _compare_when_told(tensor: torch.Tensor, copy: torch.Tensor, go: Any, result: Any) -> None:
    go.wait(120)
    result.value = int(torch.equal(tensor, copy))


def test_a_batch_a_forked_process_holds_is_never_written_over(cache_path: str) -> None:
    """A process forked while this one holds a batch maps its storage too (its arguments are not pickled): the
    storage stays that batch's after this process drops it."""
    workers, _, sources = _loaders(cache_path, "padded", persistent_workers=True)
    context = multiprocessing.get_context("fork")
    go, result = context.Event(), context.Value("i", -1)
    child = None
    for epoch in range(3):
        _set_epoch(workers, epoch)
        for k, batch in enumerate(workers):
            if child is None and k == 3:
                ids = batch["input_ids"]
                child = context.Process(target=_compare_when_told, args=(ids, ids.clone(), go, result))
                child.start()
                del ids
            del batch
            gc.collect()
    go.set()
    assert child is not None
    child.join(120)
    assert result.value == 1, "the forked process's batch was written over"
    _all_free(workers)
    for ds in sources:
        ds.close()


class _KeepsLast:
    """A collate over samples that keeps the first image of each of the last four batches in the worker (a
    fallback for a bad batch, say: views of the columns those batches were gathered into) and checks, at each call,
    that none has changed."""

    def __init__(self) -> None:
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, samples: Any) -> Any:
        if not all(torch.equal(held, copy) for held, copy in self.kept):
            raise RuntimeError("a tensor this worker kept was written over")
        image = torch.as_tensor(samples[0][0])
        self.kept = [*self.kept[-3:], (image, image.clone())]
        return default_collate(samples)


def test_a_tensor_a_worker_keeps_is_never_written_over(cache_path: str) -> None:
    ds = MmapCachedDataset(cache_path, ImageLabels(240, shape=(3, 64, 64)))
    ds.fill()
    loader = ds.loader(batch_size=8, num_workers=2, collate_fn=_KeepsLast(), persistent_workers=True)
    for _ in range(2):
        assert sum(1 for _ in loader) == 30
    ds.close()


def test_a_read_that_fails_in_a_worker_frees_its_storage(cache_path: str) -> None:
    """A batch whose read raises is never sent: its storage is free again for the next one."""
    ds = MmapCachedDataset(cache_path, Tokenized(64, longest=3000))
    ds.fill()
    loader = ds.loader(batch_size=8, num_workers=1, collate_fn=_FailsOnce(TextCollate(0)), persistent_workers=True)
    with pytest.raises(RuntimeError, match="the third batch"):
        list(loader)
    assert len(list(loader)) == 8
    _all_free(loader)
    ds.close()


class _FailsOnce(_Wrapping):
    """A collate that raises on its third batch, once (persistent workers keep the count), after reading it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, samples: Any) -> Any:
        self.calls += 1
        batch = self.inner(samples)  # (its storage taken)
        if self.calls == 3:
            raise RuntimeError("the third batch")
        return batch


_SMALL_SHM_CHILD = """
import sys
sys.path.insert(0, sys.argv[2])
import torch
from helpers.sources import ImageLabels, image_of
from mmapcache import MmapCachedDataset

ds = MmapCachedDataset(sys.argv[1], ImageLabels(8, shape=(3, 512, 512)))  # one batch of 6 MiB
ds.fill()
loader = ds.loader(batch_size=8, num_workers=1)
for epoch in range(2):
    for images, labels in loader:
        assert all(torch.equal(images[i], torch.as_tensor(image_of(i, (3, 512, 512)))) for i in range(8))
    del images, labels
print("read")
"""


def test_a_dev_shm_too_small_for_the_pool_is_read_with_exact_storages(tmp_path: Any) -> None:
    """/dev/shm (a container's is 64 MB) with room for a batch but not for the pool's quarter more: the worker
    gives its free storages back and makes the batch's storage to its size, as without a pool. A real tmpfs of
    7 MiB on /dev/shm, in a mount namespace of the child's own (needs root: skipped otherwise)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    script = ("mount -t tmpfs -o size=7M tmpfs /dev/shm && exec " + sys.executable + ' -c "$0" "$@"')
    result = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, _SMALL_SHM_CHILD,
                             str(tmp_path / "cache"), tests], capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and "mount" in result.stderr and "Traceback" not in result.stderr:
        pytest.skip(f"cannot mount a tmpfs on /dev/shm in a mount namespace: {result.stderr.strip()}")
    assert result.returncode == 0 and result.stdout.strip() == "read", result.stderr[-3000:]
