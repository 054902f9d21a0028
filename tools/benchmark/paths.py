"""Where the benchmark's files are: the ``tools`` folder that child processes import this package from, the
repository root, and the scripts other interpreters start by path (torchrun's ranks, stocaching's venv)."""

from __future__ import annotations

import os

PACKAGE = os.path.dirname(os.path.abspath(__file__))  # tools/benchmark
TOOLS = os.path.dirname(PACKAGE)  # on PYTHONPATH, ``benchmark`` imports from here
ROOT = os.path.dirname(TOOLS)
SCRIPTS = os.path.join(PACKAGE, "scripts")
