"""Group ``stocaching``: stocaching's ``SharedCache`` on the 12 KB images, run by ``scripts/stocaching_reader.py`` in
its own virtual environment (stocaching needs numpy < 2) and reported as absolute rows only: not interleaved, no
ratio."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmark.core import Config, Results, load_now
from benchmark.paths import SCRIPTS
from benchmark.workloads import IMAGES12K, workspace, write_fields

STOCACHING_VENV = os.path.join(os.path.expanduser("~"), ".cache", "mmapcache-bench", "stocaching-venv")


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
            cmd = [python, os.path.join(SCRIPTS, "stocaching_reader.py"), paths["image"], paths["label"],
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
