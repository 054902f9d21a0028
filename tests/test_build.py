"""``mmapcache build`` and ``mmapcache.build``: parallel fill, resume after SIGKILL, concurrent builds,
shards, failures, refresh and follow mode. Builds run as real processes (CLI subprocesses or DataLoader workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

from helpers.cli_sources import NotFinite
from helpers.processes import kill_alive
from helpers.sources import ImageLabels, sample_equal
from mmapcache import MmapCachedDataset, build
from mmapcache.cli import main
from mmapcache.fill.workers import chunk_rows

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = os.path.join(HERE, "helpers", "cli_sources.py")
ENV = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}


def calls(log: str) -> list[int]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [int(line) for line in f.read().split()]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mmapcache", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def assert_equals_source(path: str, n: int) -> None:
    source = ImageLabels(n)
    with MmapCachedDataset(path) as ds:
        assert ds.num_cached == n
        for i in range(n):
            assert sample_equal(ds[i], source[i]), i


def test_build_with_two_workers_then_dataloader_reads_source_bytes(cache_path: str, tmp_path) -> None:
    log = str(tmp_path / "calls")
    out = cli("build", cache_path, "--dataset", f"{SPEC}:images", "--kwargs", f'{{"n": 40, "log": "{log}"}}',
              "--workers", "2")
    assert out.returncode == 0, out.stderr
    summary = out.stdout.strip().splitlines()[-1]
    assert "filled 40, skipped 0 (already there), failed 0" in summary  # sample 0 too, stored while creating it
    assert sorted(calls(log)) == list(range(40))  # every sample computed exactly once
    source = ImageLabels(40)
    with MmapCachedDataset(cache_path) as ds:  # no source: every read is a hit or SampleNotCachedError
        loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2)
        images = torch.cat([batch[0] for batch in loader])
    expected = torch.stack([source[i][0] for i in range(40)])
    assert torch.equal(images, expected)


def test_sigkilled_build_resumes_and_completes(cache_path: str, tmp_path) -> None:
    n, log = 200, str(tmp_path / "calls")
    kwargs = f'{{"n": {n}, "log": "{log}", "delay": 0.01}}'
    proc = subprocess.Popen([sys.executable, "-m", "mmapcache", "build", cache_path, "--dataset", f"{SPEC}:images",
                             "--kwargs", kwargs, "--workers", "2"], env=ENV, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 90
    while len(calls(log)) < 40 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
    os.killpg(proc.pid, signal.SIGKILL)  # the main process and its workers, mid-write or not
    proc.wait(timeout=30)
    proc.stderr.close()  # type: ignore[union-attr]
    with MmapCachedDataset(cache_path) as ds:
        done = ds.num_cached
    assert 0 < done < n
    out = cli("build", cache_path, "--dataset", f"{SPEC}:images", "--kwargs", f'{{"n": {n}}}', "--workers", "2")
    assert out.returncode == 0, out.stderr
    summary = out.stdout.strip().splitlines()[-1]
    skipped = int(summary.split("skipped ")[1].split()[0])
    filled = int(summary.split("filled ")[1].split(",")[0])
    assert skipped >= done - 2 and skipped > 0  # a killed writer's rows (odd counter) count as missing
    assert filled + skipped == n
    assert_equals_source(cache_path, n)


def test_concurrent_builds_share_the_work(cache_path: str, tmp_path) -> None:
    n, workers = 96, 2
    # Created, sample 0 stored (no probes). The fingerprint identifies the source, so the builds need not recompute
    # sample 0.
    MmapCachedDataset(cache_path, ImageLabels(n), fingerprint="gated", ragged=None).close()
    gate, log = str(tmp_path / "go"), str(tmp_path / "calls")
    kwargs = f'{{"n": {n}, "log": "{log}", "gate": "{gate}"}}'
    procs = [subprocess.Popen([sys.executable, "-m", "mmapcache", "build", cache_path, "--dataset",
                               f"{SPEC}:gated", "--kwargs", kwargs, "--workers", str(workers),
                               "--fingerprint", "gated"], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        # Start barrier: every worker of both builds is waiting inside its first sample before any proceeds.
        deadline = time.monotonic() + 90
        while len([f for f in os.listdir(tmp_path) if f.startswith("waiting-")]) < 2 * workers:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "builds did not start"
            time.sleep(0.02)
        open(gate, "w").close()
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for p, (_stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr
    filled = [int(stdout.strip().splitlines()[-1].split("filled ")[1].split(",")[0]) for stdout, _ in outs]
    assert all(f > 0 for f in filled), filled  # both really worked
    assert sum(filled) == n - 1  # each missing row stored by exactly one of them
    assert len(calls(log)) <= n - 1 + 2 * chunk_rows(n) * workers, Counter(calls(log)).most_common(3)
    assert set(calls(log)) == set(range(1, n))
    assert_equals_source(cache_path, n)


def test_shards_cover_everything_exactly_once(cache_path: str, tmp_path) -> None:
    n, parts = 90, 3
    logs = [str(tmp_path / f"calls-{i}") for i in range(parts)]
    for i, log in enumerate(logs):
        code = main(["build", cache_path, "--dataset", f"{SPEC}:images", "--kwargs", f'{{"n": {n}, "log": "{log}"}}',
                     "--workers", "2", "--shard", f"{i}/{parts}", "--fingerprint", "images", "--ragged", "none"])
        assert code == 0
        with MmapCachedDataset(cache_path) as ds:
            assert ds.num_cached < n or i == parts - 1  # a shard fills only its part
    sets = [set(calls(log)) for log in logs]
    assert sum(len(calls(log)) for log in logs) == n  # no index computed twice, in or across shards
    assert set().union(*sets) == set(range(n))
    assert all(not (a & b) for k, a in enumerate(sets) for b in sets[k + 1:])
    assert all(len(s) >= n // parts - chunk_rows(n) for s in sets)  # roughly even parts
    assert_equals_source(cache_path, n)


def test_torchrun_local_rank_selects_a_shard(cache_path: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 40
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    report = build(cache_path, f"{SPEC}:images", kwargs={"n": n}, workers=2, ragged=None)  # creation: sample 0
    with MmapCachedDataset(cache_path) as ds:
        assert report.filled == ds.num_cached - 1 == n // 2  # rank 1's half (sample 0, rank 0's, came from creation)
    report = build(cache_path, f"{SPEC}:images", kwargs={"n": n}, workers=2, shard=None)  # explicit: everything
    assert report.filled == n // 2 - 1 and report.skipped == n // 2 + 1
    assert_equals_source(cache_path, n)


def test_failures_are_reported_and_the_rest_stored(cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["build", cache_path, "--dataset", f"{SPEC}:Failing", "--kwargs", '{"n": 32, "bad": [3, 17]}',
                 "--workers", "2"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "failed 2" in out
    # One line per distinct error (sample numbers masked), naming every sample that raised it.
    failed = [line for line in err.splitlines() if line.startswith("mmapcache: failed: ")]
    assert failed == ["mmapcache: failed: 2 samples (3, 17), e.g. sample 3: ValueError: corrupt image file for "
                      "sample 3"], err
    with MmapCachedDataset(cache_path) as ds:
        assert ds.num_cached == 30 and not ds.is_cached(3) and not ds.is_cached(17)


@pytest.mark.parametrize("workers", [1, 2])
def test_check_finite_reports_samples_holding_nan_or_inf_as_failed(cache_path: str, workers: int,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # A build stored NaNs bit for bit whatever the dataset was opened with: a user who opens the cache with
    # check_finite=True then read, warm, what a miss of the same sample refuses. Samples 5 and 11 are among those the
    # creation stores as layout probes (its first version checked only what its workers stored).
    bad = (3, 5, 11, 17, 30)
    kwargs = '{"n": 40, "nan": [3, 5, 30], "inf": [11, 17]}'
    code = main(["build", cache_path, "--dataset", f"{SPEC}:NotFinite", "--kwargs", kwargs, "--workers",
                 str(workers), "--check-finite"])
    out, err = capsys.readouterr()
    assert code == 1 and "failed 5" in out, out
    failed = [line for line in err.splitlines() if line.startswith("mmapcache: failed: ")]
    assert failed == ["mmapcache: failed: 5 samples (3, 5, 11, 17, 30), e.g. sample 3: ValueError: sample 3, field "
                      "'x': contains NaN or infinite values (check_finite=True); nothing was stored for it"], err
    source = NotFinite(40, nan=[3, 5, 30], inf=[11, 17])
    with MmapCachedDataset(cache_path) as ds:
        assert ds.num_cached == 35 and not any(ds.is_cached(i) for i in bad)
        assert all(sample_equal(ds[i], source[i]) for i in range(40) if i not in bad)
    # The same build without the flag stores them as they are (as a dataset without check_finite does).
    assert main(["build", cache_path, "--dataset", f"{SPEC}:NotFinite", "--kwargs", kwargs]) == 0
    with MmapCachedDataset(cache_path) as ds:
        assert ds.num_cached == 40 and ds[3]["x"].isnan().sum() == 1 and ds[17]["x"][5] == -float("inf")
    capsys.readouterr()
    # A first sample holding NaN cannot create the cache: one error line, as for a source that raises on it.
    other = cache_path + "-first"
    assert main(["build", other, "--dataset", f"{SPEC}:NotFinite", "--kwargs", '{"n": 8, "nan": [0]}',
                 "--check-finite"]) == 2
    assert "sample 0, field 'x': contains NaN or infinite values" in capsys.readouterr().err
    assert not os.path.exists(other)


def test_fail_fast_stops_at_the_first_failure(cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["build", cache_path, "--dataset", f"{SPEC}:Failing", "--kwargs", '{"n": 200, "bad": [5]}',
                 "--workers", "1", "--fail-fast"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "failed 1" in out and "--fail-fast" in err
    with MmapCachedDataset(cache_path) as ds:
        assert ds.num_cached < 199  # stopped early instead of filling everything else


def test_variants_fill_every_row_with_independent_calls(cache_path: str) -> None:
    n = 24
    report = build(cache_path, f"{SPEC}:noisy", kwargs={"n": n}, workers=2, variants=3)
    assert report.ok and report.filled + report.skipped == 3 * n
    with MmapCachedDataset(cache_path) as ds:
        for epoch in range(3):  # every variant of every sample: num_cached counts the current epoch's variants
            ds.set_epoch(epoch)
            assert ds.num_cached == n
        ds.set_epoch(0)
        versions = []
        for epoch in range(3):
            ds.set_epoch(epoch)
            versions.append(torch.stack([ds[i][0] for i in range(n)]))
    assert not torch.equal(versions[0], versions[1]) and not torch.equal(versions[1], versions[2])


def test_a_creating_build_that_refreshes_counts_each_row_once(cache_path: str) -> None:
    # refresh= marked the creation's rows stale before they were counted as this build's, so the workers' refill
    # counted them again and `skipped` went negative ("filled 48, skipped -8" of 40 rows). Found by a review.
    report = build(cache_path, f"{SPEC}:images", kwargs={"n": 40}, workers=1, refresh=1.0, seed=1)
    with MmapCachedDataset(cache_path) as ds:
        assert (report.filled, report.skipped, report.marked_stale) == (ds.num_cached, 0, 8) == (40, 0, 8), (
            report.summary())


def test_refresh_marks_and_refills(cache_path: str, tmp_path) -> None:
    version = tmp_path / "version"
    version.write_text("0")
    kwargs = {"n": 20, "version_file": str(version)}
    assert build(cache_path, f"{SPEC}:Drifting", kwargs=kwargs, workers=2).ok
    version.write_text("1")  # the source changed on purpose: declared, or the build refuses to mix versions
    report = build(cache_path, f"{SPEC}:Drifting", kwargs=kwargs, workers=2, refresh=0.5, deterministic=False)
    assert report.marked_stale == 10 and report.filled == 10 and report.skipped == 10
    with MmapCachedDataset(cache_path) as ds:
        labels = [ds[i][1] for i in range(20)]
    assert sum(label >= 100 for label in labels) == 10  # exactly the refreshed half holds the new version


def test_follow_refills_rows_marked_stale_elsewhere_then_exits_on_sigterm(cache_path: str, tmp_path) -> None:
    version = tmp_path / "version"
    version.write_text("0")
    kwargs = f'{{"n": 16, "version_file": "{version}"}}'
    # The fingerprint names the source across its versions (so the producer's open never compares sample 0).
    assert main(["build", cache_path, "--dataset", f"{SPEC}:Drifting", "--kwargs", kwargs, "--workers", "1",
                 "--fingerprint", "drifting"]) == 0
    proc = subprocess.Popen([sys.executable, "-m", "mmapcache", "build", cache_path, "--dataset", f"{SPEC}:Drifting",
                             "--kwargs", kwargs, "--workers", "1", "--follow", "--fingerprint", "drifting"], env=ENV,
                            text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        version.write_text("1")
        # Another process (a trainer calling ds.refresh) marks two samples stale.
        subprocess.run([sys.executable, "-c", f"from mmapcache import MmapCachedDataset\n"
                        f"MmapCachedDataset({cache_path!r}).refresh(indices=[2, 5])"], env=ENV, check=True, timeout=60)
        with MmapCachedDataset(cache_path, stale="serve") as ds:
            deadline = time.monotonic() + 60
            while not (ds[2][1] >= 100 and ds[5][1] >= 100) and time.monotonic() < deadline:
                assert proc.poll() is None, proc.communicate()[1]
                time.sleep(0.1)
            assert ds[2][1] == 2 * 7 % 10 + 100 and ds[5][1] == 5 * 7 % 10 + 100
            assert ds[3][1] == 3 * 7 % 10  # untouched rows keep the old version
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, stderr
    assert "filled 2," in stdout.strip().splitlines()[-1] and "(interrupted)" in stdout


def _ctrl_c_as_in_a_terminal() -> None:
    """A command started from a shell's background job (``pytest &``, a CI runner's) inherits SIGINT ignored, and so
    would ignore the Ctrl-C sent to it: it gets the default disposition a foreground command has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("n", [400, 3000])  # chunks of 1 row, and of 11 (the probes share chunks with rows to fill)
