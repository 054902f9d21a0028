"""The benchmark's outputs: runs summarised (median, min, max, spread per value), ``results.json``, ``results.md``
and ``results.png``, and the machine they ran on."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from typing import Any

import numpy as np
import torch

from benchmark.core import verdict


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line.split()[1] for line in f if line.startswith("MemTotal:")))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu or platform.processor(), "cores": os.cpu_count(), "ram_gib": round(mem / 2**20, 1),
            "load_avg_at_start": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "numpy": np.__version__,
            "kernel": platform.release()}


def _spread(values: list[float]) -> dict[str, Any]:
    median = statistics.median(values)
    return {"median": median, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / median if median else None}


def summarize(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows and targets over ``runs``: each with its value per run and their median, min, max and spread
    ((max - min) / median); a target's verdict is its median's, ``passes`` counts the runs that passed."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for run in runs:
        for r in run["rows"]:
            entry = rows.setdefault((r["group"], r["name"]), {**r, "values": [], "loads": []})
            entry["values"].append(r["value"])
            entry["loads"].append(r.get("load"))
    for entry in rows.values():
        numbers = [v for v in entry["values"] if v is not None]
        entry.update(_spread(numbers) if numbers else {"median": None, "min": None, "max": None, "spread": None})
        entry["value"] = entry["median"]
        entry["status"] = "ok" if numbers else "skipped"
        entry.pop("load", None)
    targets: dict[str, dict[str, Any]] = {}
    for run in runs:
        for t in run["targets"]:
            entry = targets.setdefault(t["id"], {k: t[k] for k in ("id", "group", "target", "op", "required")}
                                       | {"values": [], "loads": [], "notes": []})
            entry["values"].append(t["measured"])
            entry["loads"].append(t["load"])
            entry["notes"].append(t["note"])
    for entry in targets.values():
        entry.update(_spread(entry["values"]))
        entry["measured"] = entry["median"]
        entry["pass"] = verdict(entry["median"], entry["op"], entry["required"])
        entry["passes"] = sum(verdict(v, entry["op"], entry["required"]) for v in entry["values"])
    return list(rows.values()), list(targets.values())


def write(out_dir: str, result: dict[str, Any]) -> str:
    """Writes ``results.json``, ``results.md`` and (with matplotlib) ``results.png``; returns the markdown."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(result)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text)
    try:
        plot(result, os.path.join(out_dir, "results.png"))
    except ImportError:  # the plot is the only part needing matplotlib (the `bench` extra); numbers still count
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
    return text


def _fmt(value: float | None, unit: str = "x") -> str:
    if value is None:
        return "skipped"
    if unit in ("x", "x data size") or abs(value) < 100:
        return f"{value:.3f}" if unit == "x" else f"{value:.2f}"
    return f"{value:,.0f}"


def _load(loads: list[list[float] | None]) -> str:
    known = [x for x in loads if x]
    return "; ".join(f"{lo:.2f}-{hi:.2f}" if hi != lo else f"{lo:.2f}" for lo, hi in known) or "n/a"


def markdown(result: dict[str, Any]) -> str:
    m, c = result["machine"], result["config"]
    k = c["repeat"]
    lines = [
        "# Benchmark results",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM; Python {m['python']}, torch {m['torch']}, "
        f"numpy {m['numpy']}; torch threads {m['torch_threads']}; load average at start {m['load_avg_at_start']}.",
        f"Command: `{c['command']}` ({c['elapsed_s']} s). Batch size {c['batch_size']}, shuffled, num_workers=0 "
        f"unless a row says otherwise. Every ratio is measured with its sides interleaved in one run (A B A B ..., "
        f"{c['rounds']} rounds after a warm-up round, best round per side); load is the 1-minute load average "
        f"sampled during that measurement (this process adds about 1).",
    ]
    if k > 1:
        lines.append(f"{k} runs in one process, each with fresh data and fresh caches; values are the median over "
                     "the runs, spread = (max - min) / median.")
    lines += ["", "| target | measured | min | max | spread | required | result | load (per run) |",
              "|---|---:|---:|---:|---:|---:|---|---|"]
    for t in result["targets"]:
        result_text = ("pass" if t["pass"] else "**miss**") + (f" ({t['passes']}/{k} runs pass)" if k > 1 else "")
        lines.append(f"| {t['target']} | {t['measured']:.3f} | {t['min']:.3f} | {t['max']:.3f} | "
                     f"{_percent(t['spread'])} | {t['op']} {t['required']} | {result_text} | {_load(t['loads'])} |")
    lines += ["", "| group | row | value | " + ("min - max | " if k > 1 else "") + "unit | note |",
              "|---|---|---:|" + ("---:|" if k > 1 else "") + "---|---|"]
    for r in result["rows"]:
        span = f"{_fmt(r['min'], r['unit'])} - {_fmt(r['max'], r['unit'])} | " if k > 1 else ""
        lines.append(f"| {r['group']} | {r['name']} | {_fmt(r['value'], r['unit'])} | {span}{r['unit']} | "
                     f"{r['note']} |")
    return "\n".join(lines) + "\n"


_MARGIN_CAP = 10.0  # how far right a "<=" target that measured 0 is drawn


def plot(result: dict[str, Any], path: str) -> None:
    """Each target's margin: measured over required (required over measured for "<=" targets), > 1 passes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = result["targets"]

    def margin(t: dict[str, Any], value: float) -> float:
        # A "<=" target may measure 0 (no source reads, no time waited) or require 0: drawn at the plot's edges.
        if t["op"] == ">=":
            return value / t["required"]
        if value <= 0:
            return _MARGIN_CAP
        return t["required"] / value if t["required"] > 0 else 1 / _MARGIN_CAP

    mids = [margin(t, t["measured"]) for t in targets]
    lows = [min(margin(t, t["min"]), margin(t, t["max"])) for t in targets]
    highs = [max(margin(t, t["min"]), margin(t, t["max"])) for t in targets]
    fig, ax = plt.subplots(figsize=(10, 0.36 * len(targets) + 1.4))
    ax.barh(range(len(targets)), mids, color=["#2ca02c" if x >= 1 else "#d62728" for x in mids],
            xerr=[[m - lo for m, lo in zip(mids, lows)], [hi - m for m, hi in zip(mids, highs)]])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(targets)), [f"{t['target']} ({t['op']} {t['required']})" for t in targets], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("measured / required (inverted for <= targets): right of 1 passes; whiskers span the runs",
                  fontsize=8)
    c = result["config"]
    ax.set_title(f"mmapcache targets, {c['repeat']} run(s), batch {c['batch_size']}, "
                 f"{result['machine']['cores']} cores, load at start {result['machine']['load_avg_at_start'][0]}",
                 fontsize=9)
    for k, (t, x) in enumerate(zip(targets, mids)):
        ax.text(x, k, f" {t['measured']:.2f}", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _percent(spread: float | None) -> str:
    """A spread as a percentage; "-" when it has none (a median of 0, such as a count of source reads)."""
    return "-" if spread is None else f"{spread * 100:.1f}%"
