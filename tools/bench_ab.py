"""Compares two checkouts on the benchmark: runs ``tools/bench.py --only GROUPS`` in each, alternately (A B A B ...),
and prints each loader row's median per checkout and their ratio, with the load average at each run's start.

    git worktree add /tmp/before <commit>
    python3 tools/bench_ab.py /tmp/before . --only tabular,images12k,dict --repeat 3

A ratio counts only as measured here: both sides in one session, interleaved, medians over the repeats. Each
checkout runs its own ``tools/bench.py`` with its own ``mmapcache`` (``PYTHONPATH`` set to it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="the first checkout (e.g. before a change)")
    parser.add_argument("b", help="the second checkout (e.g. after it)")
    parser.add_argument("--only", default="tabular,images12k", help="bench.py groups")
    parser.add_argument("--repeat", type=int, default=3, help="runs per checkout, alternating")
    parser.add_argument("--rounds", type=int, default=3, help="bench.py's interleaved rounds per comparison")
    parser.add_argument("--match", default="loader,DataLoader(ds),cold",
                        help="comma-separated substrings: the rows to compare")
    args = parser.parse_args()
    trees = {"a": os.path.abspath(args.a), "b": os.path.abspath(args.b)}
    wanted = args.match.split(",")
    values: dict[str, dict[str, list[float]]] = {"a": {}, "b": {}}
    loads = []
    with tempfile.TemporaryDirectory() as scratch:
        for k in range(args.repeat):
            for side, tree in trees.items():
                out = os.path.join(scratch, f"{side}{k}")
                subprocess.run([sys.executable, "tools/bench.py", "--only", args.only, "--rounds", str(args.rounds),
                                "--out", out, "--no-stocaching"], cwd=tree, check=True,
                               env={**os.environ, "PYTHONPATH": tree}, stdout=subprocess.DEVNULL)
                with open(os.path.join(out, "results.json")) as f:
                    run = json.load(f)["runs"][0]
                loads.append((side, run["load_at_start"]))
                for row in run["rows"]:
                    if any(w in row["name"] for w in wanted) and row["unit"] == "samples/s":
                        values[side].setdefault(row["name"], []).append(row["value"])
    for name, b in values["b"].items():
        a = values["a"].get(name)
        if a:
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"{name}: a {ma:,.0f}, b {mb:,.0f} samples/s (median of {len(b)}), b/a {mb / ma:.3f}")
    print("load average at each run's start:", loads)


if __name__ == "__main__":
    main()
