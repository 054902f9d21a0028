"""Starting real torchrun jobs from tests: a free port, a launch in its own session, and its collection."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Starts torchrun in its own session (so a hung job can be killed with all its ranks)."""
    command = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.Popen(command, env={**os.environ, **env, "PYTHONPATH": TESTS, "OMP_NUM_THREADS": "1"},
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
