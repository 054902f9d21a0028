"""The side groups: memory (PSS), build scaling, lock contention, features (partial caching, variants), stocaching.

Each builds what it needs in its own ``workspace``. The ones that produce ratios measure their sides interleaved
(``bench_core.interleave``), like the workload groups; stocaching runs in its own virtual environment and is
reported as absolute rows only.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from typing import Any

import bench_sources as src
import numpy as np
from bench_core import Config, Results, Side, Timed, interleave, load_now
from bench_reads import epoch
from bench_workloads import IMAGES12K, workspace, write_fields
from torch.utils.data import DataLoader

from mmapcache import MmapCachedDataset
from mmapcache.format.layout import Layout

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
STOCACHING_VENV = os.path.join(os.path.expanduser("~"), ".cache", "mmapcache-bench", "stocaching-venv")


def run_memory(cfg: Config, results: Results) -> None:
    """Four processes reading the whole cache against four each holding a private copy: summed PSS growth."""
    n = cfg.size(IMAGES12K.n, IMAGES12K.quick_n)
    shape = IMAGES12K.fields["image"][0]
    readers = 2 if cfg.quick else 4
    with workspace("memory") as tmp:
        paths = write_fields(tmp, IMAGES12K, n)
        cache = os.path.join(tmp, "cache")
        # This process must not map the cache while the readers are measured: PSS splits each shared page among
        # every process mapping it, so a mapping here would hide part of the readers' share.
        with MmapCachedDataset(cache, src.FieldSource(paths)) as ds:
            ds.fill()
            cache_bytes = sum(os.path.getsize(os.path.join(cache, f["file"])) for f in ds._store.meta["fields"])
        gc.collect()
        # Fresh processes, nothing inherited from this one: forked from a server process that imported torch once
        # (spawning each reader would import it once per reader, seconds each on a small machine).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["bench_sources"])
        warm = os.path.join(tmp, "memory-warm-up")
        MmapCachedDataset(warm, src.Synthetic(2 * cfg.batch, shape)).fill()
        np.save(warm + ".npy", np.zeros((2 * cfg.batch, *shape), np.uint8))
        modes = {"cache": (cache, cache_bytes), "private": (paths["image"], os.path.getsize(paths["image"]))}
        go, leave = ctx.Event(), ctx.Event()
        procs, ready, done = [], [], []
        for mode, (path, _) in modes.items():  # both sets run at once: one start-up wait instead of two
            for _ in range(readers):
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
    load = load_now()
    ratios = {}
    for mode, (_path, size) in modes.items():
        growth = sum(after[p.pid] - before[p.pid] for m, p in procs if m == mode) * 1024
        ratios[mode] = growth / size
        label = f"mmapcache ({readers} processes reading the whole cache)" if mode == "cache" else \
            f"private copies ({readers} processes each loading the array, as TensorDataset)"
        results.row("memory", f"memory: {label}", growth / size, "x data size",
                    f"sum of PSS growth {growth / 2**20:,.0f} MiB for {size / 2**20:,.0f} MiB of data (each process "
                    "first read a small cache/array, so imports and allocator pools are in its baseline)", load)
    results.target("memory.pss", ratios["cache"], load, f"N={n} 12 KB images, {readers} readers")


def run_build(cfg: Config, results: Results) -> None:
    """``mmapcache build`` with 1 and 2 workers over a CPU-bound source, runs interleaved; the CLI's own rate."""
    # A few seconds per worker at least: worker start-up (fork, building the source from its spec) is a fixed
    # cost that real builds of hours never notice, and it would otherwise dominate the ratio.
    n = 200 if cfg.quick else 6000
    command = [sys.executable, "-c", "import sys; from mmapcache.cli import main; sys.exit(main(sys.argv[1:]))"]
    kwargs = json.dumps({"n": n, "shape": [3, 32, 32], "work": 20000})
    walls: dict[int, list[float]] = {1: [], 2: []}
    with workspace("build") as tmp:
        def build(workers: int) -> Timed:
            path = os.path.join(tmp, f"build-{workers}-{uuid.uuid4().hex[:8]}")
            cmd = [*command, "build", path, "--dataset", os.path.join(TOOLS, "bench_sources.py") + ":cpu_bound",
                   "--kwargs", kwargs, "--workers", str(workers)]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
            walls[workers].append(time.perf_counter() - start)
            filled = MmapCachedDataset(path).num_cached if proc.returncode == 0 else 0
            shutil.rmtree(path, ignore_errors=True)
            # The CLI's summary: "PATH: filled F, skipped S (already there), failed 0, T s, R samples/s, ...".
            found = re.search(r"filled (\d+), .*?, ([\d.]+) s, ([\d.]+) samples/s", proc.stdout + proc.stderr)
            if proc.returncode != 0 or filled != n or found is None:
                raise RuntimeError(f"build --workers {workers}: exit {proc.returncode}, {filled}/{n} filled: "
                                   f"{(proc.stdout + proc.stderr).strip()[-300:]}")
            return Timed(n, n / float(found.group(3)))

        cmp = interleave([Side(f"w{k}", lambda k=k: build(k), n, autorange=False) for k in (1, 2)],
                         1 if cfg.quick else min(cfg.rounds, 2), warmup=0)
    results.sides("build", cmp, {f"w{k}": f"build: mmapcache build --workers {k} (CPU-bound source)" for k in (1, 2)},
                  note=f"N={n}, ~2 ms of Python per sample; the CLI's fill-phase rate; whole commands "
                       f"{min(walls[1]):.1f} s / {min(walls[2]):.1f} s with interpreter start-up")
    results.compared("build.scaling", cmp, "w2", "w1")


