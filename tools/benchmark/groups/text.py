"""Group ``text`` (issue 40, run on request): HF-shaped text samples read the ways LLM users read them.

A corpus of ``{"input_ids", "attention_mask", "text", "label"}`` samples: int64 token ids of 16..2048 tokens
(lognormal, mean 298), a mask of ones as long, a str of 4 characters a token, an int label; a 20 us source. Every
side runs one torch thread (``torch.set_num_threads(1)``; DataLoader workers run one already), shuffles with a
seeded permutation and pads each batch to its longest sample (or flattens it). Measured:

1. Warm epochs, samples/s and tokens/s (real tokens, not padding), at batch 64 and 256 with ``num_workers`` 0 and
   2: one ``interleave`` per table over the sides in ``READERS``: ``ds.loader`` with ``PadCollate``; with
   ``TextCollate`` (a dict of plain tensors, the mask built from the lengths), padding-free
   (``TextCollate(flatten=True)``) and over a second cache storing the ids as int32 and the mask as ones
   (``store_as``), padded and flat again with ``columns`` (the model's fields only: the texts not read); a list of
   dicts + ``pad_sequence``, HF ``datasets``, litdata; and three floors: a numpy gather into a zeroed padded array,
   and (for flat batches) a raw gather of the token values from the cache's heap file, with the texts' bytes and
   without.
   Before any timing, every side's batches for the same indices are checked equal to the floor's. Targets: both
   mmapcache padded sides against the list of dicts and HF; the flat side against the heap gather (without workers:
   the floor is one process).
2. Memory: the plain and the narrowed cache's bytes on ``/dev/shm`` (du) and their heaps' used bytes (describe),
   the values' own bytes, HF's Arrow files' bytes.
3. Cold: a new cache's first ``ds.loader`` epoch against the bare source through a DataLoader; ``ds[i]`` on a new
   cache, microseconds over the source; ``mmapcache.build`` with 2 workers against 1 on a CPU-bound text source.

The corpus and its sources are in ``text_corpus``; what a side is in ``text_reader``; the sides in ``text_sides``
and ``text_model_sides`` (``text_sides.READERS``: a new side is one entry there).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
import uuid
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

import mmapcache
from benchmark.core import Config, Results, Side, Timed, info, interleave, load_now
from benchmark.groups.text_corpus import (
    SEED,
    SOURCE_DELAY,
    TEXT_N,
    TEXT_QUICK_N,
    Corpus,
    TextSource,
    pad_collate,
    write_corpus,
)
from benchmark.groups.text_model_sides import STORE_AS, narrowed_cache
from benchmark.groups.text_reader import Reader
from benchmark.groups.text_sides import READERS, Floor, Litdata, du, hf_save
from benchmark.workloads import workspace
from mmapcache import MmapCachedDataset, PadCollate

BATCHES = (64, 256)
WORKERS = (0, 2)
COLD_BATCH = 64


def check_batches(readers: Sequence[Reader], floor: Floor, n: int) -> None:
    """Every side's padded values, labels and texts for the same indices, against the floor's (and the corpus's)."""
    batch = min(BATCHES[0], n // 2)
    perm = np.random.default_rng(SEED + 1).permutation(n).tolist()
    index_lists = [perm[:batch], perm[batch:2 * batch]]  # two batches of a shuffled epoch
    expected = floor.batches(index_lists)
    texts = [[floor.corpus.sample(i)["text"] for i in rows] for rows in index_lists]
    for reader in readers:
        if reader.skipped or reader is floor:
            continue
        for k, (got, want) in enumerate(zip(reader.batches(index_lists), expected, strict=True)):
            for field in ("input_ids", "attention_mask", "labels"):
                value = got[field]
                if value.dtype != torch.int64 or not torch.equal(value, want[field]):
                    raise AssertionError(f"{reader.name}: batch {k}'s {field} differs from the floor's "
                                         f"({value.dtype}, shape {tuple(value.shape)} vs {tuple(want[field].shape)})")
            if got["text"] is not None and list(got["text"]) != texts[k]:
                raise AssertionError(f"{reader.name}: batch {k}'s texts differ from the corpus's")


def run_text(cfg: Config, results: Results) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with workspace("text") as tmp:
            corpus = write_corpus(tmp, cfg.size(TEXT_N, TEXT_QUICK_N))
            print(f"  data: N={corpus.n} samples, {corpus.tokens:,} tokens (mean {corpus.tokens / corpus.n:.0f}) in "
                  f"{tmp}", flush=True)
            ds = MmapCachedDataset(os.path.join(tmp, "cache"), TextSource(corpus.paths))
            try:
                ds.fill()
                _warm(cfg, results, corpus, tmp, ds)
                _memory(results, corpus, tmp, ds)
            finally:
                ds.close()
            _cold(cfg, results, corpus, tmp)
            _build(cfg, results, corpus, tmp)
    finally:
        torch.set_num_threads(threads)


def _warm(cfg: Config, results: Results, corpus: Corpus, tmp: str, ds: MmapCachedDataset) -> None:
    readers: list[Reader] = []
    try:
        for make in READERS:
            started = time.perf_counter()
            readers.append(make(corpus, tmp, ds))
            print(f"  side {make.name}: ready in {time.perf_counter() - started:.1f} s"
                  f"{' (' + readers[-1].skipped + ')' if readers[-1].skipped else ''}", flush=True)
        floor = next(r for r in readers if isinstance(r, Floor))
        check_batches(readers, floor, corpus.n)
        litdata = next((r for r in readers if isinstance(r, Litdata) and not r.skipped), None)
        if litdata is not None:
            results.row("text", "litdata: optimize() of the corpus (1 worker), seconds", litdata.optimize_s, "s",
                        f"N={corpus.n}, in its own process", load_now())
        mean = corpus.tokens / corpus.n
        for workers in WORKERS:
            for batch in BATCHES:
                _table(cfg, results, readers, batch, workers, corpus.n, mean)
    finally:
        for reader in readers:
            reader.close()


def _table(cfg: Config, results: Results, readers: list[Reader], batch: int, workers: int, n: int,
           mean: float) -> None:
    where = f"b{batch} nw{workers}"
    sides = [Side(r.name, r.epoch(batch, workers), n) for r in readers if not r.skipped]
    try:
        cmp = interleave(sides, cfg.rounds, min_time=cfg.min_time)
    finally:
        for reader in readers:
            reader.release()
    labels = {r.name: f"text {where}: {r.label}" for r in readers}
    note = f"N={n}, batch {batch}, num_workers={workers}, padded to each batch's longest, 1 torch thread"
    results.sides("text", cmp, labels, note=note)
    for reader in readers:
        if reader.skipped:
            results.row("text", labels[reader.name], None, "samples/s", reader.skipped)
        else:
            results.row("text", f"{labels[reader.name]}, tokens/s", cmp.rate(reader.name) * mean, "tokens/s",
                        f"best round's samples/s x {mean:.1f} tokens a sample (padding not counted)", cmp.load())
    for side, key in (("mmapcache", ""), ("dict", "dict_")):  # PadCollate's Padded, TextCollate's plain tensors
        for other in ("list", "hf"):
            if other in cmp.sides:
                results.compared(f"text.b{batch}.nw{workers}.{key}vs_{other}", cmp, side, other, note)
        info(results, "text", cmp, side, "floor", f"text {where}: {side} vs the numpy floor")
    # The flat floor is one process: a target without workers only (with them it measures the DataLoader's hand-off).
    if workers == 0:
        results.compared(f"text.b{batch}.nw0.flat_vs_floor", cmp, "flat", "flatfloor", note)
    else:
        info(results, "text", cmp, "flat", "flatfloor", f"text {where}: flat vs the flat floor (heap gather)")
    info(results, "text", cmp, "narrowed", "dict", f"text {where}: narrowed cache vs the plain one, both TextCollate")
    # columns=: the model's fields only, the texts not read (no targets: the rows above hold those).
    for other in ("list", "hf"):
        info(results, "text", cmp, "tokens", other, f"text {where}: TextCollate(columns=model's) vs {other}")
    info(results, "text", cmp, "tokens", "dict", f"text {where}: TextCollate(columns=model's) vs all fields")
    info(results, "text", cmp, "flattokens", "flattokensfloor",
         f"text {where}: flat, columns=model's, vs the flat floor of the tokens")


def _memory(results: Results, corpus: Corpus, tmp: str, ds: MmapCachedDataset) -> None:
    load = load_now()
    cache = du(ds.path)
    values = corpus.ids.nbytes + corpus.mask.nbytes + corpus.text.nbytes + corpus.labels.nbytes
    note = f"N={corpus.n}"
    results.row("text", "text memory: the values' own bytes (int64 ids and mask, utf-8 text, int64 label)", values,
                "bytes", note, load)
    results.row("text", "text memory: mmapcache cache on /dev/shm (du)", cache, "bytes", note, load)
    results.row("text", "ratio text memory: cache bytes vs the values' bytes", cache / values, "x", note, load)
    narrowed = narrowed_cache(corpus, tmp)
    try:
        narrow = du(narrowed.path)
        heaps = {name: _heaps(path) for name, path in (("plain", ds.path), ("narrowed", narrowed.path))}
    finally:
        narrowed.close()
    results.row("text", "text memory: narrowed cache (int32 ids, mask as ones) on /dev/shm (du)", narrow, "bytes",
                f"N={corpus.n}, store_as={STORE_AS}", load)
    for name, (used, fields) in heaps.items():
        results.row("text", f"text memory: {name} cache's heaps, used bytes (describe)", used, "bytes", fields, load)
    results.row("text", "ratio text memory: narrowed cache bytes vs the values' bytes", narrow / values, "x", note,
                load)
    results.row("text", "ratio text memory: narrowed cache bytes vs the plain cache's", narrow / cache, "x", note,
                load)
    if importlib.util.find_spec("datasets") is None:
        results.row("text", "text memory: HF datasets Arrow files", None, "bytes", "skipped: pip install datasets")
        return
    path = os.path.join(tmp, "hf-narrow")
    features = hf_save(corpus, path, np.int32, np.int8)
    arrow = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".arrow"))
    shutil.rmtree(path)
    note = f"N={corpus.n}, given int32 input_ids and int8 attention_mask; HF stored: {features}"
    results.row("text", "text memory: HF datasets Arrow files (save_to_disk)", arrow, "bytes", note, load)
    results.target("text.cache_bytes_vs_hf", cache / arrow, load, f"cache {cache:,} B, Arrow {arrow:,} B; {note}")
    results.target("text.narrowed_bytes_vs_hf", narrow / arrow, load,
                   f"narrowed cache {narrow:,} B, Arrow {arrow:,} B; {note}")