def test_a_creating_build_interrupted_early_counts_what_it_stored(cache_path: str, tmp_path, n: int) -> None:
    # The samples the creation stored (the first and the layout probes) were taken off `skipped` even when the
    # interrupted workers never counted them there ("filled 8, skipped -8"), and rows the workers stored after the
    # interrupt were not counted at all.
    log = tmp_path / "calls"
    proc = subprocess.Popen([sys.executable, "-m", "mmapcache", "build", cache_path, "--dataset", f"{SPEC}:images",
                             "--kwargs", f'{{"n": {n}, "delay": 0.05, "log": "{log}"}}', "--workers", "1"],
                            env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_ctrl_c_as_in_a_terminal)
    try:
        deadline = time.monotonic() + 60
        while (not log.exists() or len(log.read_text().split()) < 12) and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        kill_alive([proc])
    assert proc.returncode == 130, stderr
    summary = stdout.strip().splitlines()[-1]
    assert "(interrupted)" in summary, summary
    filled = int(summary.split("filled ")[1].split(",")[0])
    skipped = int(summary.split("skipped ")[1].split(" ")[0])
    with MmapCachedDataset(cache_path) as ds:
        assert (filled, skipped) == (ds.num_cached, 0), summary  # nothing else wrote to the new cache


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_a_sample_that_kills_its_worker_is_named_and_skipped(cache_path: str, capsys: pytest.CaptureFixture[str],
                                                             how: str) -> None:
    """One run fills every other sample and names the killer (exit 1), instead of dying a little further on
    each rerun without saying which sample it was."""
    n, killer = 2000, 1234
    code = main(["build", cache_path, "--dataset", f"{SPEC}:Crashing", "--kwargs",
                 f'{{"n": {n}, "crash_at": {killer}, "how": "{how}"}}', "--workers", "2", "--fingerprint", "c"])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert f"failed: sample {killer}: its build worker died computing it" in err
    assert "1 sample(s) failed" in err and f"filled {n - 1}," in out.strip().splitlines()[-1], out
    with MmapCachedDataset(cache_path) as ds:
        assert not ds.is_cached(killer) and ds.num_cached == n - 1
        assert all(sample_equal(ds[i], ImageLabels(n)[i]) for i in range(0, n, 97) if i != killer)