def run_lock(cfg: Config, results: Results) -> None:
    """8 processes publishing under the cache's blocking flock against filelock, configurations in turn."""
    processes, per_process = 8, 2000
    seconds = 0.3 if cfg.quick else 3.0
    configs = {"flock": ("flock", 0.0, "the cache's blocking flock"),
               "filelock50": ("filelock", 0.05, "filelock.FileLock, default 50 ms poll"),
               "filelock1": ("filelock", 0.001, "filelock.FileLock, 1 ms poll")}
    try:
        import filelock  # noqa: F401
    except ImportError:
        configs = {"flock": configs["flock"]}
        results.row("lock", "lock: filelock.FileLock", None, "publishes/s",
                    "skipped: pip install filelock (the bench extra)")
    ctx = mp.get_context("fork")  # starts in milliseconds; how a process started does not change its rate
    with workspace("lock") as tmp:
        path = os.path.join(tmp, "lock")
        MmapCachedDataset(path, src.Synthetic(processes * per_process, (3, 32, 32))).close()

        def publish(mode: str, poll: float) -> Timed:
            go, out = ctx.Event(), ctx.Queue()
            ready = [ctx.Event() for _ in range(processes)]
            procs = [ctx.Process(target=src.lock_publisher, args=(
                mode, path, list(range(k * per_process, (k + 1) * per_process)), poll, seconds, ready[k], go, out))
                for k in range(processes)]
            for p in procs:
                p.start()
            try:
                if not all(e.wait(120) for e in ready):
                    raise RuntimeError("lock benchmark processes did not start within 120 s")
                go.set()
                done = [out.get(timeout=120) for _ in procs]
            finally:
                for p in procs:
                    p.join(60)
                    if p.is_alive():
                        p.kill()
            return Timed(sum(r[0] for r in done), max(r[2] for r in done) - min(r[1] for r in done))

        cmp = interleave([Side(key, lambda mode=mode, poll=poll: publish(mode, poll), autorange=False)
                          for key, (mode, poll, _) in configs.items()], 1 if cfg.quick else 3, warmup=0)
    results.sides("lock", cmp, {key: f"lock: 8 processes publishing, {label}" for key, (_, _, label) in
                                configs.items()}, unit="publishes/s", note=f"a {3 * 32 * 32 + 8}-byte row each")
    if "filelock50" in cmp.sides:
        results.row("lock", "ratio lock: flock vs filelock (50 ms poll)", cmp.ratio("flock", "filelock50"), "x",
                    "interleaved, from best rounds", cmp.load())


