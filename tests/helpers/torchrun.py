"""Starting real torchrun jobs from tests: a free port, a launch in its own session, and its collection."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Starts torchrun in its own session (so a hung job can be killed with all its ranks)."""
    command = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.Popen(command, env={**os.environ, **env, "PYTHONPATH": TESTS, "OMP_NUM_THREADS": "1",
                                                   "PYTHONFAULTHANDLER": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=TIMEOUT)
        raise AssertionError(f"torchrun did not finish in {TIMEOUT} s:\n{out[-4000:]}") from None
    assert proc.returncode == 0, out[-4000:]
    return out


def two_nodes(script_args: Callable[[int], list[str]], shm_dir: str) -> str:
    """Runs one job of 2 "nodes" of 2 ranks on loopback: a torchrun per node, each with its own ``MMAPCACHE_DIR``
    (``shm_dir/node0``, ``shm_dir/node1``); ``script_args(node)`` is the script and its arguments. Returns both
    nodes' output; a node left running (the other failed) is killed with its ranks."""
    port = free_port()
    procs = [torchrun(["--nnodes=2", f"--node-rank={node}", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                       f"--master-port={port}", *script_args(node)],
                      {"MMAPCACHE_DIR": os.path.join(shm_dir, f"node{node}")}) for node in (0, 1)]
    try:
        return "".join(finish(proc) for proc in procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=TIMEOUT)


def results(out_dir: str) -> list[dict]:
    """The ranks' result files (``rank<R>.json``) in ``out_dir``, in name order."""
    found = []
    for name in sorted(os.listdir(out_dir)):
        with open(os.path.join(out_dir, name)) as f:
            found.append(json.load(f))
    return found
