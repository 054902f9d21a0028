"""Group ``build``: ``mmapcache build`` (the command line) with 1 and 2 workers over a CPU-bound source.

Builds what it needs in its own ``workspace``; sides that give a ratio are measured interleaved
(``benchmark.core.interleave``), like the workload groups.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid

from benchmark.core import Config, Results, Side, Timed, interleave
from benchmark.paths import PACKAGE, ROOT
from benchmark.workloads import workspace
from mmapcache import MmapCachedDataset


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
            cmd = [*command, "build", path, "--dataset", os.path.join(PACKAGE, "sources.py") + ":cpu_bound",
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