def run_features(cfg: Config, results: Results) -> None:
    """Partial caching (max_bytes) and variants against the source they save calls to, interleaved."""
    n = 100 if cfg.quick else 2000
    shape = (3, 32, 32)
    b = cfg.batch
    rounds = min(cfg.rounds, 3)
    source = src.Synthetic(n, shape, delay=1e-3)
    row_bytes = Layout.from_sample(source[0]).row_bytes
    with workspace("features") as tmp:
        sides = [Side("source", epoch(DataLoader(source, batch_size=b, shuffle=True)), n)]
        caches = []
        for fraction in (0.25, 0.5, 1.0):
            # The budget also pays for per-row state, so a fraction of the data bytes caches slightly fewer rows;
            # the full row runs without a budget.
            budget = int(fraction * n) * row_bytes if fraction < 1 else None
            ds = MmapCachedDataset(os.path.join(tmp, f"partial-{fraction}"), source, max_bytes=budget)
            for _ in ds.loader(batch_size=b, shuffle=True):  # fill what fits
                pass
            caches.append(ds)
            sides.append(Side(f"{fraction:.0%}", epoch(ds.loader(batch_size=b, shuffle=True)), n))
        cmp = interleave(sides, rounds, min_time=cfg.min_time)
        labels = {"source": "features: source only (1 ms/sample busy CPU), one shuffled epoch"}
        for fraction, ds in zip((0.25, 0.5, 1.0), caches):
            labels[f"{fraction:.0%}"] = f"features: warm epoch, {fraction:.0%} cached" + (
                " (max_bytes)" if fraction < 1 else "") + f", {ds.num_cacheable}/{n} cacheable"
            ds.close()
        results.sides("features", cmp, labels, note="misses go to the source")
        for key in ("25%", "50%"):
            results.row("features", f"ratio features: {key} cached vs source only", cmp.ratio(key, "source"), "x",
                        "interleaved, from best rounds", cmp.load())

        n_var, epochs = (50 if cfg.quick else 500), 8
        augmented = src.Augmented(n_var, shape, delay=1e-3)

        def recompute() -> None:
            for _ in range(epochs):
                for _ in DataLoader(augmented, batch_size=b, shuffle=True):
                    pass

        def variants() -> Timed:
            path = os.path.join(tmp, f"variants-{uuid.uuid4().hex[:8]}")
            start = time.perf_counter()
            ds = MmapCachedDataset(path, augmented, variants=4)
            for e in range(epochs):
                ds.set_epoch(e)
                for _ in ds.loader(batch_size=b, shuffle=True):
                    pass
            seconds = time.perf_counter() - start
            ds.close()
            shutil.rmtree(path)
            return Timed(n_var * epochs, seconds)

        cmp = interleave([Side("recompute", recompute, n_var * epochs, autorange=False),
                          Side("variants", variants, autorange=False)], rounds, warmup=0)
    results.sides("features", cmp, {
        "recompute": f"features: recompute a 1 ms augmentation every epoch ({epochs} epochs, N={n_var})",
        "variants": f"features: variants=4, augmentation computed once per variant ({epochs} epochs)"})
    results.row("features", "ratio features: variants=4 vs recompute", cmp.ratio("variants", "recompute"), "x",
                "epochs 1-4 fill the 4 variants, epochs 5-8 read them", cmp.load())


def run_stocaching(cfg: Config, results: Results) -> None:
    """stocaching's SharedCache (a numpy<2 venv, in a subprocess): absolute rows, not interleaved, no ratio."""
    names = {w: f"stocaching SharedCache + default collate, nw={w} (12 KB images)" for w in (0, 2)}
    if cfg.no_stocaching:
        for name in names.values():
            results.row("stocaching", name, None, "samples/s", "skipped: --no-stocaching")
        return
    python, problem = _stocaching_python()
    result: dict[str, float] = {}
    if python is not None:
        n = cfg.size(IMAGES12K.n, IMAGES12K.quick_n)
        with workspace("stocaching") as tmp:
            paths = write_fields(tmp, IMAGES12K, n)
            cmd = [python, os.path.join(TOOLS, "bench_stocaching.py"), paths["image"], paths["label"],
                   str(cfg.batch), str(min(cfg.rounds, 3) + 1), "0", "2"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode == 0:
            result = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            problem = f"skipped: the stocaching run failed: {proc.stderr.strip().splitlines()[-1:]}"
    for w, name in names.items():
        value = result.get(f"nw{w}")
        results.row("stocaching", name, value, "samples/s",
                    "numpy<2 venv, own process: not interleaved with the other rows" if value is not None else problem,
                    load_now())


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


def group_functions() -> dict[str, Any]:
    return {"stocaching": run_stocaching, "memory": run_memory, "build": run_build, "lock": run_lock,
            "features": run_features}