def test_samples_that_kill_workers_in_a_row_are_each_named_and_no_other(cache_path: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # A dead worker's last result can die with it (queued, not yet written to the pipe), and the sample it stood
    # for, stored, was then named as the killer too: "failed: 2 samples (1233, 1234)" for one killer, in about one
    # full run in four. The killer is the row after the last one the worker stored.
    n, killers = 600, [100, 101, 350, 598]  # two in a row, one alone, the last sample a worker computes (the
    # creation computes 0 and its probes, 599 among them, in this process)
    code = main(["build", cache_path, "--dataset", f"{SPEC}:Crashing", "--kwargs",
                 f'{{"n": {n}, "crash_at": {killers}, "how": "exit"}}', "--workers", "2", "--fingerprint", "c"])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert f"failed: {len(killers)} samples ({', '.join(map(str, killers))})" in err, err
    assert f"filled {n - len(killers)}," in out.strip().splitlines()[-1], out
    with MmapCachedDataset(cache_path) as ds:
        assert [i for i in range(n) if not ds.is_cached(i)] == killers
        assert all(sample_equal(ds[i], ImageLabels(n)[i]) for i in range(0, n, 7) if i not in killers)


def test_rm_refuses_a_running_build_and_force_stops_it_with_one_line(cache_path: str) -> None:
    """A build is a registered user: a plain rm refuses it; rm --force makes the build stop with one line saying
    the cache was removed, not with a failure per remaining sample blaming the source."""
    proc = subprocess.Popen([sys.executable, "-m", "mmapcache", "build", cache_path, "--dataset", f"{SPEC}:images",
                             "--kwargs", '{"n": 2000, "delay": 0.005}', "--workers", "2"], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:  # started and filling
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            if os.path.exists(cache_path):
                with MmapCachedDataset(cache_path) as ds:
                    if ds.num_cached > 20:
                        break
            time.sleep(0.05)
        refused = subprocess.run([sys.executable, "-m", "mmapcache", "rm", cache_path], env=ENV, text=True,
                                 capture_output=True, timeout=60)
        assert refused.returncode == 2 and f"in use by process(es) {proc.pid}" in refused.stderr, refused.stderr
        forced = subprocess.run([sys.executable, "-m", "mmapcache", "rm", "--force", cache_path], env=ENV, text=True,
                                capture_output=True, timeout=60)
        assert forced.returncode == 0, forced.stderr
        _out, err = proc.communicate(timeout=90)
    finally:
        kill_alive([proc])
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "was removed while this build filled it" in lines[0], err
    assert "failed" not in err and "fix the source" not in err


def test_a_source_raising_on_sample_0_is_one_line(cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["build", cache_path, "--dataset", f"{SPEC}:Failing", "--kwargs", '{"bad": [0]}', "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the source raised computing sample 0" in err and "--debug" in err
    assert not os.path.exists(cache_path)


def test_indices_beyond_the_dataset_are_refused(cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["build", cache_path, "--dataset", f"{SPEC}:images", "--kwargs", '{"n": 40}', "--workers", "1",
                 "--indices", "10000:20000"])
    err = capsys.readouterr().err
    assert code == 2 and "start beyond the dataset's 40 samples" in err, err


def test_repeated_refreshes_draw_fresh_rows_unless_seeded(cache_path: str) -> None:
    assert build(cache_path, f"{SPEC}:images", kwargs={"n": 200}, workers=1).ok
    seeds = {build(cache_path, f"{SPEC}:images", kwargs={"n": 200}, workers=1, refresh=0.2).refresh_seed
             for _ in range(3)}
    assert len(seeds) == 3  # a fresh choice each run: five runs of 0.2 no longer refresh the same 40 rows
    with MmapCachedDataset(cache_path) as ds:
        marks = []
        for _ in range(2):  # the same seed marks the same rows
            report = build(cache_path, f"{SPEC}:images", kwargs={"n": 200}, workers=1, refresh=0.2, seed=7)
            marks.append(report.marked_stale)
        assert marks == [40, 40] and ds.num_cached == 200


@pytest.mark.parametrize("workers", [1, 2])
def test_the_summary_counts_the_bytes_of_ragged_values(cache_path: str, capsys: pytest.CaptureFixture[str],
                                                      workers: int) -> None:
    # 20 samples: int32 tokens of index % 7 + 1 values (308 bytes in their heap) and an int64 label (160 bytes in
    # its rows), the ones stored while creating the cache included. Heap bytes were not counted: a 297.8 MiB cache
    # of token ids printed "390.6 KiB written".
    assert main(["build", cache_path, "--dataset", f"{SPEC}:Ragged", "--ragged", "tokens", "--workers",
                 str(workers)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert "filled 20, skipped 0" in summary and "468 B written" in summary, summary
    report = build(cache_path, f"{SPEC}:Ragged", workers=workers, refresh=0.5, seed=3)
    assert report.filled == 10 and report.bytes == 10 * 8 + sum(4 * (i % 7 + 1) for i in report_rows(cache_path))


def report_rows(path: str) -> list[int]:
    """The indices whose rows a refresh rewrote (their counters moved past the first write's 2)."""
    import numpy as np

    seq = np.fromfile(os.path.join(path, "seq.u32"), "<u4")
    return [int(i) for i in np.flatnonzero(seq > 2)]
