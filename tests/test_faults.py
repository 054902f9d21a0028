"""Faults with real processes: SIGKILLed writers, contention, racing creators, full file systems, removal while
in use, failing sources and read-only users. Every wait has a timeout; every loop is bounded."""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from helpers import fault_workers as fw
from helpers.processes import join_all, kill_alive
from helpers.sources import ImageLabels, image_of, sample_equal
from mmapcache import CacheReadOnlyError, CacheReadOnlyWarning, LayoutError, MmapCachedDataset
from mmapcache.format.layout import Layout
from mmapcache.store import admin as _admin
from mmapcache.store import create as _create
from mmapcache.store import store as _store

FORK = multiprocessing.get_context("fork")


def _exit_report(procs: list[Any]) -> list[int | None]:
    # A negative exit code is the signal that killed the process (-7 would be SIGBUS).
    return [p.exitcode for p in procs]


# --- 1. kill storm ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kill_storm_leaves_only_correct_filled_rows(cache_path: str) -> None:
    n, shape = 192, (3, 64, 64)
    source = ImageLabels(n, shape)
    MmapCachedDataset(cache_path, source).close()
    background = [FORK.Process(target=fw.fill_forever, args=(cache_path, n, shape, 1000 + k, FORK.Event()))
                  for k in range(2)]
    for p in background:
        p.start()
    rng = random.Random(7)
    kills = 0
    odd_seen = 0  # rows caught mid-write by a kill (odd counter) at some check
    try:
        for k in range(36):
            ready = FORK.Event()
            victim = FORK.Process(target=fw.fill_forever, args=(cache_path, n, shape, k, ready))
            victim.start()
            assert ready.wait(30), "the victim never opened the cache"
            time.sleep(rng.uniform(0, 0.05))
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            assert victim.exitcode == -signal.SIGKILL
            kills += 1
            _, filled, seq = fw.raw_rows(cache_path)
            odd_seen += int((seq & 1).sum())
        assert all(p.is_alive() for p in background), _exit_report(background)
    finally:
        kill_alive(background)
    assert kills >= 30
    # Every row whose bit is set and whose counter is even (what readers accept) holds the source's bytes.
    data, filled, seq = fw.raw_rows(cache_path)
    labels = np.load(os.path.join(cache_path, "1.npy"), mmap_mode="r")
    readable = np.flatnonzero(filled & (seq % 2 == 0))
    assert len(readable) > 0
    for r in readable:
        assert np.array_equal(data[r], image_of(int(r), shape).numpy()), f"row {r} differs from the source"
        assert labels[r] == r * 7 % 10
    assert (seq[filled] >= 2).all(), "a filled row has a counter below 2"
    # A final fill completes the cache, rewriting rows left mid-write (odd counters) by the kills.
    with MmapCachedDataset(cache_path, source) as ds:
        ds.fill()
        assert ds.num_cached == n
        assert all(sample_equal(ds[i], source[i]) for i in range(n))
    data, filled, seq = fw.raw_rows(cache_path)
    assert filled.all()
    assert (seq % 2 == 0).all() and (seq >= 2).all(), f"odd or zero counters after the final fill: {seq[seq % 2 == 1]}"
    assert all(np.array_equal(data[r], image_of(r, shape).numpy()) for r in range(n))
    print(f"kills={kills} odd counters seen after kills={odd_seen}")


# --- 2. contention ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_eight_writers_two_readers_no_lost_bit_no_torn_sample(cache_path: str, tmp_path: Any) -> None:
    n, shape = 384, (3, 64, 64)
    MmapCachedDataset(cache_path, ImageLabels(n, shape)).close()
    barrier, stop = FORK.Barrier(10), FORK.Event()
    fillers = [FORK.Process(target=fw.fill_shuffled, args=(cache_path, n, shape, k, barrier, str(tmp_path / f"w{k}")))
               for k in range(8)]
    readers = [FORK.Process(target=fw.read_continuously,
                            args=(cache_path, n, shape, 100 + k, barrier, stop, str(tmp_path / f"r{k}"), 90.0))
               for k in range(2)]
    for p in fillers + readers:
        p.start()
    try:
        join_all(fillers, 150)
    finally:
        stop.set()
        join_all(readers, 120)
    assert _exit_report(fillers + readers) == [0] * 10
    for k in range(8):
        result = fw.read_result(str(tmp_path / f"w{k}"))
        assert result == {"checked": n, "bad": []}, f"writer {k} got wrong samples {result['bad'][:10]}"
    checked = 0
    for k in range(2):
        result = fw.read_result(str(tmp_path / f"r{k}"))
        assert result["bad"] == [], f"reader {k} got wrong samples {result['bad'][:10]}"
        checked += result["checked"]
    assert checked > 0, "the readers never got a sample"
    print(f"readers checked {checked} samples")
    data, filled, seq = fw.raw_rows(cache_path)
    assert filled.all(), f"lost bits: rows {np.flatnonzero(~filled)[:10]}"
    assert (seq % 2 == 0).all() and (seq >= 2).all()
    assert all(np.array_equal(data[r], image_of(r, shape).numpy()) for r in range(n))


