"""What two cores cannot show, run on a lent GPU machine: ``python3 tools/device_bench.py --out DIR``.

On the text group's corpus (``benchmark.groups.text_corpus``: HF-shaped samples, ragged int64 ids of 16..2048
tokens, mean 298) and on 150 KB images, each with 0 to 12 DataLoader workers, ``pin_memory=True`` and every batch
copied to the GPU (``non_blocking``, one synchronise an epoch):

- padded text batches from ``ds.loader`` (``TextCollate``) vs what users write: a list of dicts in RAM +
  ``pad_sequence``, in a ``DataLoader`` with the same workers;
- images from ``ds.loader`` vs a ``TensorDataset`` holding them in RAM.

Sides are interleaved (A B A B ..., ``benchmark.core.interleave``), workers persistent, one torch thread in the main
process and each worker. Each row gives the median of the rounds and the best. Writes ``DIR/results.md`` and
``DIR/results.json``. ``--quick`` makes everything small (a check of the script on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import torch
from benchmark.core import Side, interleave
from benchmark.groups.text_corpus import pad_collate, write_corpus
from torch.utils.data import DataLoader, Dataset, TensorDataset

from mmapcache import MmapCachedDataset, TextCollate
from mmapcache.format.batch import arrays_of

IMAGE_SHAPE = (3, 224, 224)  # uint8: 150 KB
OUT, FACTS = "", {}  # (set by main)


class Listed(Dataset):
    """A list of samples in RAM: what a user writes to keep a decoded corpus."""

    def __init__(self, samples: list[Any]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        return self.samples[i]


def _to_device(batch: Any, device: torch.device) -> None:
    for tensor in arrays_of(batch):
        if isinstance(tensor, torch.Tensor):
            tensor.to(device, non_blocking=True)


def _epoch(loader: Iterable[Any], device: torch.device | None) -> Callable[[], None]:
    def run() -> None:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(run.epoch)  # type: ignore[attr-defined]
            run.epoch += 1  # type: ignore[attr-defined]
        for batch in loader:
            if device is not None:
                _to_device(batch, device)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize()
    run.epoch = 0  # type: ignore[attr-defined]
    return run


def _row(rows: list[dict[str, Any]], table: str, workers: int, cmp: Any, names: dict[str, str], n: int) -> None:
    rates = {name: [count / seconds for count, seconds in cmp.sides[name].rounds] for name in names}
    median = {name: statistics.median(r) * n for name, r in rates.items()}
    a, b = list(names)
    row = {"table": table, "workers": workers, "load": cmp.load(),
           **{names[k]: round(median[k]) for k in names},
           **{f"{names[k]} (best)": round(max(rates[k]) * n) for k in names},
           "ratio (medians)": round(median[a] / median[b], 3)}
    rows.append(row)
    print(json.dumps(row), flush=True)
    _write(OUT, rows, FACTS)  # (after every row: a run cut short keeps what it measured)


def text(rows: list[dict[str, Any]], workspace: str, n: int, workers: list[int], rounds: int,
         device: torch.device | None) -> None:
    corpus = write_corpus(workspace, n)
    samples = [corpus.sample(i) for i in range(n)]
    ds = MmapCachedDataset(os.path.join(workspace, "text-cache"), Listed(samples))
    ds.fill()
    pin = device is not None and device.type == "cuda"
    for w in workers:
        extra: dict[str, Any] = {"persistent_workers": True} if w else {}
        ours = ds.loader(batch_size=64, shuffle=True, seed=40, collate_fn=TextCollate(0), num_workers=w,
                         pin_memory=pin, **extra)
        theirs = DataLoader(Listed(samples), batch_size=64, shuffle=True, collate_fn=pad_collate, num_workers=w,
                            pin_memory=pin, **extra)
        cmp = interleave([Side("mmapcache", _epoch(ours, device)), Side("list", _epoch(theirs, device))], rounds)
        _row(rows, "text b64: ds.loader + TextCollate vs a list of dicts + pad_sequence, samples/s", w, cmp,
             {"mmapcache": "ds.loader", "list": "list + pad_sequence"}, n)
        del ours, theirs
    ds.close()


def images(rows: list[dict[str, Any]], workspace: str, n: int, workers: list[int], rounds: int,
           device: torch.device | None) -> None:
    pixels = torch.from_numpy(np.random.default_rng(0).integers(0, 255, (n, *IMAGE_SHAPE), dtype=np.uint8))
    labels = torch.arange(n) % 1000
    source = TensorDataset(pixels, labels)
    ds = MmapCachedDataset(os.path.join(workspace, "image-cache"), source)
    ds.fill()
    pin = device is not None and device.type == "cuda"
    for w in workers:
        extra: dict[str, Any] = {"persistent_workers": True} if w else {}
        ours = ds.loader(batch_size=64, shuffle=True, seed=40, num_workers=w, pin_memory=pin, **extra)
        theirs = DataLoader(source, batch_size=64, shuffle=True, num_workers=w, pin_memory=pin, **extra)
        cmp = interleave([Side("mmapcache", _epoch(ours, device)), Side("tensors", _epoch(theirs, device))], rounds)
        _row(rows, "150 KB images b64: ds.loader vs TensorDataset in RAM, samples/s", w, cmp,
             {"mmapcache": "ds.loader", "tensors": "TensorDataset"}, n)
        del ours, theirs
    ds.close()


def _write(out: str, rows: list[dict[str, Any]], facts: dict[str, Any]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"facts": facts, "rows": rows}, f, indent=1)
    lines = ["# Device benchmark", "", "Machine: " + "; ".join(f"{k} {v}" for k, v in facts.items()) + ".", "",
             "Rates are samples/s, the median of the interleaved rounds (best in brackets); every batch is pinned and "
             "copied to the GPU. Load is the 1-minute load average during the measurement.", ""]
    for table in dict.fromkeys(row["table"] for row in rows):
        mine = [row for row in rows if row["table"] == table]
        sides = [k for k in mine[0] if k not in ("table", "workers", "load", "ratio (medians)")
                 and not k.endswith("(best)")]
        lines += [f"## {table}", "", "| workers | " + " | ".join(sides) + " | ratio | load |",
                  "|---:|" + "---:|" * len(sides) + "---:|---|"]
        for row in mine:
            cells = [f"{row[s]:,} ({row[s + ' (best)']:,})" for s in sides]
            lines.append(f"| {row['workers']} | " + " | ".join(cells)
                         + f" | {row['ratio (medians)']:.2f}x | {row['load'][0]}-{row['load'][1]} |")
        lines.append("")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", default="0,2,4,8,12")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="text,images")
    parser.add_argument("--images", type=int, default=10000, help="how many 150 KB images")
    args = parser.parse_args()
    global OUT, FACTS
    torch.set_num_threads(1)
    device = torch.device("cuda") if torch.cuda.is_available() else None
    workers = [int(w) for w in args.workers.split(",")]
    OUT = args.out
    FACTS = facts = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
             "torch": torch.__version__, "numpy": np.__version__,
             "gpu": torch.cuda.get_device_name() if device is not None else "none",
             "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    rows: list[dict[str, Any]] = []
    workspace = tempfile.mkdtemp(prefix="mmapcache-device-", dir="/dev/shm")
    try:
        rounds = 2 if args.quick else args.rounds
        if "text" in args.only:
            text(rows, workspace, 2000 if args.quick else 50000, workers, rounds, device)
        if "images" in args.only:
            images(rows, workspace, 512 if args.quick else args.images, workers, rounds, device)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
        _write(args.out, rows, facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
