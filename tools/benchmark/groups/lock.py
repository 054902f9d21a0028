"""Group ``lock``: 8 processes publishing rows under the cache's blocking flock against ``filelock``.

Builds what it needs in its own ``workspace``; sides that give a ratio are measured interleaved
(``benchmark.core.interleave``), like the workload groups.
"""

from __future__ import annotations

import multiprocessing as mp
import os

from benchmark import sources as src
from benchmark.core import Config, Results, Side, Timed, interleave
from benchmark.workloads import workspace
from mmapcache import MmapCachedDataset


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