# --- 3. creation race -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_eight_creators_end_up_on_one_cache(cache_path: str, tmp_path: Any) -> None:
    parent = os.path.dirname(cache_path)
    before = set(os.listdir(parent))
    barrier = FORK.Barrier(8)
    procs = [FORK.Process(target=fw.create_at_barrier, args=(cache_path, 16, barrier, str(tmp_path / f"c{k}")))
             for k in range(8)]
    for p in procs:
        p.start()
    join_all(procs, 180)
    assert _exit_report(procs) == [0] * 8
    results = [fw.read_result(str(tmp_path / f"c{k}")) for k in range(8)]
    assert [r.get("error") for r in results] == [None] * 8
    assert len({r["inode"] for r in results}) == 1 and len({r["created"] for r in results}) == 1
    assert all(r["ok"] for r in results)
    assert os.stat(os.path.join(cache_path, "meta.json")).st_ino == results[0]["inode"]
    assert set(os.listdir(parent)) - before == {"cache"}, "temporary directories were left behind"


# --- 4. full file system ----------------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Any) -> Iterator[Any]:
    """Mounts tmpfs file systems of a given size under tmp_path (root only); unmounts them afterwards."""
    mounted: list[str] = []

    def mount(size: int) -> str:
        point = str(tmp_path / f"tmpfs{len(mounted)}")
        os.mkdir(point)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", point], capture_output=True,
                              text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a small tmpfs (needs root): {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", point], check=False)


def _create_in_child(path: str, shape: tuple[int, ...], n: int, fill: bool = False) -> dict[str, Any]:
    queue = FORK.Queue()
    p = FORK.Process(target=fw.create_in, args=(path, shape, n, fill, queue))
    p.start()
    try:
        result = queue.get(timeout=120)
    finally:
        p.join(30)
    assert p.exitcode == 0, f"the creating process died with exit code {p.exitcode} (-7 is SIGBUS)"
    return result


def _planned_bytes(n: int, shape: tuple[int, ...]) -> int:
    layout = Layout.from_sample(ImageLabels(n, shape)[0])
    return _create.plan_bytes(layout, n, 0)


def test_full_file_system_is_refused_up_front(small_tmpfs: Any) -> None:
    mount = small_tmpfs(1 << 20)
    result = _create_in_child(os.path.join(mount, "cache"), (3, 64, 64), 256)
    assert result["ok"] is False and result["type"] == "InsufficientSpaceError", result
    assert "not enough space" in result["message"] and "max_bytes=" in result["message"]
    assert os.listdir(mount) == []


def test_room_gone_between_check_and_reservation(small_tmpfs: Any) -> None:
    # The byte check passes, but the file system runs out of inodes while the files are created: the reservation
    # step itself must turn ENOSPC into InsufficientSpaceError and remove what it made.
    n, shape = 64, (3, 64, 64)
    mount = small_tmpfs(64 << 20)
    subprocess.run(["mount", "-o", "remount,nr_inodes=6", mount], check=True)
    assert _create.free_bytes(mount) > 4 * _planned_bytes(n, shape)
    result = _create_in_child(os.path.join(mount, "cache"), shape, n)
    assert result["ok"] is False and result["type"] == "InsufficientSpaceError", result
    assert os.listdir(mount) == []


@pytest.mark.slow
def test_space_taken_while_creating_is_always_a_clean_error(small_tmpfs: Any, tmp_path: Any) -> None:
    # Another process grabs and frees most of the room again and again while caches are created: each creation
    # either succeeds or raises InsufficientSpaceError (up front or from the reservation), never anything else,
    # and nothing is left behind.
    n, shape = 32, (3, 64, 64)
    needed = _planned_bytes(n, shape)
    mount = small_tmpfs(3 * needed)
    stop = FORK.Event()
    hog = FORK.Process(target=fw.hog_space, args=(os.path.join(mount, "hog"), 2 * needed, stop, 60.0))
    hog.start()
    outcomes: dict[str, int] = {}
    try:
        for k in range(12):
            result = _create_in_child(os.path.join(mount, f"cache{k}"), shape, n, fill=True)
            key = "created" if result["ok"] else result["type"]
            outcomes[key] = outcomes.get(key, 0) + 1
            if result["ok"]:
                assert result["cached"] == n
                shutil.rmtree(os.path.join(mount, f"cache{k}"))
    finally:
        stop.set()
        hog.join(30)
    assert hog.exitcode == 0
    assert set(outcomes) <= {"created", "InsufficientSpaceError"}, outcomes
    assert sum(outcomes.values()) == 12
    assert [name for name in os.listdir(mount) if name != "hog"] == []
    print(f"outcomes: {outcomes}")


def test_space_taken_by_others_after_creation_causes_no_sigbus(small_tmpfs: Any) -> None:
    # The cache's bytes are reserved at creation: filling the file system afterwards cannot make a later write
    # into the map fault (a sparse file would: SIGBUS).
    n, shape = 64, (3, 64, 64)
    mount = small_tmpfs(_planned_bytes(n, shape) + (256 << 10))
    path = os.path.join(mount, "cache")
    MmapCachedDataset(path, ImageLabels(n, shape)).close()
    with open(os.path.join(mount, "hog"), "wb", buffering=0) as f, pytest.raises(OSError, match="No space left"):
        for _ in range(1024):
            f.write(b"\xff" * 4096)
    assert _create.free_bytes(mount) < 4096
    result = _create_in_child(path, shape, n, fill=True)
    assert result == {"ok": True, "cached": n}
    with MmapCachedDataset(path) as ds:
        assert all(sample_equal(ds[i], ImageLabels(n, shape)[i]) for i in range(n))


# --- 6. removal while in use ------------------------------------------------------------------------------------


def _remove_cache(path: str) -> None:
    """Removes the cache the way a user would: the CLI if it exists, else the library call it uses."""
    cli = os.path.join(os.path.dirname(_store.__file__), "cli.py")
    if os.path.exists(cli):
        done = subprocess.run([sys.executable, "-m", "mmapcache", "rm", "--force", path], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    else:
        with _create.parent_lock(path):
            _admin.delete(path)
    assert not os.path.exists(path)


@pytest.mark.slow
def test_readers_survive_removal_while_in_use(cache_path: str, tmp_path: Any) -> None:
    n, shape = 64, (3, 32, 32)
    with MmapCachedDataset(cache_path, ImageLabels(n, shape)) as ds:
        ds.fill()
    readers, readies, go = [], [], FORK.Event()
    for k in range(2):
        ready = FORK.Event()
        readers.append(FORK.Process(target=fw.read_through_removal,
                                    args=(cache_path, n, shape, ready, go, str(tmp_path / f"r{k}"))))
        readies.append(ready)
    half = MmapCachedDataset(os.path.join(os.path.dirname(cache_path), "half"), ImageLabels(n, shape))
    half.fill(range(n // 2))
    half.close()
    writer_ready = FORK.Event()
    writer = FORK.Process(target=fw.write_through_removal,
                          args=(half.path, n, shape, writer_ready, go, str(tmp_path / "w")))
    for p in [*readers, writer]:
        p.start()
    try:
        assert all(e.wait(60) for e in [*readies, writer_ready])
        _remove_cache(cache_path)
        _remove_cache(half.path)
    finally:
        go.set()
        join_all([*readers, writer], 60)
    assert _exit_report([*readers, writer]) == [0, 0, 0], "a process died (-7 is SIGBUS)"
    for k in range(2):
        result = fw.read_result(str(tmp_path / f"r{k}"))
        assert result == {"bad_before": [], "bad_after": [], "bad_batch": []}, result
    # A process with the source whose cache vanished serves every sample correctly (the misses computed, not stored:
    # its writer lock was removed with the cache), and says so once. It raised CacheFormatError before.
    result = fw.read_result(str(tmp_path / "w"))
    assert result["bad_after"] == [], result
    assert len(result["warnings"]) == 1 and result["warnings"][0].startswith("CacheRemovedWarning"), result
    assert os.listdir(os.path.dirname(cache_path)) == []  # nothing created again in its place
    with pytest.raises(FileNotFoundError, match="no cache at"):
        MmapCachedDataset(cache_path)


# --- 7. source failures -----------------------------------------------------------------------------------------


def _text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def test_source_error_names_the_index_and_leaves_the_cache_usable(cache_path: str) -> None:
    ds = MmapCachedDataset(cache_path, fw.Failing(16, bad=5, mode="raise"))
    with pytest.raises(OSError, match="corrupt JPEG in record 5") as info:
        ds[5]
    assert "computing sample 5" in _text(info.value)
    with pytest.raises(OSError) as info:
        ds.__getitems__([4, 5, 6])
    assert "computing sample 5" in _text(info.value)
    assert not ds.is_cached(5)
    assert sample_equal(ds[6], ImageLabels(16)[6]) and ds.is_cached(6) and ds.is_cached(4)
    ds.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_source_error_reaches_the_caller_through_dataloader_workers(cache_path: str, context: str) -> None:
    ds = MmapCachedDataset(cache_path, fw.Failing(16, bad=9, mode="raise"))
    loader = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context=context)
    with pytest.raises(OSError) as info:
        for _ in loader:
            pass
    text = _text(info.value)
    assert "corrupt JPEG in record 9" in text and "computing sample 9" in text, text
    del loader
    assert not ds.is_cached(9)
    assert ds.is_cached(4), "the batches before the failure were stored"
    ds.close()


def test_source_with_another_layout_is_refused_and_names_index_and_field(cache_path: str) -> None:
    ds = MmapCachedDataset(cache_path, fw.Failing(16, bad=7, mode="layout"))
    with pytest.raises(LayoutError, match=r"sample 7, field '0': expected shape \(3, 8, 8\), found \(3, 9, 9\)"):
        ds[7]
    assert not ds.is_cached(7)
    assert sample_equal(ds[8], ImageLabels(16)[8])
    ds.close()


class _Floats(torch.utils.data.Dataset):
    """float32 samples with NaNs of specific payloads, infinities and negative zero."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> Any:
        bits = np.arange(16, dtype=np.uint32) + index
        if index % 2:
            bits[3] = 0x7FC00123  # a quiet NaN with a payload
            bits[4] = 0xFFA00001  # a negative signalling NaN
            bits[5] = 0x7F800000  # +inf
            bits[6] = 0x80000000  # -0.0
        return {"x": torch.from_numpy(bits.view(np.float32).copy()), "i": index}


def test_nan_refused_with_check_finite(cache_path: str) -> None:
    ds = MmapCachedDataset(cache_path, _Floats(), check_finite=True)
    with pytest.raises(ValueError, match=r"sample 3, field 'x': contains NaN or infinite"):
        ds[3]
    assert not ds.is_cached(3)
    assert sample_equal(ds[2], _Floats()[2])
    ds.close()


def test_nan_stored_bit_for_bit_without_check_finite(cache_path: str) -> None:
    with MmapCachedDataset(cache_path, _Floats()) as ds:
        ds.fill()
    with MmapCachedDataset(cache_path) as ds:
        for i in range(8):
            got, want = ds[i]["x"], _Floats()[i]["x"]
            assert got.numpy().view(np.uint32).tolist() == want.numpy().view(np.uint32).tolist()
        raw = np.load(os.path.join(cache_path, "x.npy"), mmap_mode="r")
        assert raw[3].view(np.uint32)[3] == 0x7FC00123 and raw[3].view(np.uint32)[4] == 0xFFA00001


@pytest.mark.slow
def test_hanging_source_surfaces_as_dataloader_timeout(cache_path: str) -> None:
    # ragged=None: no layout probes at creation (a probe of sample 3 would hang the creator instead of a worker)
    ds = MmapCachedDataset(cache_path, fw.Failing(8, bad=3, mode="hang", hang_seconds=30), ragged=None)
    loader = DataLoader(ds, batch_size=None, num_workers=1, timeout=2, multiprocessing_context="fork")
    with pytest.raises(RuntimeError, match="timed out"):
        for _ in loader:
            pass
    del loader
    assert not ds.is_cached(3)
    assert all(ds.is_cached(i) for i in range(3))
    assert sample_equal(ds[4], ImageLabels(8)[4]) and ds.is_cached(4)
    ds.close()


# --- 8. read-only users -----------------------------------------------------------------------------------------


def _make_read_only(path: str) -> None:
    for name in os.listdir(path):
        os.chmod(os.path.join(path, name), 0o444)
    os.chmod(path, 0o555)


def test_unprivileged_user_of_a_read_only_cache(cache_path: str) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user (root ignores file modes)")
    n, filled = 12, [0, 1, 2, 5]
    with MmapCachedDataset(cache_path, ImageLabels(n), ragged=None) as ds:  # no probes: exactly these filled
        ds.fill(filled)
    _make_read_only(cache_path)
    queue = FORK.Queue()
    p = FORK.Process(target=fw.read_only_user, args=(cache_path, n, 65534, filled, queue))
    p.start()
    try:
        out = queue.get(timeout=120)
    finally:
        p.join(30)
    assert p.exitcode == 0
    assert out["uid"] == 65534
    assert out["hits_ok"] and out["misses_ok"] and out["batch_ok"] and out["still_unfilled"], out
    assert "sample 3 is not in the cache" in out["miss_without_source"] and "without a source" in \
        out["miss_without_source"], out
    assert out["read_only_warnings"] == 1 and len(out["warnings"]) == 1, out["warnings"]
    assert "read-only for this process" in out["warnings"][0]
    with MmapCachedDataset(cache_path) as ds:  # nothing was stored by the read-only user
        assert ds.num_cached == len(filled)


def test_read_only_bind_mount(cache_path: str, tmp_path: Any) -> None:
    n = 10
    with MmapCachedDataset(cache_path, ImageLabels(n)) as ds:
        ds.fill([0, 1])
    view = str(tmp_path / "ro")
    os.mkdir(view)
    done = subprocess.run(f"mount --bind {cache_path} {view} && mount -o remount,bind,ro {view}", shell=True,
                          capture_output=True, text=True)
    if done.returncode:
        subprocess.run(["umount", "-l", view], check=False)
        pytest.skip(f"cannot make a read-only bind mount: {done.stderr.strip()}")
    try:
        with MmapCachedDataset(view, ImageLabels(n)) as ds:
            assert sample_equal(ds[1], ImageLabels(n)[1])
            with pytest.warns(CacheReadOnlyWarning, match="read-only for this process"):
                assert sample_equal(ds[4], ImageLabels(n)[4])
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # once per cache: a second miss does not warn again
                assert sample_equal(ds[5], ImageLabels(n)[5])
            assert not ds.is_cached(4)
            with pytest.raises(CacheReadOnlyError, match="read-only"):  # refresh needs to write
                ds.refresh(indices=[0])
    finally:
        subprocess.run(["umount", "-l", view], check=False)


def test_unprivileged_user_cannot_create_in_a_directory_it_may_not_write(shm_dir: str) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    os.chmod(shm_dir, 0o755)  # root's, not writable by uid 65534
    queue = FORK.Queue()
    p = FORK.Process(target=fw.create_as_user, args=(os.path.join(shm_dir, "cache"), 65534, queue))
    p.start()
    try:
        out = queue.get(timeout=120)
    finally:
        p.join(30)
    assert p.exitcode == 0
    assert out["type"] == "CacheReadOnlyError", out
    assert f"cannot create a cache in {shm_dir} (Permission denied)" in out["message"]
    assert "MMAPCACHE_DIR" in out["message"]
    assert os.listdir(shm_dir) == []


def test_unlimited_tmpfs_is_not_refused(small_tmpfs: Any) -> None:
    # tmpfs mounted with size=0 has no limit and reports 0 blocks, 0 free: the up-front check must not refuse it.
    mount = small_tmpfs(0)
    assert os.statvfs(mount).f_blocks == 0
    result = _create_in_child(os.path.join(mount, "cache"), (3, 8, 8), 32, fill=True)
    assert result == {"ok": True, "cached": 32}


# --- 9. file modes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("umask, file_mode, dir_mode", [
    (0o022, 0o644, 0o755),
    (0o002, 0o664, 0o775),
    (0o077, 0o600, 0o700),
    (0o000, 0o664, 0o775),  # never writable by others, even when the umask would allow it
])
def test_created_files_follow_the_umask_and_are_never_world_writable(shm_dir: str, umask: int, file_mode: int,
                                                                     dir_mode: int) -> None:
    path = os.path.join(shm_dir, "root", "cache")  # the parent directory is created too
    old = os.umask(umask)
    try:
        MmapCachedDataset(path, ImageLabels(8), cache_indices=[1, 3, 5]).close()
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o7777 == dir_mode
    assert os.stat(os.path.dirname(path)).st_mode & 0o7777 == dir_mode
    names = sorted(os.listdir(path))
    assert {"meta.json", "0.npy", "1.npy", "slot_index.npy", "filled.bits", "stale.bits", "seq.u32", "lock",
            "users"} <= set(names)
    modes = {name: os.stat(os.path.join(path, name)).st_mode & 0o7777 for name in names}
    assert modes == dict.fromkeys(names, file_mode)
