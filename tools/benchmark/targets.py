"""The project's benchmark targets (issues 11 and 14 and the earlier ones): what is compared, and how it must come out.

Every ratio of a timing is measured with both sides interleaved in one run (``benchmark.core.interleave``); "x" below
is the first side's rate over the second's, unless the text says "time". Kept apart from the code that measures
them, so the test suite can check that a run reports every one of them.
"""

from __future__ import annotations

from typing import NamedTuple


class Target(NamedTuple):
    group: str
    text: str
    op: str  # ">=" or "<="
    required: float


TARGETS: dict[str, Target] = {
    # 12 KB images, 3x64x64 uint8 + int label
    "images12k.loader_vs_raw": Target("images12k", "12 KB images: ds.loader vs raw sorted gather", ">=", 0.8),
    "images12k.getitems_vs_baseline": Target(
        "images12k", "12 KB images: DataLoader(ds) (__getitems__) vs TensorDataset", ">=", 1.3),
    "images12k.getitem_vs_bare": Target("images12k", "12 KB images: ds[i] vs bare copy out of the memmap", ">=", 0.5),
    "images12k.cold": Target("images12k", "12 KB images: cold epoch time, new cache vs 1 ms source", "<=", 1.03),
    # 150 KB images, 3x224x224 uint8 + int label
    "images150k.loader_vs_raw": Target("images150k", "150 KB images: ds.loader vs raw sorted gather", ">=", 0.85),
    "images150k.loader_vs_baseline": Target("images150k", "150 KB images: ds.loader vs TensorDataset", ">=", 2.0),
    "images150k.getitems_vs_baseline": Target(
        "images150k", "150 KB images: DataLoader(ds) (__getitems__) vs TensorDataset", ">=", 1.0),
    # tiny tabular rows, 64 float32 + int label
    "tabular.loader_vs_raw": Target("tabular", "tabular rows: ds.loader vs raw sorted gather", ">=", 0.6),
    "tabular.loader_vs_baseline": Target("tabular", "tabular rows: ds.loader vs TensorDataset", ">=", 2.0),
    "tabular.cold": Target("tabular", "tabular rows: cold epoch time, new cache vs 50 us source", "<=", 1.15),
    # multi-field dict: image 3x96x96 uint8, mask 96x96 uint8, boxes (8, 4) float32, int label (~37 KB)
    "dict.loader_vs_raw": Target("dict", "37 KB dict: ds.loader vs raw sorted gather", ">=", 0.85),
    "dict.loader_vs_baseline": Target("dict", "37 KB dict: ds.loader vs list of dicts", ">=", 2.0),
    "dict.cold": Target("dict", "37 KB dict: cold epoch time, new cache vs 50 us source", "<=", 1.3),
    # issue 14: ragged token ids and str fields
    "tokens.loader_vs_list": Target(
        "tokens", "token ids: ds.loader+PadCollate vs list of tensors+PadCollate", ">=", 1.5),
    "tokens.heap_bytes": Target(
        "tokens", "token ids: heap end + index bytes vs values + index bytes", "<=", 1.15),
    "captions.getitem_vs_list": Target("captions", "str captions: ds[i] vs list[i]", ">=", 1.0),
    # mixtures (issue 39): 3 caches of one structure (sizes 4:2:1) read by one Mixture's loader, default weights
    **{f"mixture.{name}_vs_one": Target(
        "mixture", f"{title}, 3 caches: Mixture.loader vs one cache's ds.loader, same rows", ">=", 0.9)
       for name, title in (("rows64", "64 B rows"), ("images12k", "12 KB images"), ("tokens", "ragged tokens"))},
    "mixture.rows64_vs_concat": Target(
        "mixture", "64 B rows, 3 caches: Mixture.loader vs ConcatDataset+WeightedRandomSampler", ">=", 5.0),
    # issue 12: stream mode, a trainer with a fixed step time, two producers, a ring of a quarter of the dataset
    "stream.wait": Target("stream", "stream: trainer's time waiting for batches / epoch time (worst epoch)", "<=",
                          0.05),
    "stream.fresh": Target("stream", "stream: share of served samples that are fresh computations (worst epoch)",
                           ">=", 1.0),
    # issue 13: node shares (2 nodes simulated as 2 caches on one machine)
    "nodeshare.read_rate": Target("nodeshare", "node share: warm read rate per rank vs a full cache of its size",
                                  ">=", 0.9),
    "nodeshare.source_reads": Target("nodeshare", "node share: source reads in warm epochs", "<=", 0),
    # side groups
    "memory.pss": Target("memory", "memory: readers' summed PSS growth vs data size", "<=", 1.05),
    "build.scaling": Target("build", "build: 2 workers vs 1 worker (CPU-bound source)", ">=", 1.8),
    # issue 38: one producer per node behind its trainers (a group run on request, --only streamnodes)
    "streamnodes.behind_served": Target(
        "streamnodes", "2 nodes, producers behind: their values served (those ahead at the job's end excepted)", ">=",
        0.9),
    "streamnodes.behind_time": Target(
        "streamnodes", "2 nodes, producers behind: epoch time, stream / trainers computing every sample", "<=", 1.0),
    # ways in (issue 28), a group run on request (--only waysin): "x" is time, not rate
    "waysin.fill_64": Target("waysin", "64 B rows: ds.fill() time x the loader's batched misses", "<=", 1.15),
    "waysin.fill_12k": Target("waysin", "12 KB rows: ds.fill() time x the loader's batched misses", "<=", 1.15),
    "waysin.build_64": Target("waysin", "64 B rows: build(workers=1) marginal time x the loader's", "<=", 1.3),
    "waysin.build_12k": Target("waysin", "12 KB rows: build(workers=1) marginal time x the loader's", "<=", 1.3),
    "waysin.build2_64": Target("waysin", "64 B rows: build, 2 workers vs 1 (rate)", ">=", 1.0),
    "waysin.build2_12k": Target("waysin", "12 KB rows: build, 2 workers vs 1 (rate)", ">=", 1.0),
    "waysin.getitem_over_source": Target("waysin", "64 B rows: ds[i] cold, us over the source", "<=", 15.0),
    "waysin.prefill": Target("waysin", "prefill() of 1M 64 B rows, time x a cold ds.loader epoch", "<=", 1.15),
    # text (issue 40), a group run on request (--only text): padded batches of HF-shaped samples, each table's
    # mmapcache side (ds.loader + PadCollate) against what LLM users read the same corpus with
    **{f"text.b{b}.nw{w}.vs_list": Target(
        "text", f"text b{b} nw{w}: ds.loader+PadCollate vs list of dicts+pad_sequence", ">=", 1.5)
       for w in (0, 2) for b in (64, 256)},
    **{f"text.b{b}.nw{w}.vs_hf": Target(
        "text", f"text b{b} nw{w}: ds.loader+PadCollate vs HF datasets+pad_sequence", ">=", 4.0)
       for w in (0, 2) for b in (64, 256)},
    # ... and issue 40's model-ready batches: TextCollate's dict of plain tensors (the mask made from the lengths)
    # against the same two, and its padding-free batches against a raw gather of the token values from the heap
    **{f"text.b{b}.nw{w}.dict_vs_list": Target(
        "text", f"text b{b} nw{w}: ds.loader+TextCollate (dict of tensors) vs list of dicts+pad_sequence", ">=", 1.5)
       for w in (0, 2) for b in (64, 256)},
    **{f"text.b{b}.nw{w}.dict_vs_hf": Target(
        "text", f"text b{b} nw{w}: ds.loader+TextCollate (dict of tensors) vs HF datasets+pad_sequence", ">=", 4.0)
       for w in (0, 2) for b in (64, 256)},
    **{f"text.b{b}.nw0.flat_vs_floor": Target(
        "text", f"text b{b} nw0: ds.loader+TextCollate(flatten=True) vs raw heap gather of the token values", ">=",
        0.9) for b in (64, 256)},
    "text.cache_bytes_vs_hf": Target("text", "text: cache bytes on /dev/shm vs HF Arrow bytes (int32 ids, int8 mask)",
                                     "<=", 1.0),
    "text.narrowed_bytes_vs_hf": Target(
        "text", "text: narrowed cache (store_as int32 ids, mask as ones) bytes vs HF Arrow bytes", "<=", 1.2),
    "text.cold": Target("text", "text: cold epoch time, new cache + ds.loader vs 20 us source", "<=", 1.3),
    "text.getitem_over_source": Target("text", "text: ds[i] cold, us over the 20 us source", "<=", 10.0),
    "text.build_scaling": Target("text", "text: build, 2 workers vs 1 (CPU-bound text source)", ">=", 1.6),
}
