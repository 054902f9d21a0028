"""The mmapcache benchmark: warm and cold read rates, memory, build scaling, locking and features, in one run.

Usage::

    python tools/bench.py [--n 50000] [--shape 3,64,64] [--batch-size 256] [--quick] [--out docs/bench]
                          [--only GROUP,GROUP] [--no-stocaching]

Every row runs in this process tree on the same data: ``N`` random uint8 images of ``--shape`` with int labels,
written once to ``/dev/shm``. Results go to ``OUT/results.json``, ``OUT/results.md`` (the table printed at the
end) and ``OUT/results.png``. Ratios against the project's targets are computed from rows of the same run, so they
hold on any machine; absolute numbers depend on it (recorded in the JSON: CPU, cores, RAM, load, versions).
Groups: raw, baselines, stocaching, mmapcache, per_sample, cold, memory, build, lock, features.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
sys.path.insert(0, TOOLS)  # bench_sources, importable here and (through sys.path) in spawned processes

import bench_sources as src  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from mmapcache import MmapCachedDataset  # noqa: E402
from mmapcache._layout import Layout  # noqa: E402

GROUPS = ("raw", "baselines", "stocaching", "mmapcache", "per_sample", "cold", "memory", "build", "lock", "features")
STOCACHING_VENV = os.path.join(os.path.expanduser("~"), ".cache", "mmapcache-bench", "stocaching-venv")


class Bench:
    """Holds the configuration, the shared data files and the collected rows of one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n: int = args.n
        self.shape: tuple[int, ...] = args.shape
        self.batch: int = args.batch_size
        self.epochs: int = 1 if args.quick else 3
        self.quick: bool = args.quick
        self.rows: list[dict[str, Any]] = []
        self.tmp = os.path.join("/dev/shm", f"mmapcache-bench-{uuid.uuid4().hex[:8]}")

    # --- bookkeeping -------------------------------------------------------------------------------------------

    def row(self, name: str, group: str, value: float | None, unit: str, note: str = "", **extra: Any) -> None:
        status = "ok" if value is not None else "skipped"
        self.rows.append({"name": name, "group": group, "value": value, "unit": unit, "status": status,
                          "note": note, **extra})
        shown = "skipped" if value is None else f"{value:,.1f} {unit}"
        print(f"  {name:<58} {shown}  {note}", flush=True)

    def value(self, name: str) -> float | None:
        for r in self.rows:
            if r["name"] == name:
                return r["value"]
        return None

    # --- data --------------------------------------------------------------------------------------------------

    def make_data(self) -> None:
        os.makedirs(self.tmp)
        rng = np.random.default_rng(0)
        self.images_path = os.path.join(self.tmp, "images.npy")
        self.labels_path = os.path.join(self.tmp, "labels.npy")
        images = np.lib.format.open_memmap(self.images_path, "w+", np.uint8, (self.n, *self.shape))
        step = max(1, (64 << 20) // max(1, int(np.prod(self.shape))))
        for k in range(0, self.n, step):
            images[k:k + step] = rng.integers(0, 256, (min(step, self.n - k), *self.shape), dtype=np.uint8)
        images.flush()
        del images
        np.save(self.labels_path, rng.integers(0, 1000, self.n, dtype=np.int64))
        self.source = src.ArraySource(self.images_path, self.labels_path)
        self.cache_path = os.path.join(self.tmp, "cache")
        start = time.perf_counter()
        self.ds = MmapCachedDataset(self.cache_path, self.source)
        self.ds.fill()
        self.fill_rate = self.n / (time.perf_counter() - start)
        self.image_file = os.path.join(self.cache_path, self.ds._store.meta["fields"][0]["file"])
        self.cache_bytes = sum(os.path.getsize(os.path.join(self.cache_path, f["file"]))
                               for f in self.ds._store.meta["fields"])

    # --- timing helpers ----------------------------------------------------------------------------------------

    def best_rate(self, epoch: Callable[[], Iterable[Any]], count: int, epochs: int | None = None) -> float:
        """Best samples/s over ``epochs`` runs of ``epoch()`` (an iterable consumed to the end)."""
        best = 0.0
        for _ in range(epochs or self.epochs):
            start = time.perf_counter()
            for _ in epoch():
                pass
            best = max(best, count / (time.perf_counter() - start))
        return best

    def loader_rate(self, make: Callable[..., DataLoader], workers: int) -> float:
        """Best warm-epoch rate of a shuffled DataLoader; workers persist, so only the first epoch starts them."""
        loader = make(batch_size=self.batch, shuffle=True, num_workers=workers, persistent_workers=workers > 0)
        epochs = self.epochs + (1 if workers else 0)  # one more when the first epoch pays for starting workers
        rate = self.best_rate(itertools.repeat(loader).__next__, self.n, epochs)  # no closure: `del` frees it
        del loader
        return rate

    # --- rows --------------------------------------------------------------------------------------------------

    def bench_raw(self) -> None:
        images = np.asarray(np.load(self.image_file, mmap_mode="r"))[: self.n]
        out = np.empty((self.batch, *self.shape), np.uint8)
        rng = np.random.default_rng(1)

        def gather() -> Iterable[None]:
            perm = rng.permutation(self.n)
            for k in range(0, self.n, self.batch):
                rows = np.sort(perm[k:k + self.batch])
                np.take(images, rows, axis=0, out=out[: len(rows)], mode="clip")
                yield None

        def copy() -> Iterable[None]:
            for k in range(0, self.n, self.batch):
                part = images[k:k + self.batch]
                np.copyto(out[: len(part)], part)
                yield None

        self.row("raw: sorted np.take gather, preallocated buffer", "raw", self.best_rate(gather, self.n),
                 "samples/s", "the limit of one thread gathering shuffled rows")
        self.row("raw: contiguous memory copy of the same bytes", "raw", self.best_rate(copy, self.n), "samples/s",
                 f"{self.n * int(np.prod(self.shape)) / 1e9:.2f} GB per epoch")

    def bench_baselines(self) -> None:
        images = torch.from_numpy(np.load(self.images_path))
        labels = torch.from_numpy(np.load(self.labels_path))
        td = TensorDataset(images, labels)
        for workers in (0, 2):
            self.row(f"TensorDataset + default collate, nw={workers}", "baselines",
                     self.loader_rate(functools.partial(DataLoader, td), workers), "samples/s",
                     "a private in-memory copy per process")
        del td, images, labels

    def bench_stocaching(self) -> None:
        if self.args.no_stocaching:
            for workers in (0, 2):
                self.row(f"stocaching SharedCache + default collate, nw={workers}", "stocaching", None, "samples/s",
                         "skipped: --no-stocaching")
            return
        python, problem = _stocaching_python()
        result: dict[str, float] = {}
        if python is not None:
            cmd = [python, os.path.join(TOOLS, "bench_stocaching.py"), self.images_path, self.labels_path,
                   str(self.batch), str(self.epochs + 1), "0", "2"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if proc.returncode == 0:
                result = json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                problem = f"skipped: the stocaching run failed: {proc.stderr.strip().splitlines()[-1:]}"
        for workers in (0, 2):
            value = result.get(f"nw{workers}")
            self.row(f"stocaching SharedCache + default collate, nw={workers}", "stocaching", value, "samples/s",
                     "numpy<2 venv, run in a subprocess" if value is not None else problem)

    def bench_mmapcache(self) -> None:
        per_sample = src.PerSample(self.cache_path)
        for workers in (0, 2):
            self.row(f"mmapcache DataLoader(ds) per sample (no __getitems__), nw={workers}", "mmapcache",
                     self.loader_rate(lambda **kw: DataLoader(per_sample, **kw), workers), "samples/s")
        for workers in (0, 2):
            self.row(f"mmapcache DataLoader(ds) via __getitems__, nw={workers}", "mmapcache",
                     self.loader_rate(lambda **kw: DataLoader(self.ds, **kw), workers), "samples/s")
        for workers in (0, 2):
            self.row(f"mmapcache ds.loader(), nw={workers}", "mmapcache",
                     self.loader_rate(lambda **kw: self.ds.loader(**kw), workers), "samples/s")
        per_sample.close()

    def bench_per_sample(self) -> None:
        count = min(self.n, 20000)
        order = np.random.default_rng(2).permutation(self.n)[:count].tolist()
        images = np.asarray(np.load(self.image_file, mmap_mode="r"))
        labels = np.asarray(np.load(os.path.join(self.cache_path, self.ds._store.meta["fields"][1]["file"]),
                                    mmap_mode="r"))
        from_numpy = torch.from_numpy
        ds = self.ds

        def bare() -> Iterable[Any]:
            return ((from_numpy(images[i].copy()), int(labels[i])) for i in order)

        def cached() -> Iterable[Any]:
            return (ds[i] for i in order)

        self.row("bare copy: (from_numpy(images[i].copy()), int(labels[i]))", "per_sample",
                 self.best_rate(bare, count), "samples/s", "shuffled single-sample reads from the memmap")
        self.row("mmapcache ds[i]", "per_sample", self.best_rate(cached, count), "samples/s",
                 "same order; seqlock-checked")

    def bench_cold(self) -> None:
        count = min(self.n, 300 if self.quick else 3000)
        source = src.ArraySource(self.images_path, self.labels_path, delay=1e-3)
        sub = _Prefix(source, count)
        bare_times, cached_times = [], []
        for attempt in range(1 if self.quick else 2):
            start = time.perf_counter()
            for _ in DataLoader(sub, batch_size=self.batch, shuffle=True):
                pass
            bare_times.append(time.perf_counter() - start)
            path = os.path.join(self.tmp, f"cold-{attempt}")
            start = time.perf_counter()
            ds = MmapCachedDataset(path, sub)
            for _ in DataLoader(ds, batch_size=self.batch, shuffle=True):
                pass
            cached_times.append(time.perf_counter() - start)
            ds.close()
            shutil.rmtree(path)
        self.row("cold: bare source (1 ms/sample), one epoch", "cold", count / min(bare_times), "samples/s",
                 f"N={count}, DataLoader(source, batch_size={self.batch}, shuffle=True), best of {len(bare_times)}")
        self.row("cold: first epoch through a new cache", "cold", count / min(cached_times), "samples/s",
                 "cache creation included; every sample is a miss, computed and published")

    def bench_memory(self) -> None:
        # This process must not map the cache while the readers are measured: PSS splits each shared page among
        # every process mapping it, so a mapping here would hide part of the readers' share.
        self.ds.close()
        gc.collect()
        ctx = mp.get_context("spawn")  # fresh processes: nothing inherited from this one
        warm = os.path.join(self.tmp, "memory-warm-up")
        MmapCachedDataset(warm, src.Synthetic(2 * self.batch, self.shape)).fill()
        np.save(warm + ".npy", np.zeros((2 * self.batch, *self.shape), np.uint8))
        modes = {"cache": (self.cache_path, self.cache_bytes),
                 "private": (self.images_path, os.path.getsize(self.images_path))}
        go, leave = ctx.Event(), ctx.Event()
        procs, ready, done = [], [], []
        for mode, (path, _) in modes.items():  # both sets run at once: one start-up wait instead of two
            for _ in range(4):
                ready.append(ctx.Event())
                done.append(ctx.Event())
                procs.append((mode, ctx.Process(target=src.memory_reader,
                                                args=(mode, path, warm, ready[-1], go, done[-1], leave))))
        for _, p in procs:
            p.start()
        try:
            if not all(e.wait(180) for e in ready):
                raise RuntimeError("memory readers did not start within 180 s")
            time.sleep(0.2)
            before = {p.pid: src.pss_kib(p.pid) for _, p in procs}
            go.set()
            if not all(e.wait(300) for e in done):
                raise RuntimeError("memory readers did not finish within 300 s")
            after = {p.pid: src.pss_kib(p.pid) for _, p in procs}
        finally:
            leave.set()
            for _, p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
        for mode, (_path, size) in modes.items():
            growth = sum(after[p.pid] - before[p.pid] for m, p in procs if m == mode) * 1024
            label = "mmapcache (4 processes reading the whole cache)" if mode == "cache" else \
                "private copies (4 processes each loading the array, as TensorDataset)"
            self.row(f"memory: {label}", "memory", growth / size, "x data size",
                     f"sum of PSS growth {growth / 2**20:,.0f} MiB for {size / 2**20:,.0f} MiB of data (each process "
                     "first read a small cache/array, so imports and allocator pools are in its baseline)")
        self.ds = MmapCachedDataset(self.cache_path, self.source)

    def bench_build(self) -> None:
        command = _build_command()
        # A few seconds per worker at least: worker start-up (fork, building the source from its spec) is a fixed
        # cost that real builds of hours never notice, and it would otherwise dominate the ratio.
        n = 200 if self.quick else 6000
        if command is None:
            for workers in (1, 2):
                self.row(f"build: mmapcache build --workers {workers} (CPU-bound source)", "build", None,
                         "samples/s", "skipped: the mmapcache CLI (mmapcache/cli.py) is not available yet")
            return
        kwargs = json.dumps({"n": n, "shape": [3, 32, 32], "work": 20000})
        for workers in (1, 2):
            name = f"build: mmapcache build --workers {workers} (CPU-bound source)"
            path = os.path.join(self.tmp, f"build-{workers}")
            cmd = [*command, "build", path, "--dataset", os.path.join(TOOLS, "bench_sources.py") + ":cpu_bound",
                   "--kwargs", kwargs, "--workers", str(workers)]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
            wall = time.perf_counter() - start
            filled = MmapCachedDataset(path).num_cached if proc.returncode == 0 else 0
            # The CLI's summary: "PATH: filled F, skipped S (already there), failed 0, T s, R samples/s, ...".
            found = re.search(r"filled (\d+), .*?, ([\d.]+) s, ([\d.]+) samples/s", proc.stdout + proc.stderr)
            if proc.returncode != 0 or filled != n or found is None:
                self.row(name, "build", None, "samples/s", f"skipped: exit {proc.returncode}, {filled}/{n} filled, "
                         f"summary {'found' if found else 'not found'}: {(proc.stdout + proc.stderr).strip()[-300:]}")
            else:
                self.row(name, "build", float(found.group(3)), "samples/s",
                         f"N={n}, ~2 ms of Python per sample; rate as the CLI reports it (fill phase); "
                         f"{n / wall:,.0f} samples/s over the whole command ({wall:.1f} s with interpreter start-up)")
            shutil.rmtree(path, ignore_errors=True)

    def bench_lock(self) -> None:
        processes, per_process = 8, 2000
        seconds = 0.5 if self.quick else 3.0
        path = os.path.join(self.tmp, "lock")
        MmapCachedDataset(path, src.Synthetic(processes * per_process, (3, 32, 32))).close()
        ctx = mp.get_context("fork")  # starts in milliseconds; how a process started does not change its rate
        configs = [("flock", 0.0, "the cache's blocking flock"),
                   ("filelock", 0.05, "filelock.FileLock, default 50 ms poll"),
                   ("filelock", 0.001, "filelock.FileLock, 1 ms poll")]
        try:
            import filelock  # noqa: F401
        except ImportError:
            configs = configs[:1]
            self.row("lock: filelock.FileLock", "lock", None, "publishes/s",
                     "skipped: pip install filelock (the bench extra)")
        for mode, poll, label in configs:
            go, out = ctx.Event(), ctx.Queue()
            ready = [ctx.Event() for _ in range(processes)]
            procs = [ctx.Process(target=src.lock_publisher, args=(
                mode, path, list(range(k * per_process, (k + 1) * per_process)), poll, seconds, ready[k], go, out))
                for k in range(processes)]
            for p in procs:
                p.start()
            if not all(e.wait(120) for e in ready):
                raise RuntimeError("lock benchmark processes did not start within 120 s")
            go.set()
            results = [out.get(timeout=120) for _ in procs]
            for p in procs:
                p.join(60)
            count = sum(r[0] for r in results)
            span = max(r[2] for r in results) - min(r[1] for r in results)
            self.row(f"lock: 8 processes publishing, {label}", "lock", count / span, "publishes/s",
                     f"{count} publishes of a {3 * 32 * 32 + 8}-byte row in {span:.2f} s")

    def bench_features(self) -> None:
        n = 200 if self.quick else 2000
        shape = (3, 32, 32)
        source = src.Synthetic(n, shape, delay=1e-3)
        row_bytes = Layout.from_sample(source[0]).row_bytes
        epochs = 1 if self.quick else 2

        def epoch_rate(make: Callable[[], Iterable[Any]], count: int = 1) -> float:
            return self.best_rate(make, n, count)

        self.row("features: source only (1 ms/sample), one shuffled epoch", "features",
                 epoch_rate(lambda: DataLoader(source, batch_size=self.batch, shuffle=True)), "samples/s",
                 f"N={n}, shape {shape}")
        for fraction in (0.25, 0.5, 1.0):
            path = os.path.join(self.tmp, f"partial-{fraction}")
            # The budget also pays for per-row state, so a fraction of the data bytes caches slightly fewer rows;
            # the full row runs without a budget.
            budget = int(fraction * n) * row_bytes if fraction < 1 else None
            ds = MmapCachedDataset(path, source, max_bytes=budget)
            for _ in ds.loader(batch_size=self.batch, shuffle=True):  # fill what fits
                pass
            rate = epoch_rate(lambda: ds.loader(batch_size=self.batch, shuffle=True), epochs)
            self.row(f"features: warm epoch, {fraction:.0%} cached" + (" (max_bytes)" if budget else ""), "features",
                     rate, "samples/s",
                     f"{ds.num_cacheable}/{n} cacheable; misses go to the source")
            ds.close()
            shutil.rmtree(path)
        n_var, epochs_var = (100 if self.quick else 500), 8
        augmented = src.Augmented(n_var, shape, delay=1e-3)
        start = time.perf_counter()
        for _ in range(epochs_var):
            for _ in DataLoader(augmented, batch_size=self.batch, shuffle=True):
                pass
        recompute = time.perf_counter() - start
        path = os.path.join(self.tmp, "variants")
        ds = MmapCachedDataset(path, augmented, variants=4)
        start = time.perf_counter()
        for epoch in range(epochs_var):
            ds.set_epoch(epoch)
            for _ in ds.loader(batch_size=self.batch, shuffle=True):
                pass
        cached = time.perf_counter() - start
        ds.close()
        self.row(f"features: recompute a 1 ms augmentation every epoch ({epochs_var} epochs)", "features",
                 n_var * epochs_var / recompute, "samples/s", f"N={n_var}")
        self.row(f"features: variants=4, augmentation computed once per variant ({epochs_var} epochs)", "features",
                 n_var * epochs_var / cached, "samples/s", "epochs 1-4 fill the 4 variants, epochs 5-8 read them")

    # --- report ------------------------------------------------------------------------------------------------

    def targets(self) -> list[dict[str, Any]]:
        v = self.value
        specs = [
            ("ds.loader() nw=0 vs raw sorted gather", v("mmapcache ds.loader(), nw=0"),
             v("raw: sorted np.take gather, preallocated buffer"), ">=", 0.8),
            ("DataLoader(ds) via __getitems__ nw=0 vs TensorDataset + default collate nw=0",
             v("mmapcache DataLoader(ds) via __getitems__, nw=0"), v("TensorDataset + default collate, nw=0"),
             ">=", 1.3),
            ("ds[i] vs bare copy out of the memmap", v("mmapcache ds[i]"),
             v("bare copy: (from_numpy(images[i].copy()), int(labels[i]))"), ">=", 0.5),
            ("cold first epoch time vs bare source time", v("cold: bare source (1 ms/sample), one epoch"),
             v("cold: first epoch through a new cache"), "<=", 1.03),
            ("memory: 4 readers' PSS vs data size", v("memory: mmapcache (4 processes reading the whole cache)"), 1.0,
             "<=", 1.05),
            ("build: 2 workers vs 1 worker", v("build: mmapcache build --workers 2 (CPU-bound source)"),
             v("build: mmapcache build --workers 1 (CPU-bound source)"), ">=", 1.8),
        ]
        out = []
        for name, a, b, op, want in specs:
            ratio = None if a is None or b is None or not b else a / b
            out.append({"target": name, "ratio": ratio, "op": op, "required": want,
                        "pass": None if ratio is None else (ratio >= want if op == ">=" else ratio <= want)})
        return out

    def report(self, out_dir: str, elapsed: float) -> dict[str, Any]:
        result = {"machine": machine(), "config": {"n": self.n, "shape": list(self.shape), "batch_size": self.batch,
                                                    "quick": self.quick, "epochs_best_of": self.epochs,
                                                    "elapsed_s": round(elapsed, 1),
                                                    "fill_rate_samples_per_s": self.fill_rate,
                                                    "command": " ".join([os.path.relpath(sys.argv[0], ROOT),
                                                                         *sys.argv[1:]])},
                  "rows": self.rows, "targets": self.targets()}
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(result, f, indent=1)
        text = markdown(result)
        with open(os.path.join(out_dir, "results.md"), "w") as f:
            f.write(text)
        try:
            plot(result, os.path.join(out_dir, "results.png"))
        except ImportError:  # the plot is the only part needing matplotlib (the `bench` extra); numbers still count
            print("no plot: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        print()
        print(text)
        return result


class _Prefix(torch.utils.data.Dataset):
    """The first ``n`` samples of a dataset."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner, self.n = inner, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return self.inner[index]


def _stocaching_python() -> tuple[str | None, str]:
    """The interpreter of a venv with stocaching and numpy<2 (created on first use), or None and why not."""
    python = os.path.join(STOCACHING_VENV, "bin", "python")
    probe = [python, "-c", "import stocaching, numpy, torch; assert numpy.__version__ < '2'"]
    if os.path.exists(python) and subprocess.run(probe, capture_output=True).returncode == 0:
        return python, ""
    try:
        # System site-packages give the venv this machine's torch; its own numpy<2 shadows the system numpy 2.
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", STOCACHING_VENV], check=True,
                       capture_output=True, timeout=300)
        subprocess.run([python, "-m", "pip", "install", "-q", "numpy<2", "stocaching"], check=True,
                       capture_output=True, timeout=600)
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"skipped: could not create the stocaching venv at {STOCACHING_VENV} ({exc})"
    if subprocess.run(probe, capture_output=True).returncode != 0:
        return None, f"skipped: stocaching does not import in {STOCACHING_VENV}"
    return python, ""


def _build_command() -> list[str] | None:
    """How to run the ``mmapcache`` CLI, or None if it does not exist yet."""
    import importlib.util

    if importlib.util.find_spec("mmapcache.cli") is None or importlib.util.find_spec("mmapcache._build") is None:
        return None
    return [sys.executable, "-c", "import sys; from mmapcache.cli import main; sys.exit(main(sys.argv[1:]))"]


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line.split()[1] for line in f if line.startswith("MemTotal:")))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu or platform.processor(), "cores": os.cpu_count(), "ram_gib": round(mem / 2**20, 1),
            "load_avg_at_start": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "torch": torch.__version__, "numpy": np.__version__, "kernel": platform.release()}


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "skipped"
    if unit == "x data size":
        return f"{value:.2f}x"
    return f"{value:,.0f}"


def markdown(result: dict[str, Any]) -> str:
    m, c = result["machine"], result["config"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM; Python {m['python']}, torch {m['torch']}, "
        f"numpy {m['numpy']}; load average at start {m['load_avg_at_start']}.",
        f"Data: N={c['n']} uint8 images of shape {tuple(c['shape'])} + int64 labels, batch size {c['batch_size']}, "
        f"shuffled; best of {c['epochs_best_of']} warm epochs. Command: `{c['command']}` ({c['elapsed_s']} s).",
        "",
        "| row | value | unit | note |",
        "|---|---:|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {_fmt(r['value'], r['unit'])} | {r['unit']} | {r['note']} |")
    lines += ["", "| target | measured | required | result |", "|---|---:|---:|---|"]
    for t in result["targets"]:
        measured = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}"
        verdict = "n/a" if t["pass"] is None else ("pass" if t["pass"] else "miss")
        lines.append(f"| {t['target']} | {measured} | {t['op']} {t['required']} | {verdict} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["unit"] == "samples/s" and r["value"] and r["group"] in
            ("raw", "baselines", "stocaching", "mmapcache", "per_sample")]
    colors = {"raw": "#999999", "baselines": "#d62728", "stocaching": "#ff7f0e", "mmapcache": "#1f77b4",
              "per_sample": "#2ca02c"}
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.4))
    ax.barh(range(len(rows)), [r["value"] for r in rows], color=[colors[r["group"]] for r in rows])
    ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("samples/s (warm, shuffled; higher is better)")
    c = result["config"]
    ax.set_title(f"mmapcache warm read rates: N={c['n']}, {tuple(c['shape'])} uint8, batch {c['batch_size']} "
                 f"({result['machine']['cores']} cores)", fontsize=9)
    for k, r in enumerate(rows):
        ax.text(r["value"], k, f" {r['value']:,.0f}", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape must be comma-separated integers like 3,64,64, "
                                         f"got {text!r}") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--shape must be positive integers, got {text!r}")
    return shape


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50000, help="samples (default 50000)")
    parser.add_argument("--shape", type=_shape, default=(3, 64, 64), help="image shape (default 3,64,64)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="one epoch per row and small side rows (smoke run)")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"), help="output directory")
    parser.add_argument("--only", default="", help=f"comma-separated groups to run, of: {', '.join(GROUPS)}")
    parser.add_argument("--no-stocaching", action="store_true", help="skip the stocaching row (no venv)")
    args = parser.parse_args(argv)
    groups = [g for g in args.only.split(",") if g] or list(GROUPS)
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        parser.error(f"unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    if args.n < args.batch_size:
        parser.error(f"--n ({args.n}) must be at least --batch-size ({args.batch_size})")
    bench = Bench(args)
    started = time.perf_counter()
    try:
        print(f"preparing N={args.n} samples of {args.shape} in {bench.tmp} ...", flush=True)
        bench.make_data()
        for group in GROUPS:
            if group in groups:
                print(f"[{group}]", flush=True)
                getattr(bench, f"bench_{group}")()
        bench.ds.close()
    finally:
        shutil.rmtree(bench.tmp, ignore_errors=True)
    bench.report(args.out, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
