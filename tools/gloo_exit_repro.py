"""Does torch's gloo backend still abort ranks at interpreter exit? A check without mmapcache, for the workaround in
``examples/ddp.py`` and ``tests/helpers/rank_exit.py``.

Runs a finished two-node job of plain torch DDP (gloo, CPU; 2 torchrun agents of 2 ranks on loopback; 3 epochs of 2
steps, an all_reduce, a barrier, ``destroy_process_group``) ``RUNS`` times and counts the runs where a rank died
after the job ('terminate called without an active exception', SIGABRT). With torch 2.13.0 on the suite's 2-core
machine beside two busy loops: 2 of 16 runs (4 of 20 with a first version of this job); with ``--exit-at-once``
(``os._exit`` after the job): 0 of 16 (and 0 of 14).

    python3 tools/gloo_exit_repro.py [RUNS] [--exit-at-once]
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys


def rank_body(exit_at_once: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(DataLoader(data, batch_size=8, sampler=sampler)):
            if step == 2:
                break
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        dist.all_reduce(torch.ones(1))
    dist.barrier()
    dist.destroy_process_group()
    if exit_at_once:
        sys.stdout.flush()
        os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    exit_at_once = "--exit-at-once" in argv
    runs = int(next((a for a in argv if a.isdigit()), "20"))
    failed = 0
    for run in range(runs):
        port = free_port()
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                   "--master-addr=127.0.0.1", f"--master-port={port}", __file__, *argv]
        procs = [subprocess.Popen([*command[:3], f"--node-rank={node}", *command[3:]],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True) for node in (0, 1)]
        outs = []
        for proc in procs:
            try:
                outs.append(proc.communicate(timeout=90)[0])
            except subprocess.TimeoutExpired:  # (the other node's agent waits for a rank that died)
                os.killpg(proc.pid, signal.SIGKILL)
                outs.append(proc.communicate()[0] + "\n(killed after 90 s)")
        if any(proc.returncode for proc in procs):
            failed += 1
            aborted = any("terminate called without an active exception" in out for out in outs)
            print(f"run {run}: exit codes {[p.returncode for p in procs]}"
                  f"{', a rank aborted: terminate called without an active exception' if aborted else ''}", flush=True)
    import torch

    print(f"{failed} of {runs} runs failed (torch {torch.__version__}{', ranks exit at once' if exit_at_once else ''})")
    return 0


if __name__ == "__main__":
    if "RANK" in os.environ:
        rank_body("--exit-at-once" in sys.argv)
    else:
        sys.exit(main(sys.argv[1:]))
