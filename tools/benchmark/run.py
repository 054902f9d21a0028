"""The benchmark's command line (``tools/bench.py``), its registry of groups and one run of them.

Usage::

    python tools/bench.py [--quick] [--repeat K] [--only GROUP,GROUP] [--rounds N] [--scale F] [--batch-size 256]
                          [--out docs/bench] [--no-stocaching]

Every ratio against a target (``benchmark.targets``) comes from one interleaved measurement (``benchmark.core``):
its sides run in turn, round after round (A B A B ...), the best round of each side counts, and the 1-minute load
average sampled meanwhile is recorded beside it. Each group is a module of ``benchmark.groups``, registered in
``GROUPS`` below; workload groups (``benchmark.groups.fixed`` and the others) build their data, cache and
baselines once in their own ``/dev/shm`` directory, removed when they finish. ``--repeat K`` runs the selected
groups K times (fresh data and fresh caches each time, in this process) and reports each value's median, min, max
and spread. Results go to ``OUT/results.json``, ``OUT/results.md`` (printed at the end) and ``OUT/results.png``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from benchmark.core import Config, Results, set_group, set_profile
from benchmark.groups import (
    build,
    captions,
    features,
    fixed,
    lock,
    memory,
    mixture,
    nodeshare,
    stocaching,
    stream,
    streamnodes,
    text,
    tokens,
    waysin,
)
from benchmark.paths import ROOT
from benchmark.report import machine, summarize, write
from benchmark.workloads import DICT, IMAGES12K, IMAGES150K, TABULAR

# What --help says the command is (the module docstring's first line says what this module owns).
DESCRIPTION = ("The mmapcache benchmark: warm and cold reads on five workloads, memory, build scaling, locking and "
               "features.")

GROUPS: dict[str, Callable[[Config, Results], None]] = {
    # workloads (issues 11 and 14)
    "images12k": functools.partial(fixed.run_fixed, IMAGES12K),
    "images150k": functools.partial(fixed.run_fixed, IMAGES150K),
    "tabular": functools.partial(fixed.run_fixed, TABULAR),
    "dict": functools.partial(fixed.run_fixed, DICT),
    "tokens": tokens.run_tokens,
    "captions": captions.run_captions,
    "mixture": mixture.run_mixture,  # several caches read as one weighted mixture (issue 39)
    "text": text.run_text,  # LLM-shaped samples against what LLM users read them with (issue 40)
    # stream mode (issue 12) and node shares (issue 13)
    "stream": stream.run_stream,
    "streamnodes": streamnodes.run_stream_nodes,  # a stream over 2 nodes (issue 27)
    "nodeshare": nodeshare.run_nodeshare,
    # side groups
    "stocaching": stocaching.run_stocaching,
    "memory": memory.run_memory,
    "build": build.run_build,
    "waysin": waysin.run_ways,  # the ways samples get in (issue 28)
    "lock": lock.run_lock,
    "features": features.run_features,
}


# Groups run only when named in --only: streamnodes starts two torchrun jobs of 4 ranks per round and mode,
# waysin builds start worker processes, and text prepares HF datasets and litdata copies of its corpus and starts
# DataLoader workers for every side (each half a minute of both cores or more even with --quick, which the test
# suite's smoke run of every other group cannot spare).
ON_REQUEST = {"streamnodes", "text", "waysin"}


def run_once(groups: list[str], cfg: Config) -> dict[str, Any]:
    """One run of ``groups``; a group that fails is reported (traceback, ``errors``) and the others still run."""
    results = Results()
    errors = []
    started, load = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
    for group in groups:
        print(f"[{group}]", flush=True)
        group_start = time.perf_counter()
        set_group(group)
        try:
            GROUPS[group](cfg, results)
        except Exception as exc:
            traceback.print_exc()
            errors.append({"group": group, "error": f"{type(exc).__name__}: {exc}"})
        gc.collect()
        print(f"  ({group}: {time.perf_counter() - group_start:.1f} s, load {os.getloadavg()[0]:.2f})", flush=True)
    return {"elapsed_s": round(time.perf_counter() - started, 1), "load_at_start": load,
            "load_at_end": [round(x, 2) for x in os.getloadavg()], "rows": results.rows, "targets": results.targets,
            "errors": errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--quick", action="store_true", help="small data, 2 rounds (the test suite's smoke run)")
    parser.add_argument("--repeat", type=int, default=1, metavar="K",
                        help="run the selected groups K times and report each value's median, min, max and spread")
    parser.add_argument("--only", default="", help=f"comma-separated groups to run, of: {', '.join(GROUPS)} (default: "
                                                   f"all but {', '.join(sorted(ON_REQUEST))})")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds per comparison (default 5, --quick 2)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every workload's sample count")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"), help="output directory")
    parser.add_argument("--no-stocaching", action="store_true", help="skip the stocaching rows (no venv)")
    parser.add_argument("--profile", default="", metavar="GROUP:SIDE,...",
                        help="run these sides' measured rounds under cProfile (e.g. tabular:loader,dict:cached; side "
                             "names are the keys of 'sides' in results.json's runs) and write "
                             "OUT/profile-GROUP-SIDE.txt each; their times, and ratios using them, are then not valid")
    args = parser.parse_args(argv)
    groups = [g for g in args.only.split(",") if g] or [g for g in GROUPS if g not in ON_REQUEST]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        parser.error(f"unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    groups = [g for g in GROUPS if g in groups]
    profiled = set()
    for item in filter(None, args.profile.split(",")):
        group, _, side = item.partition(":")
        if group not in GROUPS or not side:
            parser.error(f"--profile takes GROUP:SIDE,... with GROUP one of {', '.join(GROUPS)}, got {item!r}")
        profiled.add((group, side))
    set_profile(profiled, args.out)
    if args.repeat < 1 or (args.rounds is not None and args.rounds < 1) or args.scale <= 0 or args.batch_size < 1:
        parser.error("--repeat, --rounds and --batch-size must be at least 1, --scale positive")
    cfg = Config(batch=args.batch_size, quick=args.quick, scale=args.scale,
                 rounds=args.rounds or (2 if args.quick else 5), min_time=0.02 if args.quick else 0.5,
                 no_stocaching=args.no_stocaching)
    started = time.perf_counter()
    info = machine()
    runs = []
    for k in range(args.repeat):
        if args.repeat > 1:
            print(f"=== run {k + 1} of {args.repeat} (fresh data and caches) ===", flush=True)
        runs.append(run_once(groups, cfg))
    rows, targets = summarize(runs)
    result = {"machine": info,
              "config": {"batch_size": cfg.batch, "quick": cfg.quick, "scale": cfg.scale, "rounds": cfg.rounds,
                         "min_time_s": cfg.min_time, "repeat": args.repeat, "groups": groups,
                         "elapsed_s": round(time.perf_counter() - started, 1),
                         "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])},
              "rows": rows, "targets": targets, "runs": runs,
              "errors": [e | {"run": k} for k, run in enumerate(runs) for e in run["errors"]]}
    text = write(args.out, result)
    print()
    print(text)
    for error in result["errors"]:
        print(f"error in group {error['group']} (run {error['run'] + 1}): {error['error']}", file=sys.stderr)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
