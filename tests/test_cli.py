"""The ``mmapcache`` command line: inspect, ls, rm, verify, gc, help, and one-line errors on bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import mmapcache
from helpers.sources import ImageLabels
from helpers.stream_sources import Fresh
from mmapcache import MmapCachedDataset
from mmapcache.cli import main
from mmapcache.store.create import make_scratch

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = os.path.join(HERE, "helpers", "cli_sources.py")
ENV = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def make_cache(path: str, n: int = 40, fill: int | None = None, **kwargs: object) -> None:
    """A cache of ``ImageLabels(n)`` holding exactly its first ``fill`` samples (no layout probes, which the creator
    would store too)."""
    kwargs.setdefault("ragged", None)
    with MmapCachedDataset(path, ImageLabels(n), **kwargs) as ds:  # type: ignore[arg-type]
        ds.fill(range(n if fill is None else fill))


def test_inspect_json_keys_and_numbers(cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(cache_path, n=40, fill=10, fingerprint="v1")
    with MmapCachedDataset(cache_path) as ds:  # held open: this process is a user while inspect runs
        assert ds.refresh(indices=[1, 2, 3]) == 3
        code, out, err = run("inspect", cache_path, "--json", capsys=capsys)
    assert code == 0, err
    info = json.loads(out)
    assert {"path", "format_version", "length", "filled", "fraction", "bytes", "fingerprint", "fields", "slots",
            "variants", "stale", "users"} <= set(info)
    assert info["path"] == cache_path and info["format_version"] == 2
    assert (info["length"], info["slots"], info["variants"], info["filled"], info["stale"]) == (40, 40, 1, 10, 3)
    assert info["fraction"] == pytest.approx(0.25) and info["fingerprint"] == "v1"
    assert info["fields"][0] == {"name": "0", "kind": "tensor", "dtype": "uint8", "shape": [3, 8, 8],
                                 "variable": False, "ragged": False, "file": "0.npy", "heap": None}
    assert info["fields"][1]["dtype"] == "int64" and info["fields"][1]["shape"] == []
    assert os.getpid() in info["users"]
    assert info["bytes"] >= 40 * (3 * 8 * 8 + 8)
    assert info["fill_map"] == "@" * 10 + " " * 30  # 40 indices, one cell each: the first quarter is full


def test_inspect_text_and_fill_map_of_a_partial_cache(cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(cache_path, n=200, fill=50, cache_indices=np.arange(100))  # 100 of 200 cacheable
    code, out, _ = run("inspect", cache_path, capsys=capsys)
    assert code == 0
    assert "cacheable:   100 of 200 (50.0%)" in out
    assert "filled:      50 of 100 rows (50.0%)" in out
    fill_line = next(line for line in out.splitlines() if line.startswith("fill map:"))
    cells = fill_line.split("|")[1]
    assert len(cells) == 64 and cells[:16] == "@" * 16 and cells[-30:] == "_" * 30 and " " in cells


def test_inspect_does_not_import_torch(cache_path: str) -> None:
    make_cache(cache_path, n=8)
    code = ("import sys; from mmapcache.cli import main\n"
            f"assert main(['inspect', {cache_path!r}]) == 0\n"
            f"assert main(['ls', {os.path.dirname(cache_path)!r}]) == 0\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_ls_lists_caches_sorted_and_aligned(shm_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(os.path.join(shm_dir, "beta"), n=20, fill=5)
    make_cache(os.path.join(shm_dir, "alpha"), n=8)
    os.makedirs(os.path.join(shm_dir, "not-a-cache"))
    code, out, _ = run("ls", capsys=capsys)  # default: $MMAPCACHE_DIR (the fixture sets it)
    assert code == 0
    lines = out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["NAME", "alpha", "beta"]
    assert lines[1].split()[1:4] == ["8", "100.0%", "100.0%"] and lines[2].split()[1:4] == ["20", "100.0%", "25.0%"]
    assert len({line.index("%") for line in lines[1:]}) == 1  # right-aligned columns
    code, out, _ = run("ls", shm_dir, "--json", capsys=capsys)
    entries = json.loads(out)
    assert [(e["name"], e["length"], e["filled"]) for e in entries] == [("alpha", 8, 8), ("beta", 20, 5)]


def test_rm_refuses_anything_but_caches(shm_dir: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = tmp_path / "data"
    plain.mkdir()
    (plain / "keep.txt").write_text("precious")
    afile = tmp_path / "file.txt"
    afile.write_text("precious")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "meta.json").write_text('{"magic": "something else"}')
    link = os.path.join(shm_dir, "link")
    make_cache(os.path.join(shm_dir, "real"), n=4)
    os.symlink(os.path.join(shm_dir, "real"), link)
    for target in (str(plain), str(afile), str(fake), link, str(tmp_path / "missing")):
        for force in ((), ("--force",)):
            code, _, err = run("rm", target, *force, capsys=capsys)
            assert code == 2 and err.startswith("mmapcache: error:") and len(err.splitlines()) == 1, (target, err)
    assert (plain / "keep.txt").read_text() == "precious" and afile.read_text() == "precious"
    assert (fake / "meta.json").exists() and os.path.islink(link)
    code, out, _ = run("rm", os.path.join(shm_dir, "real"), capsys=capsys)
    assert code == 0 and "removed" in out and not os.path.exists(os.path.join(shm_dir, "real"))


def test_rm_refuses_a_cache_in_use_and_force_removes_it(cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(cache_path, n=4)
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; from mmapcache import MmapCachedDataset\n"
         f"ds = MmapCachedDataset({cache_path!r}); ds[0]; print('ready', flush=True); sys.stdin.read()"],
        env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        code, _, err = run("rm", cache_path, capsys=capsys)
        assert code == 2 and str(holder.pid) in err and "--force" in err
        assert os.path.isdir(cache_path)
        code, _out, err = run("rm", cache_path, "--force", capsys=capsys)
        assert code == 0, err
        assert not os.path.exists(cache_path)
    finally:
        holder.communicate(input="", timeout=30)
    assert holder.returncode == 0  # the holder's mapped pages stayed valid after the removal


def test_rm_force_removes_a_cache_with_damaged_meta(cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(cache_path, n=4)
    with open(os.path.join(cache_path, "meta.json"), "w") as f:
        f.write("{ truncated")
    code, _, err = run("rm", cache_path, capsys=capsys)
    assert code == 2 and "--force" in err
    code, _, _ = run("rm", cache_path, "--force", capsys=capsys)
    assert code == 0 and not os.path.exists(cache_path)


def _corrupt_row(path: str, index: int) -> None:
    """Flips the bytes of one stored image row in 0.npy, read and written without the library."""
    data = np.load(os.path.join(path, "0.npy"), mmap_mode="r+")
    bits = np.unpackbits(np.fromfile(os.path.join(path, "filled.bits"), np.uint8), bitorder="little")
    assert bits[index] == 1
    data[index] = ~data[index]
    data.flush()
    del data


def test_verify_detects_a_corrupted_row(cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(cache_path, n=30)
    source = ["--source", f"{SPEC}:images", "--kwargs", '{"n": 30}']
    code, out, err = run("verify", cache_path, *source, "--all", capsys=capsys)
    assert code == 0, err
    assert "ok: 30 of 30 rows filled, 30 compared" in out
    _corrupt_row(cache_path, 17)
    code, out, err = run("verify", cache_path, capsys=capsys)  # the format alone is still fine
    assert code == 0 and "format only" in out
    code, out, err = run("verify", cache_path, *source, "--all", capsys=capsys)
    assert code == 1
    assert "sample 17 (row 17), field '0'" in err and "1 difference(s)" in out
    code, out, err = run("verify", cache_path, *source, "--samples", "5", capsys=capsys)
    assert code in (0, 1) and "5 compared" in out  # a random 5 of 30: may or may not include row 17


def test_verify_of_a_randomly_augmented_stream_says_why_its_samples_differ(
        cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    # A stream created the guide's way (deterministic by default) from a source that augments at random: every
    # compared sample differs, and the advice was to rebuild the cache or refresh the samples (a new-user trial).
    spec = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "stream_sources.py") + ":fresh"
    MmapCachedDataset(cache_path, Fresh(40), stream=True, seed=0).close()  # (its first positions stored)
    code, out, err = run("verify", cache_path, "--source", spec, "--kwargs", '{"n": 40}', "--all", capsys=capsys)
    assert code == 1 and "difference(s)" in out
    assert "a stream's rows are computed afresh every lap" in err and "deterministic=False" in err
    assert "refresh" not in err
    declared = cache_path + "-declared"
    MmapCachedDataset(declared, Fresh(40), stream=True, seed=0, deterministic=False).close()
    code, out, err = run("verify", declared, "--source", spec, "--kwargs", '{"n": 40}', "--all", capsys=capsys)
    assert code == 0 and "not deterministic" in out, out + err


def test_verify_detects_damaged_state(cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(cache_path, n=30, fill=8)
    stale = os.path.join(cache_path, "stale.bits")
    with open(stale, "r+b") as f:
        f.seek(3)
        f.write(b"\x01")  # row 24: stale but never filled
    code, _, err = run("verify", cache_path, capsys=capsys)
    assert code == 1 and "stale.bits: 1 row(s) (first: 24)" in err
    with open(os.path.join(cache_path, "filled.bits"), "r+b") as f:
        f.seek(2)
        f.write(b"\x01")  # row 16: filled but its counter is 0: detected when opening
    code, _, err = run("verify", cache_path, capsys=capsys)
    assert code == 1 and "never written" in err and len(err.splitlines()) == 1  # damage: 1, even found opening


def test_gc_removes_leftovers_of_dead_processes(shm_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(os.path.join(shm_dir, "kept"), n=4)  # first: creating a cache sweeps too
    # A creator that died mid-creation leaves its marked scratch directory; a live one's must stay.
    dead = subprocess.run([sys.executable, "-c", f"from mmapcache.store.create import make_scratch; "
                           f"print(make_scratch({shm_dir!r}, 'new'))"], capture_output=True, text=True, env=ENV,
                          timeout=60, check=True)
    leftover = dead.stdout.strip()
    alive = make_scratch(shm_dir, "new")
    code, out, _ = run("gc", capsys=capsys)
    assert code == 0 and f"removed {leftover}" in out
    assert not os.path.exists(leftover) and os.path.isdir(alive) and os.path.isdir(os.path.join(shm_dir, "kept"))
    shutil.rmtree(alive)
    code, out, _ = run("gc", shm_dir, capsys=capsys)
    assert code == 0 and "nothing to remove" in out


def test_help_of_each_command_shows_an_example() -> None:
    for command in ("build", "inspect", "ls", "rm", "verify", "gc"):
        out = subprocess.run([sys.executable, "-m", "mmapcache", command, "--help"], capture_output=True, text=True,
                             env=ENV, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "example" in out.stdout and f"mmapcache {command}" in out.stdout


BAD_INPUTS = [
    (["inspect", "{missing}"], "no cache at"),
    (["inspect", "{plain}"], "is not an mmapcache cache"),
    (["inspect", "{corrupt}"], "is not valid JSON"),
    (["inspect", "{file}"], "is a file"),
    (["build", "{new}", "--dataset", "no_such_module_xyz:Data"], "cannot import module"),
    (["build", "{new}", "--dataset", "{spec}:NoSuchName"], "has no attribute 'NoSuchName'"),
    (["build", "{new}", "--dataset", "missing/file.py:f"], "does not exist"),
    (["build", "{new}", "--dataset", "nocolon"], "is malformed"),
    (["build", "{new}", "--dataset", "{spec}:broken_factory"], "the data root /nonexistent does not exist"),
    (["build", "{new}", "--dataset", "{spec}:not_a_dataset"], "not a map-style dataset"),
    (["build", "{new}", "--dataset", "{spec}:empty"], "is empty"),
    (["build", "{new}", "--dataset", "{spec}:images", "--kwargs", '{"nope": 1}'], "unexpected keyword argument"),
    (["build", "{new}", "--dataset", "{spec}:images", "--kwargs", "{bad"], "is not valid JSON"),
    (["build", "{new}", "--dataset", "{spec}:images", "--kwargs", "[1]"], "must be a JSON object"),
    (["build", "{new}", "--dataset", "{spec}:images", "--shard", "2/2"], "0 <= I < N"),
    (["build", "{new}", "--dataset", "{spec}:images", "--shard", "x"], "0 <= I < N"),
    (["build", "{new}", "--dataset", "{spec}:images", "--indices", "5:2"], "0 <= A < B"),
    (["build", "{new}", "--dataset", "{spec}:images", "--workers", "0"], "not a positive integer"),
    (["build", "{new}", "--dataset", "{spec}:images", "--max-bytes", "12Q"], "is not a size"),
    (["build", "{new}", "--dataset", "{spec}:images", "--max-bytes", "10"], "smaller than one sample"),
    (["build", "{new}", "--dataset", "{spec}:images", "--refresh", "2"], "fraction in [0, 1]"),
    (["build", "{cache}", "--dataset", "{spec}:images", "--kwargs", '{"n": 5}'], "different source"),
    (["build", "{new}"], "--dataset"),
    (["verify", "{cache}", "--kwargs", "{}"], "needs --source"),
    (["verify", "{cache}", "--samples", "-3"], "not a positive integer"),
    (["ls", "{file}"], "is a file"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[" ".join(a) or "(none)" for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, shm_dir: str, tmp_path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    cache = os.path.join(shm_dir, "cache")
    make_cache(cache, n=8)
    corrupt = os.path.join(shm_dir, "corrupt")
    make_cache(corrupt, n=8)
    with open(os.path.join(corrupt, "meta.json"), "w") as f:
        f.write("{ not json")
    (tmp_path / "plain").mkdir()
    (tmp_path / "file").write_text("x")
    names = {"missing": str(tmp_path / "missing"), "plain": str(tmp_path / "plain"), "corrupt": corrupt,
             "file": str(tmp_path / "file"), "new": os.path.join(shm_dir, "new"), "cache": cache, "spec": SPEC}
    def fill_in(arg: str) -> str:
        for key, value in names.items():
            arg = arg.replace("{" + key + "}", value)
        return arg

    code, _out, err = run(*map(fill_in, argv), capsys=capsys)
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("mmapcache: error:"), err
    assert message in err and "Traceback" not in err
    assert not os.path.exists(names["new"])  # nothing half-made


def test_bad_input_in_a_real_process_and_debug_traceback(tmp_path) -> None:
    missing = str(tmp_path / "missing")
    for prog in ([sys.executable, "-m", "mmapcache"], ["mmapcache"]):
        out = subprocess.run([*prog, "inspect", missing], capture_output=True, text=True, env=ENV, timeout=60)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.startswith("mmapcache: error: no cache at") and len(out.stderr.splitlines()) == 1
    out = subprocess.run([sys.executable, "-m", "mmapcache", "inspect", missing, "--debug"], capture_output=True,
                         text=True, env=ENV, timeout=60)
    assert out.returncode == 2 and "Traceback" in out.stderr and "CacheNotFoundError" in out.stderr


def test_variable_shapes_build_inspect_and_verify(cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run("build", cache_path, "--dataset", f"{SPEC}:Ragged", "--max-shapes", '{"tokens": [8]}',
                         "--workers", "2", capsys=capsys)
    assert code == 0, err
    code, out, _ = run("inspect", cache_path, "--json", capsys=capsys)
    tokens = json.loads(out)["fields"][0]
    assert (tokens["name"], tokens["dtype"], tokens["shape"], tokens["variable"]) == ("tokens", "int32", [8], True)
    code, out, err = run("verify", cache_path, "--source", f"{SPEC}:Ragged", "--all", capsys=capsys)
    assert code == 0 and "20 compared" in out, err
    shapes = np.load(os.path.join(cache_path, "tokens.shape.npy"), mmap_mode="r+")
    shapes[4] = 9  # beyond the field's maximum of 8
    shapes.flush()
    del shapes
    code, _, err = run("verify", cache_path, capsys=capsys)
    assert code == 1 and "row 4 holds shape (9,), outside the maximum (8,) of field 'tokens'" in err


def test_ragged_build_inspect_and_verify_with_damage(cache_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run("build", cache_path, "--dataset", f"{SPEC}:Ragged", "--ragged", "tokens", "--workers", "2",
                         capsys=capsys)
    assert code == 0, err
    code, out, _ = run("inspect", cache_path, capsys=capsys)
    # 20 values of index % 7 + 1 int32s: 4 * 77 = 308 bytes, packed.
    assert "tokens: tensor int32 * (ragged: 308 B used, 0 B free for reuse, 0 B abandoned" in out, out
    code, out, err = run("verify", cache_path, "--source", f"{SPEC}:Ragged", "--all", capsys=capsys)
    assert code == 0 and "20 compared" in out, err
    keys = np.memmap(os.path.join(cache_path, "keys.i64"), "<i8", "r+")
    keys[3] = 7
    keys.flush()
    del keys
    code, _, err = run("verify", cache_path, capsys=capsys)
    assert code == 1 and "keys.i64: 1 filled row(s) (first: 3) hold the key 7, not the index 3" in err, err
    index = np.load(os.path.join(cache_path, "tokens.index.npy"), mmap_mode="r+")
    index[5, 0] = index[6, 0]  # two rows on one extent
    index.flush()
    del index
    code, _, err = run("verify", cache_path, capsys=capsys)
    assert code == 1 and re.search(r"tokens\.heap: extents \(\d+, \d+\) and \(\d+, \d+\) .* overlap", err), err


def test_ls_shows_the_cacheable_share_of_a_partial_cache(shm_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A full max_bytes cache that holds a quarter of the samples must not read as a bare "100.0%"."""
    make_cache(os.path.join(shm_dir, "part"), n=40, cache_indices=list(range(10)))
    _code, out, _ = run("ls", capsys=capsys)
    header, line = out.strip().splitlines()
    assert header.split()[:4] == ["NAME", "LENGTH", "CACHEABLE", "FILLED"]
    assert line.split()[:4] == ["part", "40", "25.0%", "100.0%"]