def _heaps(path: str) -> tuple[int, str]:
    """The cache's heaps' used bytes (``mmapcache.describe``), and each field's used bytes and elements."""
    fields = [f for f in mmapcache.describe(path)["fields"] if f["heap"] is not None]
    used = sum(f["heap"]["used"] for f in fields)
    return used, ", ".join(f"{f['name']} {f['heap']['used']:,} B ({f.get('stored') or f['dtype']}, "
                           f"{f.get('elements', 0):,} elements)" for f in fields)


def _cold(cfg: Config, results: Results, corpus: Corpus, tmp: str) -> None:
    """A new cache's first ``ds.loader`` epoch against the bare source's, then ``ds[i]`` on a new cache against the
    source, each interleaved."""
    n, b = corpus.n, COLD_BATCH
    source = TextSource(corpus.paths)
    source[0]  # maps the corpus in this process before any timing

    def bare() -> None:
        for _ in DataLoader(source, batch_size=b, shuffle=True, collate_fn=pad_collate):
            pass

    def cached() -> Timed:
        path = os.path.join(tmp, f"cold-{uuid.uuid4().hex[:8]}")
        start = time.perf_counter()
        ds = MmapCachedDataset(path, source)
        for _ in ds.loader(batch_size=b, shuffle=True, collate_fn=PadCollate(0, mask=True)):
            pass
        seconds = time.perf_counter() - start
        ds.close()
        shutil.rmtree(path)  # not timed
        return Timed(n, seconds)

    cmp = interleave([Side("bare", bare, n, autorange=False), Side("cached", cached, n, autorange=False)],
                     cfg.rounds, warmup=0)
    note = f"N={n}, batch {b}, shuffled, {SOURCE_DELAY * 1e6:.0f} us/sample source (busy CPU)"
    results.sides("text", cmp, {"bare": "text cold: bare source, DataLoader + pad_sequence collate, one epoch",
                                "cached": "text cold: new cache + its first ds.loader(PadCollate) epoch"}, note=note)
    results.compared("text.cold", cmp, "bare", "cached", note)

    count = min(n, cfg.size(10000, 500))
    order = np.random.default_rng(SEED + 2).permutation(n)[:count].tolist()

    def read_source() -> None:
        for i in order:
            source[i]

    def getitem() -> Timed:
        ds = MmapCachedDataset(os.path.join(tmp, f"getitem-{uuid.uuid4().hex[:8]}"), source)
        start = time.perf_counter()  # the cache is created (its probes stored) before the clock starts
        for i in order:
            ds[i]
        seconds = time.perf_counter() - start
        ds.close()
        shutil.rmtree(ds.path)
        return Timed(count, seconds)

    cmp = interleave([Side("source", read_source, count, autorange=False),
                      Side("getitem", getitem, autorange=False)], cfg.rounds, warmup=0)
    per = {side: 1e6 / cmp.rate(side) for side in cmp.sides}
    note = f"{count} shuffled reads, source {per['source']:.1f} us a sample, ds[i] {per['getitem']:.1f}"
    results.row("text", "text cold: ds[i] on a new cache, us a sample over the source", per["getitem"] - per["source"],
                "us", note, cmp.load())
    results.target("text.getitem_over_source", per["getitem"] - per["source"], cmp.load(), note)


