"""Running real Lightning jobs from tests (``helpers/lightning_script.py``) and reading what they trained on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from helpers.torchrun import TESTS

SCRIPT = os.path.join(TESTS, "helpers", "lightning_script.py")


def fit(*jobs: tuple[str, ...], killed: bool = False) -> None:
    """Runs the jobs ``(out, cache, *options)`` one after the other in one new process (``lightning_script.py``:
    one Lightning start-up for all of them); ``killed``: the last one ends the process with ``--kill-at``."""
    argv: list[str] = []
    for out, cache, *args in jobs:
        os.makedirs(out, exist_ok=True)
        argv += ["--next"] * bool(argv) + [out, cache, *args]
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, SCRIPT, *argv], env=env, capture_output=True, text=True, timeout=300,
                          start_new_session=True)
    assert done.returncode == (-9 if killed else 0), done.stdout[-3000:] + done.stderr[-5000:]


def records(out: str, ranks: int = 2) -> list[dict[str, Any]]:
    """Every training batch's record (``lightning_script.py``'s), rank 0's first."""
    found = []
    for rank in range(ranks):
        with open(os.path.join(out, f"rank{rank}.jsonl")) as f:
            found += [json.loads(line) for line in f]
    return found
