"""Smoke test of ``tools/bench.py``: a quick run completes and reports every row with a positive number.

This checks that the benchmark runs and that its outputs are complete; it asserts nothing about speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every row a run must report (the stocaching rows are skipped here: they need their own numpy<2 venv).
EXPECTED = {
    "raw": 2, "baselines": 2, "stocaching": 2, "mmapcache": 6, "per_sample": 2, "cold": 2, "memory": 2, "build": 2,
    "lock": 3, "features": 6,
}


def test_quick_run_reports_every_row(tmp_path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench.py"), "--quick", "--n", "2000", "--no-stocaching",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((out / "results.json").read_text())
    groups: dict[str, int] = {}
    for row in result["rows"]:
        groups[row["group"]] = groups.get(row["group"], 0) + 1
        if row["group"] == "stocaching":
            assert row["status"] == "skipped" and "--no-stocaching" in row["note"], row
            continue
        assert row["status"] == "ok", row
        assert isinstance(row["value"], float) and row["value"] > 0, row
    assert groups == EXPECTED
    assert len(result["targets"]) == 6
    for target in result["targets"]:
        assert target["ratio"] is not None and target["ratio"] > 0, target
        assert target["pass"] in (True, False), target
    assert result["machine"]["cores"] >= 1 and result["machine"]["torch"]
    text = (out / "results.md").read_text()
    assert text.count("\n| ") >= sum(EXPECTED.values()) and "| target |" in text
    try:
        import matplotlib  # noqa: F401 - only the plot needs it (the `bench` extra)
    except ImportError:
        assert not (out / "results.png").exists() and "no plot: matplotlib is not installed" in proc.stderr
    else:
        assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    leftovers = [name for name in os.listdir("/dev/shm") if name.startswith("mmapcache-bench-")]
    assert not [name for name in leftovers if name in proc.stdout], "the benchmark left its data in /dev/shm"
