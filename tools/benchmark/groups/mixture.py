"""Group ``mixture`` (issue 39): ``mmapcache.Mixture`` of 3 caches read against one cache holding the same rows, and
against what users write without it (``ConcatDataset`` + ``WeightedRandomSampler`` through a ``DataLoader``).

Three workloads, each 3 caches of one structure, their sizes 4:2:1, and one cache holding all their rows (the same
bytes, in the same order): 64 B rows (14 float32 + an int label), 12 KB images (3x64x64 uint8 + label) and ragged
token ids (int64, 16..2048 tokens, lognormal, mean ~300, + label; batches of 64 padded by ``PadCollate(0)`` on
every side). Every label is its row's number among all the rows, so a sample says which cache it belongs to and
which values it must hold. The mixture has its default weights (every sample once per epoch), so each side reads
every row once per epoch. All caches are filled before anything is timed; each comparison is one ``interleave``,
in this process (``num_workers=0``) for the targets, with two workers in rows without a target (2 cores).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, WeightedRandomSampler

from benchmark.core import Comparison, Config, Results, Side, info, interleave
from benchmark.epochs import epoch
from benchmark.workloads import workspace
from mmapcache import Mixture, MmapCachedDataset, PadCollate
from mmapcache.read.mix_order import MixPass

NAMES = ("a", "b", "c")
SHARES = (4, 2, 1)  # the caches' sizes, in sevenths of the rows
TOKEN_LENGTHS = (16, 2048)
TOKEN_LOGNORMAL = (5.222, 1.0)  # mu, sigma: a mean of ~300 tokens once clipped (the text group's corpus)
CHECKED_BATCHES = 3


@dataclass(frozen=True)
class MixWorkload:
    """Rows of one structure, split over 3 caches.

    Attributes:
        name: the prefix of its side names and target keys.
        title: how rows name it.
        shape, dtype: a fixed row's values (``shape`` None: ragged token ids).
        n, quick_n: rows in all (full run, ``--quick``).
        batch: the batch size (None: the run's ``cfg.batch``).
        concat: also time ``ConcatDataset`` + ``WeightedRandomSampler``.
    """

    name: str
    title: str
    shape: tuple[int, ...] | None
    dtype: str
    n: int
    quick_n: int
    batch: int | None = None
    concat: bool = False

    @property
    def ragged(self) -> bool:
        return self.shape is None


ROWS64 = MixWorkload("rows64", "64 B rows", (14,), "float32", 7 * 32768, 7 * 1024, concat=True)
IMAGES12K = MixWorkload("images12k", "12 KB images", (3, 64, 64), "uint8", 7 * 4096, 7 * 200)
TOKENS = MixWorkload("tokens", "ragged tokens", None, "int64", 7 * 2048, 7 * 100, batch=64)
WORKLOADS = (ROWS64, IMAGES12K, TOKENS)


class Rows(Dataset):
    """Rows ``start`` to ``stop`` of a workload's data (``write_data``), each ``(values tensor, label)``; the maps
    are opened lazily in each process."""

    def __init__(self, paths: dict[str, str], start: int, stop: int) -> None:
        self.paths, self.start, self.stop = dict(paths), start, stop
        self._open: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} rows")
        if self._open is None:
            self._open = {name: np.load(path, mmap_mode="r") for name, path in self.paths.items()}
        row = self.start + index
        return torch.from_numpy(np.array(values_of(self._open, row))), int(self._open["label"][row])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": None}


def values_of(data: dict[str, np.ndarray], row: int) -> np.ndarray:
    """Row ``row``'s values (a view)."""
    if "offsets" in data:
        offsets = data["offsets"]
        return data["values"][int(offsets[row]):int(offsets[row + 1])]
    return data["values"][row]


def write_data(directory: str, w: MixWorkload, n: int, seed: int = 39) -> dict[str, str]:
    """``n`` rows of random values (and ``offsets`` for token ids) and labels ``0..n-1``, as ``.npy`` files."""
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {"label": np.arange(n, dtype=np.int64)}
    if w.ragged:
        lengths = np.clip(np.rint(rng.lognormal(*TOKEN_LOGNORMAL, n)), *TOKEN_LENGTHS).astype(np.int64)
        arrays["offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        arrays["values"] = rng.integers(0, 50000, int(arrays["offsets"][-1]), dtype=np.int64)
    elif np.dtype(w.dtype).kind == "f":
        arrays["values"] = rng.standard_normal((n, *w.shape), dtype=np.float32)  # type: ignore[misc]
    else:
        arrays["values"] = rng.integers(0, 256, (n, *w.shape), dtype=np.uint8)  # type: ignore[misc]
    paths = {}
    for name, array in arrays.items():
        paths[name] = os.path.join(directory, f"{name}.npy")
        np.save(paths[name], array)
    return paths


def bounds_of(n: int) -> list[int]:
    """Where each cache's rows start, and the end: sizes in ``SHARES``' ratio."""
    cuts = [0]
    for share in SHARES[:-1]:
        cuts.append(cuts[-1] + n * share // sum(SHARES))
    return [*cuts, n]


def run_mixture(cfg: Config, results: Results) -> None:
    """Each workload: the mixture against one cache of the same rows (targets), its per-batch composition and the
    cost of drawing an epoch's plan (rows), against ``ConcatDataset`` where it applies, and with two workers."""
    for w in WORKLOADS:
        n = cfg.size(w.n, w.quick_n)
        with workspace(f"mixture-{w.name}") as tmp:
            paths = write_data(tmp, w, n)
            cuts = bounds_of(n)
            ragged = ["0"] if w.ragged else None
            caches = {name: MmapCachedDataset(os.path.join(tmp, name), Rows(paths, cuts[k], cuts[k + 1]),
                                              fingerprint=f"{w.name}-{name}", ragged=ragged)
                      for k, name in enumerate(NAMES)}
            one = MmapCachedDataset(os.path.join(tmp, "all"), Rows(paths, 0, n), fingerprint=f"{w.name}-all",
                                    ragged=ragged)
            try:
                for ds in (*caches.values(), one):
                    ds.fill()
                sizes = ", ".join(f"{name} {len(ds):,}" for name, ds in caches.items())
                print(f"  {w.title}: caches {sizes} (one cache: {n:,} rows) in {tmp}", flush=True)
                data = {name: np.load(path, mmap_mode="r") for name, path in paths.items()}
                alone(w, cfg, results, caches, one, data)
                workers(w, cfg, results, caches, one)
            finally:
                for ds in (*caches.values(), one):
                    ds.close()


def _concat(caches: dict[str, MmapCachedDataset], mix: Mixture, batch: int, **kwargs: Any) -> DataLoader:
    """What users write without a mixture: the caches concatenated, each sample weighted by its cache's share of an
    epoch over its length, ``len(mix)`` samples an epoch (drawn with replacement)."""
    counts = mix.counts()
    weights = torch.cat([torch.full((len(ds),), counts[name] / len(ds), dtype=torch.float64)
                         for name, ds in caches.items()])
    sampler = WeightedRandomSampler(weights, num_samples=len(mix), generator=torch.Generator().manual_seed(39))
    return DataLoader(ConcatDataset(list(caches.values())), batch_size=batch, sampler=sampler, **kwargs)


def alone(w: MixWorkload, cfg: Config, results: Results, caches: dict[str, MmapCachedDataset],
          one: MmapCachedDataset, data: dict[str, np.ndarray]) -> None:
    """``num_workers=0``: the targets, and rows for the per-batch composition and an epoch's plan."""
    b = w.batch or cfg.batch
    n = len(one)
    pad = PadCollate(0) if w.ragged else None
    mix = Mixture(caches, seed=39)
    loaders = {"mix": mix.loader(batch_size=b, collate_fn=pad),
               "one": one.loader(batch_size=b, shuffle=True, collate_fn=pad),
               "per_batch": Mixture(caches, per_batch=True, seed=39).loader(batch_size=b, collate_fn=pad)}
    if w.concat:
        loaders["concat"] = _concat(caches, mix, b)
    cuts = bounds_of(n)
    for side, loader in loaders.items():
        check(w, side, loader, data, b, whole_epoch=n if side != "concat" else None)
    check_sources(w, mix.loader(batch_size=b, collate_fn=pad, return_source=True), data, b, cuts)
    sides = [Side(f"{w.name}.{name}", epoch(loader), n) for name, loader in loaders.items()]
    sides.append(Side(f"{w.name}.plan", plans(mix, b), 1))
    cmp = interleave(sides, cfg.rounds, min_time=cfg.min_time)
    title = f"{w.title}, 3 caches"
    collate = ", PadCollate(0)" if w.ragged else ""
    labels = {f"{w.name}.mix": f"{title}: Mixture(...).loader(){collate}, nw=0",
              f"{w.name}.one": f"{w.title}: one cache of all the rows, ds.loader(shuffle=True){collate}, nw=0",
              f"{w.name}.per_batch": f"{title}: Mixture(..., per_batch=True).loader(){collate}, nw=0",
              f"{w.name}.concat": f"{title}: ConcatDataset + WeightedRandomSampler + DataLoader, nw=0"}
    rates = Comparison({name: cmp.sides[name] for name in labels if name in cmp.sides}, cmp.loads)
    results.sides("mixture", rates, labels, note=f"N={n}, batch {b}")
    results.compared(f"mixture.{w.name}_vs_one", cmp, f"{w.name}.mix", f"{w.name}.one", f"N={n}, batch {b}")
    if w.concat:
        results.compared(f"mixture.{w.name}_vs_concat", cmp, f"{w.name}.mix", f"{w.name}.concat", f"N={n}, batch {b}")
    info(results, "mixture", cmp, f"{w.name}.per_batch", f"{w.name}.mix",
         f"{title}: per_batch=True vs a random mix")
    plan_s = 1 / cmp.rate(f"{w.name}.plan")
    epoch_s = n / cmp.rate(f"{w.name}.mix")
    results.row("mixture", f"{title}: drawing an epoch's plan (loader.sampler.plan)", plan_s * 1e3, "ms",
                f"{plan_s / epoch_s:.1%} of the mixture's epoch; best of {cfg.rounds} interleaved rounds", cmp.load())


def plans(mix: Mixture, batch: int) -> Any:
    """One epoch's plan drawn per call, a new epoch each time (the sampler keeps the plan of the pass in flight)."""
    sampler = mix.loader(batch_size=batch).sampler
    counts = mix.counts_now()
    drawn = [0]

    def run() -> None:
        drawn[0] += 1
        sampler.plan(MixPass(drawn[0], 0, counts, batch))
    return run


def workers(w: MixWorkload, cfg: Config, results: Results, caches: dict[str, MmapCachedDataset],
            one: MmapCachedDataset) -> None:
    """The same loaders with two persistent workers (no target: on 2 cores the workers share them with us)."""
    b = w.batch or cfg.batch
    kw: dict[str, Any] = {"num_workers": 2, "persistent_workers": True}
    pad = PadCollate(0) if w.ragged else None
    mix = Mixture(caches, seed=39)
    loaders = {f"{w.name}.mix_nw2": mix.loader(batch_size=b, collate_fn=pad, **kw),
               f"{w.name}.one_nw2": one.loader(batch_size=b, shuffle=True, collate_fn=pad, **kw)}
    if w.concat:
        loaders[f"{w.name}.concat_nw2"] = _concat(caches, mix, b, **kw)
    n = len(one)
    # No target here, so fewer rounds; the warm-up round starts the workers.
    cmp = interleave([Side(name, epoch(loader), n) for name, loader in loaders.items()], min(cfg.rounds, 3),
                     min_time=cfg.min_time)
    del loaders
    title = f"{w.title}, 3 caches"
    labels = {f"{w.name}.mix_nw2": f"{title}: Mixture(...).loader(), nw=2",
              f"{w.name}.one_nw2": f"{w.title}: one cache of all the rows, ds.loader(shuffle=True), nw=2",
              f"{w.name}.concat_nw2": f"{title}: ConcatDataset + WeightedRandomSampler, nw=2"}
    results.sides("mixture", cmp, labels, note=f"N={n}, batch {b}")
    info(results, "mixture", cmp, f"{w.name}.mix_nw2", f"{w.name}.one_nw2",
         f"{title}: Mixture.loader vs one cache's ds.loader, nw=2")


# --- the sides do the same work ---------------------------------------------------------------------------------


def _unpack(w: MixWorkload, batch: Any) -> tuple[list[np.ndarray], np.ndarray]:
    """A batch's values (one array per sample, its real length for token ids) and labels."""
    values, labels = batch
    if w.ragged:
        padded, lengths = values.data.numpy(), values.lengths.tolist()
        if padded.shape[1] != max(lengths) or any((padded[k, m:] != 0).any() for k, m in enumerate(lengths)):
            raise AssertionError(f"{w.title}: a batch is not padded with 0 to its longest value")
        return [padded[k, :m] for k, m in enumerate(lengths)], labels.numpy()
    return list(values.numpy()), labels.numpy()


def check(w: MixWorkload, side: str, loader: Any, data: dict[str, np.ndarray], batch: int,
          whole_epoch: int | None) -> None:
    """The first batches hold ``batch`` samples each, each sample the values of the row its label names; with
    ``whole_epoch``, an epoch holds every row once."""
    seen = []
    for k, got in enumerate(loader):
        values, labels = _unpack(w, got)
        if k < CHECKED_BATCHES:
            if len(labels) != batch or len(values) != batch:
                raise AssertionError(f"{w.title} {side}: batch {k} holds {len(labels)} samples, not {batch}")
            for value, label in zip(values, labels.tolist()):
                if not np.array_equal(value, values_of(data, label)):
                    raise AssertionError(f"{w.title} {side}: batch {k}'s sample labelled {label} holds other values")
        elif whole_epoch is None:
            return
        seen.append(labels)
    if whole_epoch is not None:
        read = np.sort(np.concatenate(seen))
        if not np.array_equal(read, np.arange(whole_epoch)):
            raise AssertionError(f"{w.title} {side}: an epoch read {len(read)} samples, not each of {whole_epoch} "
                                 "rows once")


def check_sources(w: MixWorkload, loader: Any, data: dict[str, np.ndarray], batch: int, cuts: list[int]) -> None:
    """The mixture says each sample's source, and the sample is that cache's (its label among its rows)."""
    for k, (got, sources) in enumerate(loader):
        if k == CHECKED_BATCHES:
            return
        _, labels = _unpack(w, got)
        expected = np.searchsorted(np.asarray(cuts), labels, side="right") - 1
        if len(labels) != batch or not np.array_equal(sources.numpy(), expected):
            raise AssertionError(f"{w.title}: mixture batch {k}: sources {sources.tolist()} for labels "
                                 f"{labels.tolist()} (caches start at rows {cuts[:-1]})")