def _build(cfg: Config, results: Results, corpus: Corpus, tmp: str) -> None:
    """``mmapcache.build`` of a CPU-bound text source (``CpuText``), 2 workers against 1: the marginal rates."""
    n = min(corpus.n, 200 if cfg.quick else 3000)
    elapsed: dict[int, list[float]] = {1: [], 2: []}

    def build(workers: int) -> Timed:
        path = os.path.join(tmp, f"build-{workers}-{uuid.uuid4().hex[:8]}")
        report = mmapcache.build(path, "benchmark.groups.text_corpus:cpu_text", kwargs={"paths": corpus.paths, "n": n},
                                 workers=workers, progress=False)
        shutil.rmtree(path)
        if report.filled != n or not report.ok:
            raise RuntimeError(f"build workers={workers}: {report.summary()}")
        elapsed[workers].append(report.elapsed)
        # From the first chunk's result to the last: no start-up (a build of one chunk has no such span).
        return Timed(*report.steady) if report.steady[1] > 0 else Timed(report.filled, report.elapsed)

    cmp = interleave([Side(f"w{k}", lambda k=k: build(k), autorange=False) for k in (1, 2)],
                     1 if cfg.quick else min(cfg.rounds, 2), warmup=0)
    note = (f"N={n}, Python tokenizer ~{1e6 / cmp.rate('w1'):.0f} us a sample; marginal rates (BuildReport.steady); "
            f"whole builds {min(elapsed[1]):.1f} s / {min(elapsed[2]):.1f} s")
    results.sides("text", cmp, {f"w{k}": f"text build: mmapcache.build(workers={k}), CPU-bound text source"
                                for k in (1, 2)}, note=note)
    results.compared("text.build_scaling", cmp, "w2", "w1", note)