def test_version_typo_help_legend_and_not_a_cache(shm_dir: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run("--version", capsys=capsys)
    assert code == 0 and out.strip() == f"mmapcache {mmapcache.__version__}"
    code, _, err = run("build", "x", "--dataset", "a:b", "--wrkers", "2", capsys=capsys)
    assert code == 2 and "unrecognized arguments: --wrkers" in err and "`mmapcache build --help`" in err
    make_cache(os.path.join(shm_dir, "c"), n=40, fill=20)
    code, out, _ = run("inspect", os.path.join(shm_dir, "c"), capsys=capsys)
    assert code == 0 and "modified" not in out
    assert "' ' empty, '.:-=+*#%' partly filled (more to the right), '@' full, '_' not cacheable" in out
    code, _, err = run("inspect", str(tmp_path), capsys=capsys)
    assert code == 2 and "is not an mmapcache cache (it has no meta.json)" in err and "remove" not in err


# --- rough edges a new user met -------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["ls", "inspect"])
def test_output_into_a_closed_pipe_stops_quietly(shm_dir: str, command: str) -> None:
    # `mmapcache ls | head -1` printed "error: [Errno 32] Broken pipe" and exited 2.
    make_cache(os.path.join(shm_dir, "c"), n=10)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    argv = ["ls", shm_dir] if command == "ls" else ["inspect", os.path.join(shm_dir, "c")]
    done = subprocess.run([sys.executable, "-m", "mmapcache", *argv], stdout=write, stderr=subprocess.PIPE,
                          env=ENV, timeout=60)
    os.close(write)
    assert (done.returncode, done.stderr) == (141, b"")  # as a Unix tool killed by SIGPIPE: 128 + 13, nothing said


def test_verify_of_a_changed_source_says_so_in_one_line_per_field(cache_path: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # An 8 px cache verified against a 4 px source advised "declare it ragged" on one 600-character line per sample,
    # summed up as "0 problem(s), 30 difference(s)".
    make_cache(cache_path, n=30)
    code, out, err = run("verify", cache_path, "--source", f"{SPEC}:images", "--kwargs",
                         '{"n": 30, "shape": [3, 4, 4]}', "--all", capsys=capsys)
    assert code == 1
    lines = err.splitlines()
    assert lines[0] == ("mmapcache: differs: the cache stores field '0' of shape (3, 8, 8), the source gives shape "
                        "(3, 4, 4) (samples 0, 1, 2, 3, 4 and 25 more): the source is not the one the cache was built "
                        "from")
    assert len(lines) == 2 and "the source or its preprocessing changed since the cache was built" in lines[1]
    assert "ragged" not in lines[0] and len(lines[1]) < 400
    assert "0 problem(s), 30 difference(s): 30 of 30 rows filled, 30 compared with the source" in out


def test_ls_shows_a_stream_as_its_ring(shm_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    # A stream read "CACHEABLE 32.2%", as if it were a partial cache.
    with MmapCachedDataset(os.path.join(shm_dir, "s"), ImageLabels(100), stream=True, max_bytes="8K") as ds:
        slots = ds.stream_stats["slots"]
        code, out, _ = run("ls", capsys=capsys)
    assert code == 0 and 0 < slots < 100
    row = out.splitlines()[1].split()
    assert row[:6] == ["s", "100", "stream:", "ring", "of", str(slots)], out
